"""CUDA graphs of the decode step: the model forward and the logits projection of a batch in
which every sequence adds one token, captured once per padded batch size and replayed.

A batch of n sequences runs as the graph of the smallest captured size >= n over static input
buffers; rows past n are padding (slot -1: no K/V store; context 0: no attention). The inputs
reach the GPU in two copies from pinned memory, with no host sync. Graphs are captured the
first time a size is needed and share one memory pool (they never run concurrently). Mixed and
prefill batches, page tables wider than the graphs' and backends that decide on the host
from tensor values (the torch reference) run eagerly.
"""
from __future__ import annotations

import os

import torch

from ..kv.pool import KVPool
from ..model.attention import AttentionMetadata
from ..model.decoder import DecoderModel

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Context a graph's page table covers. Wider tables cost little (the decode kernel stops at
# each sequence's length) but pick more split-K programs; longer sequences run eagerly.
MAX_GRAPH_CONTEXT = 8192
CAPTURABLE_BACKENDS = ("triton",)


def graphs_enabled(device: torch.device, backend) -> bool:
    """Graphs run on CUDA with a capturable backend, unless $SYMPHONY_CUDA_GRAPHS is 0."""
    return (torch.device(device).type == "cuda" and backend.name in CAPTURABLE_BACKENDS
            and os.environ.get("SYMPHONY_CUDA_GRAPHS", "1") != "0")


class DecodeGraphs:
    """The captured decode steps of one model over one pool."""

    def __init__(self, model: DecoderModel, pool: KVPool, backend):
        self.model, self.pool, self.backend = model, pool, backend
        self.max_batch = GRAPH_BATCH_SIZES[-1]
        self.max_context = min(model.cfg.max_position_embeddings, MAX_GRAPH_CONTEXT)
        self.max_pages = -(-self.max_context // pool.page_size)
        rows = self.max_batch
        # int64 rows: input ids, positions, slots, and the rows whose logits are wanted.
        self._host_i64 = torch.zeros(4, rows, dtype=torch.int64, pin_memory=True)
        # int32: context lengths [rows], then the page table [rows, max_pages].
        self._host_i32 = torch.zeros(rows * (1 + self.max_pages), dtype=torch.int32, pin_memory=True)
        self._inputs_i64 = torch.zeros_like(self._host_i64, device=model.device)
        self._inputs_i32 = torch.zeros_like(self._host_i32, device=model.device)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata]] = {}
        self._memory_pool = None

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def fits(self, seqs) -> bool:
        """Whether `seqs` (SequenceInputs) can run as a graph."""
        return len(seqs) <= self.max_batch and all(
            len(s.tokens) == 1 and not s.greedy_each and s.score_k < 0 and s.context_len <= self.max_context
            and len(s.page_table) <= self.max_pages for s in seqs)

    def run(self, seqs) -> torch.Tensor:
        """The float32 logits [N, vocab] of the sequences with `wants_logits`, in order, in a
        tensor of their own (the graph's output buffer is reused by the next replay)."""
        size = next(s for s in GRAPH_BATCH_SIZES if s >= len(seqs))
        wanting = self._stage(seqs, size)
        graph, logits, _meta = self._graphs.get(size) or self._capture(size)
        graph.replay()
        return logits.index_select(0, self._inputs_i64[3, :wanting])

    def _stage(self, seqs, size: int) -> int:
        """Write the batch, padded to `size`, into the static inputs; returns how many rows
        want logits."""
        n, rows = len(seqs), self.max_batch
        self._copied.synchronize()  # the last batch's copy has left the pinned buffers
        i64 = self._host_i64.numpy()
        i64[0, :n] = [s.tokens[0] for s in seqs]
        i64[1, :n] = [s.positions[0] for s in seqs]
        i64[2, :n] = [s.slots[0] for s in seqs]
        i64[0:2, n:size] = 0
        i64[2, n:size] = -1
        wanting = [i for i, s in enumerate(seqs) if s.wants_logits]
        i64[3, :len(wanting)] = wanting
        i32 = self._host_i32.numpy()
        i32[:n] = [s.context_len for s in seqs]
        i32[n:size] = 0
        # Entries past a sequence's own pages are stale but never read: the kernel stops at its length.
        table = i32[rows:].reshape(rows, self.max_pages)
        for row, s in enumerate(seqs):
            table[row, :len(s.page_table)] = s.page_table
        used_i32 = rows + size * self.max_pages
        self._inputs_i64.copy_(self._host_i64, non_blocking=True)
        self._inputs_i32[:used_i32].copy_(self._host_i32[:used_i32], non_blocking=True)
        self._copied.record()
        return len(wanting)

    def _metadata(self, size: int) -> AttentionMetadata:
        rows, device = self.max_batch, self.model.device
        return AttentionMetadata(
            slot_mapping=self._inputs_i64[2, :size],
            page_table=self._inputs_i32[rows:rows + size * self.max_pages].view(size, self.max_pages),
            context_lens=self._inputs_i32[:size],
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            query_lens=[1] * size,
            context_lens_host=[self.max_context] * size,  # a bound: the graph serves any context up to it
            page_size=self.pool.page_size,
            sliding_window=self.model.cfg.sliding_window,
        )

    def _capture(self, size: int):
        meta = self._metadata(size)
        input_ids, positions = self._inputs_i64[0, :size], self._inputs_i64[1, :size]

        def step() -> torch.Tensor:
            hidden = self.model.forward(input_ids, positions, meta, self.pool, self.backend)
            return self.model.logits(hidden)

        # One eager run first (compiles the kernels, sizes cuBLAS workspaces). It runs on this
        # batch's staged inputs and stores the same K/V that the replay then stores again.
        step()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a distribution copied to the host) do
        # not abort a capture on the engine thread.
        with torch.cuda.graph(graph, pool=self._memory_pool, capture_error_mode="thread_local"):
            logits = step()
        self._memory_pool = graph.pool()
        self._graphs[size] = (graph, logits, meta)
        return self._graphs[size]
