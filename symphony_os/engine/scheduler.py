"""The batch scheduler (level 2): decides which pending `pred` work runs in the next forward
pass. It never touches tensors or KV pages; it returns a `BatchPlan` of plain data.

Policy: under a token budget and a cap on the batch's sequences (its seats), decodes (requests
with one token left) go first, then prefills, chunked into what remains of the budget: with
several tenants' prefills waiting, each tenant's earliest first gets an equal share of it, then
the rest goes in arrival order. With several tenants waiting at all, each one's decodes first
take at most an equal share of the seats and the budget, and only once the others' prefills are
in do the decodes held back fill what is left: one tenant's stream of decodes (a process with
hundreds of forks) cannot keep another's prompt out of every batch. A KV file is written by at
most one request per batch, in arrival order, so writes to one file never race.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..kv.kvfs import KvFile
from .pred_future import PredFuture
from .sampling import Want

_perf_counter = time.perf_counter


class PredRequest:
    """One `pred` call: append `tokens` (at `positions`) to `file`, then answer `want`.

    `positions` None means "continue the file" and is fixed when the first chunk runs.
    (A class of its own, not a dataclass: one is made per token of every sequence, and the
    generated __init__ with its default factories cost twice the bytecodes of this one.)
    """

    __slots__ = ("file", "tokens", "positions", "want", "future", "submitted_at", "done", "length_before",
                 "started_at", "each", "tentative")

    def __init__(self, file: KvFile, tokens: list[int], positions: list[int] | None, want: Want,
                 future: PredFuture | None = None):
        self.file = file
        self.tokens = tokens
        self.positions = positions
        self.want = want
        # What the engine answers (its `settle(result, error)`): a PredFuture, or the caller's own.
        self.future = PredFuture() if future is None else future
        self.submitted_at = _perf_counter()
        self.done = 0  # tokens already appended by earlier chunks
        self.length_before: int | None = None  # the file's length when the first chunk ran (for rollback)
        self.started_at: float | None = None
        self.each: list | None = None  # GreedyEach's argmaxes, ScoreEach's scores: the chunks' so far
        self.tentative = False  # a step nobody asked for yet (speculation.py): its token is not the file's

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done

    def __repr__(self) -> str:
        return (f"PredRequest(file={self.file.file_id}, tokens={len(self.tokens)}, done={self.done}, "
                f"want={self.want!r})")


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

    def discard(self, request: PredRequest) -> bool:
        """Take a request out of the queue if it is there (a dropped speculation)."""
        return self.waiting.pop(id(request), None) is not None

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
        prefill_owners: dict[str, None] = {}  # tenants with prefill work, in order of arrival
        # The tenants waiting, counted once a batch (kept per request, it cost every add and
        # remove two dict updates: 3% of a LIP's round).
        tenants = len({request.file.owner for request in self.waiting.values()})
        # Decodes first, each tenant's up to its share when several wait (None: no cap). A file
        # whose earlier request is skipped in a pass takes no later one in that pass (order).
        share = max(1, min(self.max_batch_size, self.token_budget) // tenants) if tenants > 1 else None
        decodes: dict[str, int] = {}  # tenant -> its decodes in this batch (with a share only)
        held_back = False  # a decode waits for the others' prefills
        skipped_files: set[int] = set()
        for request in self.waiting.values():
            if budget == 0 or room == 0:
                break
            file = request.file
            file_id = file.file_id
            if len(request.tokens) - request.done != 1:  # request.remaining, inline: once per request
                prefill_owners[file.owner] = None
                skipped_files.add(file_id)
            elif file_id in busy_files or file_id in skipped_files:
                skipped_files.add(file_id)
            elif share is not None and decodes.get(file.owner, 0) >= share:
                held_back = True
                skipped_files.add(file_id)
            else:
                if share is not None:
                    decodes[file.owner] = decodes.get(file.owner, 0) + 1
                chunks.append(ScheduledChunk(request, request.done, 1, True))
                busy_files.add(file_id)
                budget -= 1
                room -= 1
        if prefill_owners:
            budget, room = self._plan_prefills(chunks, prefill_owners, busy_files, budget, room)
        if held_back:  # the decodes past their shares, in arrival order, into what is left
            self._plan_held_back_decodes(chunks, busy_files, budget, room)
        return BatchPlan(chunks)

    def _plan_prefills(self, chunks: list[ScheduledChunk], prefill_owners: dict[str, None], busy_files: set[int],
                       budget: int, room: int) -> tuple[int, int]:
        """Add prefill chunks (see the module docstring); returns the budget and room left."""
        # Prefills: with several tenants waiting, each first gets a share of the budget for its
        # earliest request (a tenant's long prompts queued first held the others' short ones
        # back for their whole length); then the rest of the budget goes in arrival order, a
        # request that had a share growing its chunk.
        share = max(1, budget // len(prefill_owners)) if len(prefill_owners) > 1 else None
        shared: dict[int, ScheduledChunk] = {}  # id(request) -> its chunk from the shares
        for per_owner in ((True, False) if share else (False,)):
            skipped_files, served = set(), set()
            for request in self.waiting.values():
                if budget == 0 or (room == 0 and not shared):
                    break
                remaining = request.remaining
                chunk = shared.get(id(request)) if not per_owner else None
                if chunk is not None:
                    more = min(remaining - chunk.count, budget)
                    chunk.count += more
                    chunk.is_last = chunk.count == remaining
                    budget -= more
                    continue
                file_id, owner = request.file.file_id, request.file.owner
                if (room == 0 or remaining == 1 or file_id in busy_files or file_id in skipped_files
                        or (per_owner and owner in served)):
                    skipped_files.add(file_id)
                    continue
                count = min(remaining, budget, share) if per_owner else min(remaining, budget)
                chunk = ScheduledChunk(request, request.done, count, count == remaining)
                chunks.append(chunk)
                if per_owner:
                    shared[id(request)] = chunk
                    served.add(owner)
                busy_files.add(file_id)
                budget -= count
                room -= 1
        return budget, room

    def _plan_held_back_decodes(self, chunks: list[ScheduledChunk], busy_files: set[int], budget: int,
                                room: int) -> None:
        """Add the decodes not in the batch yet, in arrival order, while budget and room last."""
        skipped_files: set[int] = set()
        for request in self.waiting.values():
            if budget == 0 or room == 0:
                return
            file_id = request.file.file_id
            if file_id in busy_files or file_id in skipped_files or request.remaining != 1:
                skipped_files.add(file_id)  # (a file in the batch already is busy: its decode is in)
                continue
            chunks.append(ScheduledChunk(request, request.done, 1, True))
            busy_files.add(file_id)
            budget -= 1
            room -= 1
