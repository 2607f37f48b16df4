"""Attention over the paged KV pool in Triton: decode (one query token per sequence, split-K)
and prefill (packed query tokens of a batch; chunked prefill, decode and mixed batches alike).

Cache layout, per layer: `k_cache`, `v_cache` `[num_pages, page_size, num_kv_heads, head_dim]`,
last dim contiguous (a view `pool_k[layer]` of the pool). Token i of sequence b lives in page
`page_table[b, i // page_size]`, slot `i % page_size`. Query head h reads kv head
`h // (num_heads // num_kv_heads)`.

Both kernels put the query heads that share one kv head (the GQA group) into the rows of one
tile, so each K/V tile gathered from the pool serves the whole group. Softmax is online, in fp32
and base 2 (`exp2`, with log2(e) folded into the scale); K/V tiles are gathered token by token
through the page table, so any page size works and a tile may span pages.

Sliding windows (Mistral, Qwen2/3's sliding layers): with `window` w, the query at absolute
index p sees keys p - w + 1 .. p only, and the key loop starts at the first tile holding one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# A finite "minus infinity" for running maxima: a row that has seen no key yet keeps it, and
# exp2(-inf - this) is 0 instead of the NaN that exp2(-inf - -inf) would give.
_NO_MAX = tl.constexpr(-1.0e30)

DECODE_BLOCK_N = 64  # keys per tile
PREFILL_BLOCK_M = 64  # (query token, head) rows per tile
PREFILL_BLOCK_N = 32
MIN_TOKENS_PER_SPLIT = 256  # split-K below this costs more in the combine than it gains


@triton.jit
def _attend_tile(acc, row_max, row_sum, q, k_cache_ptr, v_cache_ptr, page_table_row_ptr,
                 key_start, context_len, query_pos, kv_head,
                 stride_page, stride_slot, stride_head, qk_scale, window,
                 PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """One online-softmax step: rows of `q` [BLOCK_M, BLOCK_D] against keys
    key_start .. key_start + BLOCK_N; row r sees key i when i < context_len and i <= query_pos[r]
    (and, with a window, i > query_pos[r] - window)."""
    key_index = key_start + tl.arange(0, BLOCK_N)
    key_valid = key_index < context_len
    page = tl.load(page_table_row_ptr + key_index // PAGE_SIZE, mask=key_valid, other=0).to(tl.int64)
    token_offset = page * stride_page + (key_index % PAGE_SIZE) * stride_slot + kv_head * stride_head
    dim = tl.arange(0, BLOCK_D)
    kv_offset = token_offset[:, None] + dim[None, :]
    kv_mask = key_valid[:, None] & (dim[None, :] < HEAD_DIM)
    k = tl.load(k_cache_ptr + kv_offset, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offset, mask=kv_mask, other=0.0)

    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N], log2 units
    visible = key_valid[None, :] & (key_index[None, :] <= query_pos[:, None])
    if HAS_WINDOW:
        visible = visible & (key_index[None, :] > query_pos[:, None] - window)
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    correction = tl.exp2(row_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])
    row_sum = row_sum * correction + tl.sum(probs, 1)
    acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, new_max, row_sum


@triton.jit
def _attend_keys(q, k_cache_ptr, v_cache_ptr, page_table_row_ptr, key_begin, key_end, context_len, query_pos,
                 kv_head, stride_page, stride_slot, stride_head, qk_scale, window,
                 PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The rows of `q` over keys key_begin .. key_end, a tile at a time (_attend_tile): the
    accumulated output, its rows' running maxima and sums."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], _NO_MAX, dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for key_start in range(key_begin, key_end, BLOCK_N):
        acc, row_max, row_sum = _attend_tile(
            acc, row_max, row_sum, q, k_cache_ptr, v_cache_ptr, page_table_row_ptr,
            key_start, context_len, query_pos, kv_head, stride_page, stride_slot, stride_head, qk_scale, window,
            PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION, HAS_WINDOW)
    return acc, row_max, row_sum


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, context_lens_ptr,
                   out_ptr, partial_out_ptr, partial_lse_ptr,
                   qk_scale, tokens_per_split, window,
                   stride_q_seq, stride_q_head, stride_out_seq, stride_out_head,
                   stride_page, stride_slot, stride_head, stride_table_seq,
                   GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Program (seq, kv_head, split): the GQA group of `seq` over keys of one split."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    key_begin = split * tokens_per_split
    key_end = tl.minimum(key_begin + tokens_per_split, context_len)
    if HAS_WINDOW:  # from the tile of the window's first key (tiles stay within their split)
        key_begin = tl.maximum(key_begin, (context_len - window) // BLOCK_N * BLOCK_N)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dim = tl.arange(0, BLOCK_D)
    q_mask = row_valid[:, None] & (dim[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_q_seq + head[:, None] * stride_q_head + dim[None, :], mask=q_mask, other=0.0)
    query_pos = tl.where(row_valid, context_len - 1, -1)
    acc, row_max, row_sum = _attend_keys(
        q, k_cache_ptr, v_cache_ptr, page_table_ptr + seq * stride_table_seq, key_begin, key_end, context_len,
        query_pos, kv_head, stride_page, stride_slot, stride_head, qk_scale, window,
        PAGE_SIZE, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION, HAS_WINDOW)

    # A split with no keys (or a sequence of length 0) has row_sum 0 and acc 0: output 0.
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    if NUM_SPLITS == 1:
        out_offset = seq * stride_out_seq + head[:, None] * stride_out_head + dim[None, :]
        tl.store(out_ptr + out_offset, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # partial_out [B, H, NUM_SPLITS, HEAD_DIM] fp32, partial_lse [B, H, NUM_SPLITS] (log2 units)
        row_index = (seq * GROUP * tl.num_programs(1) + head) * NUM_SPLITS + split
        tl.store(partial_out_ptr + row_index[:, None] * HEAD_DIM + dim[None, :], out, mask=q_mask)
        has_keys = row_sum > 0
        lse = tl.where(has_keys, row_max + tl.log2(tl.where(has_keys, row_sum, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + row_index, lse, mask=row_valid)


@triton.jit
def _combine_splits_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, stride_out_seq, stride_out_head,
                           NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (seq, head): the softmax-weighted sum of the splits' partial outputs."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    split = tl.arange(0, BLOCK_S)
    dim = tl.arange(0, BLOCK_D)
    lse = tl.load(partial_lse_ptr + row * NUM_SPLITS + split, mask=split < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    mask = (split[:, None] < NUM_SPLITS) & (dim[None, :] < HEAD_DIM)
    partial = tl.load(partial_out_ptr + (row * NUM_SPLITS + split[:, None]) * HEAD_DIM + dim[None, :],
                      mask=mask, other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dim, out.to(out_ptr.dtype.element_ty),
             mask=dim < HEAD_DIM)


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks contain `q_block_global`; sequence b's blocks start at
    query_start_loc[b] // BLOCK_Q + b, which is strictly increasing in b (binary search)."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        block_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if block_start <= q_block_global:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, query_start_loc_ptr, context_lens_ptr,
                    out_ptr, qk_scale, num_seqs, window,
                    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
                    stride_page, stride_slot, stride_head, stride_table_seq,
                    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Program (query block, kv_head): BLOCK_Q query tokens of one sequence times the GQA group.
    Row r of the tile is query token r // GROUP of the block and head kv_head * GROUP + r % GROUP."""
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    q_block = tl.program_id(0) - (query_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q < query_len:
        context_len = tl.load(context_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        query_index = q_block * BLOCK_Q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (query_index < query_len)
        query_pos = tl.where(row_valid, context_len - query_len + query_index, -1)
        token = query_start + query_index
        dim = tl.arange(0, BLOCK_D)
        q_mask = row_valid[:, None] & (dim[None, :] < HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dim[None, :],
                    mask=q_mask, other=0.0)

        # Causal: the block's last query token sees keys up to its own absolute index.
        key_end = tl.minimum(context_len, context_len - query_len + (q_block + 1) * BLOCK_Q)
        key_begin = 0
        if HAS_WINDOW:  # from the tile of the first key the block's first query token sees
            first_seen = context_len - query_len + q_block * BLOCK_Q - window + 1
            key_begin = tl.maximum(first_seen, 0) // BLOCK_N * BLOCK_N
        acc, row_max, row_sum = _attend_keys(
            q, k_cache_ptr, v_cache_ptr, page_table_ptr + seq * stride_table_seq, key_begin, key_end, context_len,
            query_pos, kv_head, stride_page, stride_slot, stride_head, qk_scale, window,
            PAGE_SIZE, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION, HAS_WINDOW)

        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        out_offset = token[:, None] * stride_out_token + head[:, None] * stride_out_head + dim[None, :]
        tl.store(out_ptr + out_offset, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """Validate q against the cache; returns (GQA group size, head_dim)."""
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match")
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads x dim {num_heads}x{head_dim} do not fit kv cache {tuple(k_cache.shape)}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the kv cache need a contiguous last (head_dim) dimension")
    return num_heads // num_kv_heads, head_dim


def _check_window(window: int | None) -> None:
    if window is not None and not (isinstance(window, int) and 1 <= window < 2**31):
        raise ValueError(f"a sliding window is a number of tokens >= 1, got {window!r}")


def _output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim, "
                         f"got {tuple(out.shape)} {out.dtype}")
    return out


def _tile_params(q: torch.Tensor, group: int, head_dim: int, block_m: int) -> dict:
    # tl.dot needs every tile side >= 16 on GPUs; fp32 inputs must not be rounded to tf32.
    return dict(
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_M=max(block_m, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _default_num_splits(q: torch.Tensor, num_kv_heads: int, max_tokens: int) -> int:
    """Enough splits to give every SM about two programs, none shorter than MIN_TOKENS_PER_SPLIT."""
    if not q.is_cuda:
        return 1
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    programs = q.shape[0] * num_kv_heads
    return max(1, min(triton.cdiv(2 * num_sms, programs), max_tokens // MIN_TOKENS_PER_SPLIT, 64))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           window: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV cache.

    q `[B, H, D]`; k_cache, v_cache `[num_pages, page_size, Hkv, D]` (q's dtype: fp32, fp16 or
    bf16); page_table `[B, max_pages]` int32; context_lens `[B]` int32, tokens in the cache
    including the current one (already stored), >= 1 (0 gives a zero output row). `scale`
    multiplies q.k (usually head_dim ** -0.5). Returns `[B, H, D]` in q's dtype; accumulation
    is fp32.

    `num_splits` cuts each sequence's keys into that many chunks run by separate programs and
    combined afterwards (split-K, for long contexts at small batch); by default it is chosen
    from the SM count and the page table's width (`max_pages * page_size` tokens), so keep the
    table no wider than the batch needs. `out` (q's shape and dtype, last dim contiguous), when
    given, receives the result, e.g. a static buffer of a CUDA graph. `window` (a sliding
    window, >= 1): the new token sees only the last `window` tokens, itself included.
    """
    group, head_dim = _check_inputs(q, k_cache, v_cache)
    _check_window(window)
    batch, num_heads, _ = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    max_tokens = page_table.shape[1] * page_size
    if num_splits is None:
        num_splits = _default_num_splits(q, num_kv_heads, max_tokens)
    block_n = DECODE_BLOCK_N
    # Split boundaries on tile multiples, so no tile straddles two splits.
    tokens_per_split = triton.cdiv(triton.cdiv(max_tokens, num_splits), block_n) * block_n
    out = _output_for(q, out)
    if num_splits > 1:
        partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        partial_out = partial_lse = out  # unused
    params = _tile_params(q, group, head_dim, block_m=16)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, context_lens, out, partial_out, partial_lse,
        scale * LOG2E, tokens_per_split, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        NUM_SPLITS=num_splits, PAGE_SIZE=page_size, BLOCK_N=block_n, HAS_WINDOW=window is not None, **params)
    if num_splits > 1:
        _combine_splits_kernel[(batch, num_heads)](
            partial_out, partial_lse, out, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=params["BLOCK_D"])
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            page_table: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged KV caches.

    q `[T, H, D]`: the new tokens of B sequences, packed; sequence b owns rows
    `query_start_loc[b] : query_start_loc[b + 1]` (query_start_loc `[B + 1]` int32, starting
    at 0, ending at T). context_lens `[B]` int32: tokens in b's cache including its new ones
    (already stored). Query row j of b sits at absolute index `context_lens[b] - q_len_b + j`
    and sees cache indices 0 .. that index. Covers prefill, chunked prefill after a cached
    prefix, decode (q_len 1) and mixed batches. k_cache, v_cache, page_table and dtypes as in
    `paged_decode_attention`. Returns `[T, H, D]` in q's dtype (into `out` when given);
    accumulation is fp32. `window`: as in `paged_decode_attention`, for every query row.
    """
    group, head_dim = _check_inputs(q, k_cache, v_cache)
    _check_window(window)
    num_tokens = q.shape[0]
    num_seqs = query_start_loc.shape[0] - 1
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    params = _tile_params(q, group, head_dim, block_m=PREFILL_BLOCK_M)
    block_q = params["BLOCK_M"] // group
    out = _output_for(q, out)
    # Sequence b needs ceil(q_len_b / block_q) blocks; T // block_q + B bounds their sum.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, page_table, query_start_loc, context_lens, out, scale * LOG2E, num_seqs, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        PAGE_SIZE=page_size, BLOCK_Q=block_q, BLOCK_N=PREFILL_BLOCK_N, HAS_WINDOW=window is not None, **params)
    return out
