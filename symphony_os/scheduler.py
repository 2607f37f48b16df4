"""The batch scheduler (level 2): decides which pending `pred` work runs in the next forward
pass. It never touches tensors or KV pages; it returns a `BatchPlan` of plain data.

Policy: under a token budget, decodes (requests with one token left) go first, then prefills
in arrival order, chunked into what remains of the budget. A KV file is written by at most one
request per batch, in arrival order, so writes to one file never race.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .kvfs import KvFile
from .pred_future import PredFuture
from .sampling import Want


@dataclass(eq=False, slots=True)
class PredRequest:
    """One `pred` call: append `tokens` (at `positions`) to `file`, then answer `want`.

    `positions` None means "continue the file" and is fixed when the first chunk runs.
    """

    file: KvFile
    tokens: list[int]
    positions: list[int] | None
    want: Want
    future: PredFuture = field(default_factory=PredFuture)
    submitted_at: float = field(default_factory=time.perf_counter)
    done: int = 0  # tokens already appended by earlier chunks
    length_before: int | None = None  # the file's length when the first chunk ran (for rollback)
    started_at: float | None = None
    greedy_each: list[int] | None = None  # GreedyEach: argmaxes of the chunks so far

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens [start, start + count) of a request, run in this batch; `is_last` when they end it."""

    request: PredRequest
    start: int
    count: int
    is_last: bool


@dataclass(slots=True)
class BatchPlan:
    chunks: list[ScheduledChunk]

    @property
    def num_tokens(self) -> int:
        return sum(c.count for c in self.chunks)


class BatchScheduler:
    """Holds pending requests and plans batches. Not thread-safe: the engine serialises calls."""

    def __init__(self, token_budget: int = 512, max_batch_size: int = 256):
        if token_budget <= 0 or max_batch_size <= 0:
            raise ValueError("token_budget and max_batch_size must be positive")
        self.token_budget = token_budget
        self.max_batch_size = max_batch_size
        # Insertion-ordered: arrival order for planning, O(1) removal when a request finishes.
        self.waiting: dict[int, PredRequest] = {}

    def add(self, request: PredRequest) -> None:
        self.waiting[id(request)] = request

    def remove_all(self, requests: list[PredRequest]) -> None:
        waiting = self.waiting
        for request in requests:
            del waiting[id(request)]

    def __len__(self) -> int:
        return len(self.waiting)

    def schedule(self) -> BatchPlan | None:
        """The next batch, or None when nothing waits."""
        if not self.waiting:
            return None
        chunks: list[ScheduledChunk] = []
        budget = self.token_budget
        room = self.max_batch_size  # chunks still allowed
        busy_files: set[int] = set()
        prefills = False
        for decode_pass in (True, False):
            if not decode_pass and not prefills:
                break  # only decodes wait: the first pass saw them all
            # A file whose earlier request is skipped in this pass takes no later one (order).
            skipped_files: set[int] = set()
            for request in self.waiting.values():
                if budget == 0 or room == 0:
                    break
                file_id = request.file.file_id
                remaining = request.remaining
                if remaining != 1:
                    prefills = True
                if file_id in busy_files or file_id in skipped_files or (remaining == 1) != decode_pass:
                    skipped_files.add(file_id)
                    continue
                count = remaining if remaining <= budget else budget
                chunks.append(ScheduledChunk(request, request.done, count, count == remaining))
                busy_files.add(file_id)
                budget -= count
                room -= 1
        return BatchPlan(chunks)
