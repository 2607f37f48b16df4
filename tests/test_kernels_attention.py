"""Paged attention kernels against a float64 reference written out per sequence. Without a GPU
the kernels run in Triton's CPU interpreter; with one, the same tests (and bf16) run on it."""
from __future__ import annotations

import pytest
import torch

from symphony_os.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
        DEVICE != "cuda", reason="bf16 kernels are checked on a GPU; the CPU interpreter checks fp32")),
]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

# (page_size, head_dim, GQA group, num_kv_heads)
SHAPES = [
    pytest.param(4, 16, 1, 2, id="page4-dim16-group1"),
    pytest.param(16, 64, 2, 2, id="page16-dim64-group2"),
    pytest.param(4, 64, 4, 1, id="page4-dim64-group4"),
    pytest.param(16, 16, 3, 1, id="page16-dim16-group3"),
]


class PagedBatch:
    """Sequences of the given lengths laid out in a random pool of pages; sequence 1 shares
    the full pages of sequence 0's prefix (as after a fork), and page 0 holds real tokens."""

    def __init__(self, context_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, seed: int):
        generator = torch.Generator().manual_seed(seed)
        pages_needed = [-(-length // page_size) for length in context_lens]
        num_pages = sum(pages_needed) + 3
        free_pages = torch.randperm(num_pages, generator=generator).tolist()
        self.page_size = page_size
        self.context_lens = context_lens
        self.pages: list[list[int]] = []
        for b, count in enumerate(pages_needed):
            shared = []
            if b == 1:
                shared = self.pages[0][: min(context_lens[0], context_lens[1]) // page_size]
            self.pages.append(shared + [free_pages.pop() for _ in range(count - len(shared))])
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=generator).to(DEVICE, dtype)
        self.v_cache = torch.randn(shape, generator=generator).to(DEVICE, dtype)
        table = torch.zeros(len(context_lens), max(pages_needed), dtype=torch.int32)
        for b, pages in enumerate(self.pages):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.page_table = table.to(DEVICE)
        self.context_lens_tensor = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)

    def reference(self, b: int, q: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
        """float64 attention of q [n, H, D], the last n tokens of sequence b, over its cache
        (each query at index p over keys p - window + 1 .. p, with a window)."""
        num_queries, num_heads, _ = q.shape
        length = self.context_lens[b]
        index = torch.arange(length)
        pages = torch.tensor(self.pages[b])[index // self.page_size]
        keys = self.k_cache.cpu().double()[pages, index % self.page_size]  # [L, Hkv, D]
        values = self.v_cache.cpu().double()[pages, index % self.page_size]
        group = num_heads // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q.cpu().double(), keys) * scale
        query_pos = length - num_queries + torch.arange(num_queries)
        scores = scores.masked_fill(index[None, None, :] > query_pos[None, :, None], float("-inf"))
        if window is not None:
            scores = scores.masked_fill(index[None, None, :] <= query_pos[None, :, None] - window, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.cpu().double() - ref).abs().max() / ref.abs().max())


def query_view(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, seed: int):
    """q as the query part of a fused qkv projection: a strided view, as the model passes it."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    return qkv[:, :num_heads]


def nan_output(q: torch.Tensor) -> torch.Tensor:
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size,head_dim,group,num_kv_heads", SHAPES)
def test_decode_matches_reference(page_size, head_dim, group, num_kv_heads, num_splits, dtype):
    # Lengths: one token, exactly one page, a partial page, several tiles and splits.
    context_lens = [page_size * 5, 3 * page_size + 1, 1, page_size, 150]
    batch = PagedBatch(context_lens, page_size, num_kv_heads, head_dim, dtype, seed=page_size + head_dim)
    num_heads = group * num_kv_heads
    q = query_view(len(context_lens), num_heads, num_kv_heads, head_dim, dtype, seed=1)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens_tensor,
                                 scale, num_splits=num_splits, out=nan_output(q))
    ref = torch.stack([batch.reference(b, q[b : b + 1], scale)[0] for b in range(len(context_lens))])
    assert out.shape == q.shape and out.dtype == dtype
    assert relative_error(out, ref) < TOLERANCE[dtype]


def test_decode_default_splits_match_reference():
    batch = PagedBatch([300, 7], 16, 2, 16, torch.float32, seed=3)
    q = query_view(2, 4, 2, 16, torch.float32, seed=4)
    out = paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens_tensor, 0.25)
    ref = torch.stack([batch.reference(b, q[b : b + 1], 0.25)[0] for b in range(2)])
    assert relative_error(out, ref) < 1e-4


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_of_empty_sequence_is_zero(num_splits):
    """A padding row of a fixed-size batch (context length 0) yields zeros, not NaN."""
    batch = PagedBatch([5, 1], 4, 1, 16, torch.float32, seed=5)
    context_lens = torch.tensor([5, 0], dtype=torch.int32, device=DEVICE)
    q = query_view(2, 2, 1, 16, torch.float32, seed=6)
    out = paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, context_lens, 0.25,
                                 num_splits=num_splits, out=nan_output(q))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert relative_error(out[0], batch.reference(0, q[:1], 0.25)[0]) < 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size,head_dim,group,num_kv_heads", SHAPES)
def test_prefill_matches_reference(page_size, head_dim, group, num_kv_heads, dtype):
    # (context length, new tokens): a prompt of exactly two pages with no prefix, a chunk after
    # a cached prefix (sharing sequence 0's pages), a first token, a decode row, and a prompt
    # long enough for several query blocks and key tiles.
    rows = [(2 * page_size, 2 * page_size), (37, 9), (1, 1), (20, 1), (70, 70)]
    context_lens = [length for length, _ in rows]
    query_lens = [count for _, count in rows]
    batch = PagedBatch(context_lens, page_size, num_kv_heads, head_dim, dtype, seed=page_size * head_dim)
    num_heads = group * num_kv_heads
    q = query_view(sum(query_lens), num_heads, num_kv_heads, head_dim, dtype, seed=2)
    starts = torch.tensor([0] + query_lens).cumsum(0)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.page_table,
                                  starts.to(DEVICE, torch.int32), batch.context_lens_tensor, scale,
                                  out=nan_output(q))
    ref = torch.cat([batch.reference(b, q[starts[b] : starts[b + 1]], scale) for b in range(len(rows))])
    assert out.shape == q.shape and out.dtype == dtype
    assert relative_error(out, ref) < TOLERANCE[dtype]


def test_prefill_of_decode_rows_equals_decode():
    """A batch of q_len 1 rows gives the same answer through either kernel."""
    batch = PagedBatch([9, 16, 33], 4, 2, 16, torch.float32, seed=7)
    q = query_view(3, 4, 2, 16, torch.float32, seed=8)
    starts = torch.arange(4, dtype=torch.int32, device=DEVICE)
    prefill = paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.page_table, starts,
                                      batch.context_lens_tensor, 0.25)
    decode = paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table,
                                    batch.context_lens_tensor, 0.25, num_splits=1)
    torch.testing.assert_close(prefill, decode, rtol=1e-5, atol=1e-6)


# Windows shorter than one tile, than a split, ending inside a tile, and longer than every context.
WINDOWS = [pytest.param(1, id="window1"), pytest.param(5, id="window5"), pytest.param(70, id="window70"),
           pytest.param(1000, id="window-longer-than-all")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_with_a_sliding_window_matches_reference(window, num_splits, dtype):
    context_lens = [300, 3 * 16 + 1, 1, 16, 150]
    batch = PagedBatch(context_lens, 16, 2, 64, dtype, seed=window)
    q = query_view(len(context_lens), 4, 2, 64, dtype, seed=11)
    out = paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens_tensor,
                                 0.125, num_splits=num_splits, out=nan_output(q), window=window)
    ref = torch.stack([batch.reference(b, q[b : b + 1], 0.125, window)[0] for b in range(len(context_lens))])
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("page_size,head_dim,group,num_kv_heads", SHAPES[:2])
def test_prefill_with_a_sliding_window_matches_reference(page_size, head_dim, group, num_kv_heads, window, dtype):
    # A prompt longer than several query blocks and windows, a chunk after a prefix, decode rows.
    rows = [(200, 200), (37, 9), (1, 1), (90, 1), (130, 70)]
    context_lens, query_lens = [length for length, _ in rows], [count for _, count in rows]
    batch = PagedBatch(context_lens, page_size, num_kv_heads, head_dim, dtype, seed=window + page_size)
    q = query_view(sum(query_lens), group * num_kv_heads, num_kv_heads, head_dim, dtype, seed=12)
    starts = torch.tensor([0] + query_lens).cumsum(0)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.page_table, starts.to(DEVICE, torch.int32),
                                  batch.context_lens_tensor, scale, out=nan_output(q), window=window)
    ref = torch.cat([batch.reference(b, q[starts[b] : starts[b + 1]], scale, window) for b in range(len(rows))])
    assert relative_error(out, ref) < TOLERANCE[dtype]


def test_a_window_must_hold_a_token():
    batch = PagedBatch([4], 4, 1, 16, torch.float32, seed=13)
    q = query_view(1, 1, 1, 16, torch.float32, seed=14)
    for window in (0, -3, 2.5):
        with pytest.raises(ValueError, match="sliding window"):
            paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens_tensor, 1.0,
                                   window=window)


def test_mismatched_cache_is_rejected():
    batch = PagedBatch([4], 4, 2, 16, torch.float32, seed=9)
    q = torch.zeros(1, 3, 16, device=DEVICE)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError, match="do not fit"):
        paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.context_lens_tensor, 1.0)
