"""Turns a batch of prepared sequences (plain lists) into tensors, runs the model over the paged
pool, and returns the logits of the rows that need a next-token distribution. On CUDA, decode
batches replay captured graphs (`cuda_graph.py`); everything else runs eagerly."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np
import torch

from ..kv.pool import KVPool
from ..model.attention import AttentionMetadata
from ..model.decoder import DecoderModel
from .cuda_graph import DecodeGraphs, graphs_enabled


@dataclass(slots=True)
class SequenceInput:
    """One sequence of a batch: its new tokens, their positions and slots, and its pages."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    page_table: list[int]
    context_len: int  # cached tokens after this append
    wants_logits: bool  # the logits of its last token are returned
    greedy_each: bool = False  # instead: the argmax after every token, written to `argmax_each`
    argmax_each: list[int] | None = None  # output of `run` for a greedy_each sequence
    # A ScoreEach chunk's: the top k (-1: not one), the token each row is scored against (the one
    # after it: a row without one, the request's last, is not scored), and the output of `run`:
    # per scored row (log-probability, top ids, their log-probabilities).
    score_k: int = -1
    score_next: list[int] | None = None
    scores: list[tuple[float, list[int], list[float]]] | None = None


def padded_page_table(page_tables: list[list[int]]) -> np.ndarray:
    """int32 [rows, longest], each row a sequence's pages, padded with 0: filled in one numpy
    assignment (a nested list through torch.tensor cost 3x as much: 410 against 130 us for
    128 sequences of ~64 pages)."""
    lengths = np.fromiter(map(len, page_tables), dtype=np.int64, count=len(page_tables))
    table = np.zeros((len(page_tables), int(lengths.max(initial=0))), dtype=np.int32)
    table[np.arange(table.shape[1]) < lengths[:, None]] = np.fromiter(
        chain.from_iterable(page_tables), dtype=np.int32, count=int(lengths.sum()))
    return table


# Rows of full logits computed at a time for a greedy_each sequence, of which only the argmax
# is kept: a 4096-token draft would otherwise hold 4096 x vocab float32 (2.5 GB at 151,936).
ARGMAX_ROWS = 64


class ModelRunner:
    def __init__(self, model: DecoderModel, pool: KVPool, backend):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = model.device
        self.graphs = DecodeGraphs(model, pool, backend) if graphs_enabled(self.device, backend) else None

    def build_metadata(self, seqs: list[SequenceInput]) -> AttentionMetadata:
        device = self.device
        query_lens = [len(s.tokens) for s in seqs]
        starts = [0, *accumulate(query_lens)]
        slots = [slot for s in seqs for slot in s.slots]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            page_table=torch.from_numpy(padded_page_table([s.page_table for s in seqs])).to(device),
            context_lens=torch.tensor([s.context_len for s in seqs], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            query_lens=query_lens,
            context_lens_host=[s.context_len for s in seqs],
            page_size=self.pool.page_size,
            sliding_window=self.model.cfg.sliding_window,
        )

    def run(self, seqs: list[SequenceInput]) -> torch.Tensor:
        """Forward pass over all sequences; float32 logits [N, vocab] of the last token of each
        sequence with `wants_logits`, in order. Each `greedy_each` sequence gets its
        `argmax_each` instead."""
        if self.graphs is not None and self.graphs.fits(seqs):
            return self.graphs.run(seqs)
        return self.run_eager(seqs)

    def run_eager(self, seqs: list[SequenceInput]) -> torch.Tensor:
        """`run` without graphs."""
        meta = self.build_metadata(seqs)
        device = self.device
        input_ids = torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int64, device=device)
        positions = torch.tensor([p for s in seqs for p in s.positions], dtype=torch.int64, device=device)
        hidden = self.model.forward(input_ids, positions, meta, self.pool, self.backend)
        last_rows = []
        for s, end in zip(seqs, accumulate(meta.query_lens)):
            if s.greedy_each:
                s.argmax_each = self._argmax_rows(hidden, end - len(s.tokens), end)
            elif s.score_k >= 0:
                start = end - len(s.tokens)
                s.scores = self._score_rows(hidden, start, start + len(s.score_next), s.score_next, s.score_k)
            elif s.wants_logits:
                last_rows.append(end - 1)
        if not last_rows:
            return torch.empty(0, self.model.cfg.vocab_size, device=device)
        return self.model.logits(hidden[torch.tensor(last_rows, device=device)])

    def _score_rows(self, hidden: torch.Tensor, start: int, end: int, targets: list[int],
                    k: int) -> list[tuple[float, list[int], list[float]]]:
        """Rows [start, end) scored, ARGMAX_ROWS at a time: the log-probability of each row's
        target token and the row's k most likely (ties in id order), one transfer a block."""
        scores: list[tuple[float, list[int], list[float]]] = []
        for first in range(start, end, ARGMAX_ROWS):
            last = min(first + ARGMAX_ROWS, end)
            logprobs = torch.log_softmax(self.model.logits(hidden[first:last]).float(), dim=-1)
            wanted = torch.tensor(targets[first - start:last - start], dtype=torch.int64, device=logprobs.device)
            chosen = logprobs.gather(1, wanted[:, None]).squeeze(1).tolist()
            if k == 0:
                scores += [(value, [], []) for value in chosen]
                continue
            values, ids = logprobs.topk(k, dim=-1)
            order = ids.argsort(dim=-1)  # ties in id order: by id, then stably by value
            ids, values = ids.gather(1, order), values.gather(1, order)
            order = values.argsort(dim=-1, descending=True, stable=True)
            ids, values = ids.gather(1, order).tolist(), values.gather(1, order).tolist()
            scores += list(zip(chosen, ids, values))
        return scores

    def _argmax_rows(self, hidden: torch.Tensor, start: int, end: int) -> list[int]:
        """The argmax of the logits of rows [start, end), ARGMAX_ROWS rows at a time."""
        tokens: list[int] = []
        for first in range(start, end, ARGMAX_ROWS):
            rows = hidden[first:min(first + ARGMAX_ROWS, end)]
            tokens += self.model.logits(rows).argmax(dim=-1).tolist()
        return tokens
