"""Batched sampling on the device in Triton: per row, logit bias, an allowed-token mask,
temperature (0 = greedy), min-p, top-k, top-p and a seeded draw, plus the top log-probs.

No sort. Each row is read in chunks, several times:
1. `_process_logits_kernel` writes the processed logits x (logits + bias, -inf where not
   allowed) to an fp32 workspace.
2. `_sample_kernel`, per block of rows: max and argmax of x; the top-k cut, the k-th largest
   y = (x - max x) / temperature (at most 0: no temperature overflows it), below which min-p's
   cut (log min_p) keeps nothing, found by searching y's order-preserving int32 keys (8 keys tested per pass over the row; exact, ties at the cut
   all kept); the top-p cut the same way over the kept probability mass; a Gumbel-max draw,
   argmax(y + g) over the kept tokens, which is an exact draw from softmax(y) restricted to
   them; the top log-probs by repeated max.
Ties in argmax and in the top log-probs go to the lowest token id. A sampled row whose
processed logits hold a NaN or +inf, or are all -inf, gets token -1 (a failed row).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ROW_TILE_NUMEL = 4096  # rows x vocab elements per tile: one row per program at a real vocabulary
INTERPRETER_TILE_NUMEL = 65536
MAX_VOCAB_BLOCK = 4096
NUM_PIVOTS = 8  # keys tested per pass of the cut search: each pass shrinks the interval 9-fold
SAMPLE_NUM_WARPS = 16  # with 4096-token blocks: fastest of 4/8/16 on an H100 at V=152k
_MIN_PACKED = tl.constexpr(-(2**63))  # below every packed (value, id)


@dataclass
class SamplingOutput:
    """token_ids [B] int64; with num_logprobs > 0 also topk_ids [B, k] int64 and topk_logprobs
    [B, k] float32, most likely first."""

    token_ids: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None


@triton.jit
def _order_key(x):
    """fp32 -> int32 with the same order (-0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _pack(x, token):
    """fp32 value and token id -> int64 ordered by value, then by lower id."""
    return (_order_key(x).to(tl.int64) << 32) | (0x7FFFFFFF - token).to(tl.int64)


@triton.jit
def _packed_token(packed):
    return 0x7FFFFFFF - (packed & 0xFFFFFFFF)


@triton.jit
def _packed_value(packed):
    key = (packed >> 32).to(tl.int32)
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _gumbel(seed, token):
    """Gumbel noise from Philox keyed by the row's seed and the token id. u keeps 23 random
    bits as (2k + 1) / 2**24, exactly representable and strictly inside (0, 1)."""
    bits = tl.randint(seed, token).to(tl.uint32, bitcast=True) >> 9
    uniform = (bits.to(tl.float32) * 2.0 + 1.0) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(uniform))


@triton.jit
def _process_logits_kernel(logits_ptr, bias_ids_ptr, bias_values_ptr, allowed_ptr, out_ptr,
                           num_rows, vocab_size, num_bias, stride_logits, stride_bias, stride_allowed,
                           HAS_BIAS: tl.constexpr, ALLOWED_KIND: tl.constexpr,
                           BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (row block, vocab block): x = logits + bias, -inf where not allowed, as fp32.
    ALLOWED_KIND: 0 none, 1 bool [B, V], 2 int32 bitmask [B, ceil(V / 32)]."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_valid = rows < num_rows
    mask = row_valid[:, None] & (cols[None, :] < vocab_size)
    rows64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows64[:, None] * stride_logits + cols[None, :], mask=mask).to(tl.float32)
    if HAS_BIAS:
        # Padding ids are -1 and match no column; repeated ids add up, like index_add.
        for j in range(num_bias):
            ids = tl.load(bias_ids_ptr + rows64 * stride_bias + j, mask=row_valid, other=-1)
            values = tl.load(bias_values_ptr + rows64 * stride_bias + j, mask=row_valid, other=0.0)
            x += tl.where(cols[None, :] == ids[:, None], values[:, None].to(tl.float32), 0.0)
    if ALLOWED_KIND == 1:
        allowed = tl.load(allowed_ptr + rows64[:, None] * stride_allowed + cols[None, :], mask=mask, other=0)
        x = tl.where(allowed != 0, x, float("-inf"))
    elif ALLOWED_KIND == 2:
        words = tl.load(allowed_ptr + rows64[:, None] * stride_allowed + cols[None, :] // 32, mask=mask, other=0)
        x = tl.where(((words >> (cols[None, :] % 32)) & 1) != 0, x, float("-inf"))
    tl.store(out_ptr + rows64[:, None] * vocab_size + cols[None, :], x, mask=mask)


@triton.jit
def _scaled(row_base, cols, mask, x_max, divisor):
    """y = (x - x_max) / divisor (the row's temperature; 1 for greedy rows) over a block of
    columns: at most 0 (the largest token's y is 0), so no temperature, however small, overflows
    it, and exp(y) is the token's unnormalized probability. (x / temperature would overflow to
    inf at a tiny temperature, and inf - inf is NaN.)"""
    x = tl.load(row_base + cols[None, :], mask=mask, other=float("-inf"))
    return (x - x_max[:, None]) / divisor


@triton.jit
def _search_cut(row_base, row_valid, divisor, x_max, vocab_size, lo, hi, count_lo, target, active,
                BY_MASS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """Per active row, the largest key t with weight(key >= t) >= target, where the weight of a
    set of tokens is their count, or with BY_MASS their mass exp(y) (`_scaled`). Needs
    weight(lo) >= target > weight(hi); count_lo is the count at lo. Returns (cut, its count).

    Each pass over the row tests NUM_PIVOTS keys spread over [lo, hi) at once. The search
    stops when [lo, hi) holds one key or one token: then {key >= lo} is the kept set already.
    """
    pivot_step = tl.arange(0, NUM_PIVOTS)[None, :] + 1
    count_hi = tl.zeros([BLOCK_B], tl.int32)
    searching = active & (hi - lo > 1) & (count_lo - count_hi > 1)
    while tl.max(searching.to(tl.int32), 0) > 0:
        pivots = lo[:, None] + (hi - lo)[:, None] * pivot_step // (NUM_PIVOTS + 1)  # [B, P], ascending
        pivots32 = pivots.to(tl.int32)  # -2**31 <= lo <= pivot < hi <= 2**31: fits int32; compares run twice as fast
        counts = tl.zeros([BLOCK_B, NUM_PIVOTS], tl.int32)
        masses = tl.zeros([BLOCK_B, NUM_PIVOTS], tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = row_valid[:, None] & (cols[None, :] < vocab_size)
            y = _scaled(row_base, cols, mask, x_max, divisor)
            above = mask[:, :, None] & (_order_key(y)[:, :, None] >= pivots32[:, None, :])  # [B, V, P]
            counts += tl.sum(above.to(tl.int32), 1)
            if BY_MASS:
                masses += tl.sum(tl.where(above, tl.exp(y)[:, :, None], 0.0), 1)
        if BY_MASS:
            enough = masses >= target[:, None]
        else:
            enough = counts.to(tl.float32) >= target[:, None]
        # Weights fall as pivots rise: the last pivot with enough is the new lo, the first
        # without is the new hi, and their counts are the smallest / largest on each side.
        new_lo = tl.max(tl.where(enough, pivots, lo[:, None]), 1)
        new_hi = tl.min(tl.where(enough, hi[:, None], pivots), 1)
        new_count_lo = tl.min(tl.where(enough, counts, count_lo[:, None]), 1)
        new_count_hi = tl.max(tl.where(enough, count_hi[:, None], counts), 1)
        lo = tl.where(searching, new_lo, lo)
        hi = tl.where(searching, new_hi, hi)
        count_lo = tl.where(searching, new_count_lo, count_lo)
        count_hi = tl.where(searching, new_count_hi, count_hi)
        searching = searching & (hi - lo > 1) & (count_lo - count_hi > 1)
    return lo, count_lo


@triton.jit
def _sample_kernel(x_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seeds_ptr, log_min_p_ptr,
                   token_ids_ptr, topk_ids_ptr, topk_logprobs_ptr,
                   num_rows, vocab_size, num_logprobs,
                   HAS_MIN_P: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """Program: BLOCK_B rows of the processed logits x [B, V] fp32 (see the module docstring)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_valid = rows < num_rows
    row_base = x_ptr + rows.to(tl.int64)[:, None] * vocab_size
    temperature = tl.load(temperature_ptr + rows, mask=row_valid, other=0.0)
    top_k = tl.load(top_k_ptr + rows, mask=row_valid, other=0)
    top_p = tl.load(top_p_ptr + rows, mask=row_valid, other=1.0)
    seed = tl.load(seeds_ptr + rows, mask=row_valid, other=0).to(tl.int64)
    sampled = temperature > 0
    row_divisor = tl.where(sampled, temperature, 1.0)
    divisor = row_divisor[:, None]

    # Pass 1: max and argmax of x, and whether x has a NaN.
    best = tl.full([BLOCK_B], _MIN_PACKED, tl.int64)
    has_nan = tl.zeros([BLOCK_B], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_valid[:, None] & (cols[None, :] < vocab_size)
        x = tl.load(row_base + cols[None, :], mask=mask, other=float("-inf"))
        best = tl.maximum(best, tl.max(tl.where(mask, _pack(x, cols[None, :]), _MIN_PACKED), 1))
        has_nan = tl.maximum(has_nan, tl.max((mask & (x != x)).to(tl.int32), 1))
    x_max = _packed_value(best)
    token = _packed_token(best)

    # Min-p, top-k among what it keeps, then top-p among those: each a cut key, tokens with
    # key >= cut are kept.
    cut = tl.full([BLOCK_B], -(2**31), tl.int64)  # keeps everything
    cut_count = tl.zeros([BLOCK_B], tl.int32) + vocab_size
    above_max = tl.full([BLOCK_B], 1, tl.int64)  # y <= 0 (`_scaled`): no key reaches 1, the key of y = 0 being 0
    if HAS_MIN_P:  # the cut is log(min_p) itself (-inf: off); its count takes a pass
        log_min_p = tl.load(log_min_p_ptr + rows, mask=row_valid, other=float("-inf"))
        use_min_p = sampled & (log_min_p > float("-inf"))
        cut = tl.where(use_min_p, _order_key(log_min_p).to(tl.int64), cut)
        kept = tl.zeros([BLOCK_B], tl.int32)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = row_valid[:, None] & (cols[None, :] < vocab_size)
            y = _scaled(row_base, cols, mask, x_max, divisor)
            kept += tl.sum((mask & (_order_key(y).to(tl.int64) >= cut[:, None])).to(tl.int32), 1)
        cut_count = tl.where(use_min_p, kept, cut_count)
    use_top_k = sampled & (top_k > 0) & (top_k < cut_count)
    if tl.max(use_top_k.to(tl.int32), 0) > 0:
        cut, cut_count = _search_cut(row_base, row_valid, divisor, x_max, vocab_size, cut, above_max, cut_count,
                                     top_k.to(tl.float32), use_top_k, False, BLOCK_B, BLOCK_V, NUM_PIVOTS)
    use_top_p = sampled & (top_p < 1.0)
    if tl.max(use_top_p.to(tl.int32), 0) > 0:
        kept_mass = tl.zeros([BLOCK_B], tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = row_valid[:, None] & (cols[None, :] < vocab_size)
            y = _scaled(row_base, cols, mask, x_max, divisor)
            keep = mask & (_order_key(y).to(tl.int64) >= cut[:, None])
            kept_mass += tl.sum(tl.where(keep, tl.exp(y), 0.0), 1)
        cut, cut_count = _search_cut(row_base, row_valid, divisor, x_max, vocab_size, cut, above_max, cut_count,
                                     top_p * kept_mass, use_top_p, True, BLOCK_B, BLOCK_V, NUM_PIVOTS)

    # The draw: Gumbel-max over the kept tokens.
    if tl.max(sampled.to(tl.int32), 0) > 0:
        best_draw = tl.full([BLOCK_B], _MIN_PACKED, tl.int64)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = row_valid[:, None] & (cols[None, :] < vocab_size)
            y = _scaled(row_base, cols, mask, x_max, divisor)
            keep = mask & (_order_key(y).to(tl.int64) >= cut[:, None])
            token_grid = cols[None, :] + tl.zeros([BLOCK_B, BLOCK_V], tl.int32)
            perturbed = y + _gumbel(seed[:, None], token_grid)
            best_draw = tl.maximum(best_draw, tl.max(tl.where(keep, _pack(perturbed, cols[None, :]), _MIN_PACKED), 1))
        # Non-finite logits (a NaN, +inf, or every token at -inf) leave nothing to draw from:
        # the row fails (token -1), as the host reference's does, rather than yield a wrong id
        # (it gave 2^31 - 1, past the vocabulary).
        finite = (x_max > float("-inf")) & (x_max < float("inf")) & (has_nan == 0)
        failed = ~finite | (best_draw == _MIN_PACKED)
        token = tl.where(sampled, tl.where(failed, -1, _packed_token(best_draw)), token)
    tl.store(token_ids_ptr + rows, token, mask=row_valid)

    # Top log-probs of x (temperature 1): the k largest by repeated max below the last one found.
    if num_logprobs > 0:
        sum_exp = tl.zeros([BLOCK_B], tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = row_valid[:, None] & (cols[None, :] < vocab_size)
            x = tl.load(row_base + cols[None, :], mask=mask, other=float("-inf"))
            sum_exp += tl.sum(tl.exp(x - x_max[:, None]), 1)
        log_norm = x_max + tl.log(sum_exp)
        found = best
        for rank in range(num_logprobs):
            if rank > 0:
                previous = found
                found = tl.full([BLOCK_B], _MIN_PACKED, tl.int64)
                for start in range(0, vocab_size, BLOCK_V):
                    cols = start + tl.arange(0, BLOCK_V)
                    mask = row_valid[:, None] & (cols[None, :] < vocab_size)
                    x = tl.load(row_base + cols[None, :], mask=mask, other=float("-inf"))
                    packed = _pack(x, cols[None, :])
                    packed = tl.where(mask & (packed < previous[:, None]), packed, _MIN_PACKED)
                    found = tl.maximum(found, tl.max(packed, 1))
            out_offset = rows.to(tl.int64) * num_logprobs + rank
            tl.store(topk_ids_ptr + out_offset, _packed_token(found), mask=row_valid)
            tl.store(topk_logprobs_ptr + out_offset, _packed_value(found) - log_norm, mask=row_valid)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, bias_ids: torch.Tensor | None = None, bias_values: torch.Tensor | None = None,
           allowed: torch.Tensor | None = None, num_logprobs: int = 0,
           log_min_p: torch.Tensor | None = None) -> SamplingOutput:
    """Process and sample every row of `logits` in one batched pass.

    logits `[B, V]` fp32, fp16 or bf16 (last dim contiguous). Per row, all on logits' device:
    temperature `[B]` float (0 = greedy argmax); top_k `[B]` int (0 or >= V = off); top_p `[B]`
    float in (0, 1] (1 = off); seeds `[B]` int64: the draw is a function of (seed, processed
    logits) alone, not of the batch, so pass seed + step for a reproducible sequence.
    bias_ids `[B, nb]` int32/int64 token ids padded with -1, bias_values `[B, nb]` float:
    added to those logits (a repeated id adds up). allowed: None, a bool `[B, V]` mask, or an
    int32 bitmask `[B, ceil(V / 32)]` (bit j % 32 of word j // 32 allows token j); a row that
    allows everything passes all True / all bits set.

    log_min_p `[B]` float32: min-p's cut, log(min_p) (-inf, or None for every row: off): a
    sampled row keeps the tokens with (x - max x) / temperature >= it.

    Order: bias, allowed mask, then greedy or (divide by temperature, min-p, top-k, top-p,
    draw). A
    sampled row with non-finite processed logits (NaN, +inf, or all -inf) gets token -1.
    Top-k keeps every token tied with the k-th; top-p keeps the fewest most likely tokens
    whose mass reaches top_p, plus every token tied with the last of them.
    num_logprobs > 0 also returns, per row, the num_logprobs largest log_softmax values of the
    processed logits (bias and mask applied, temperature 1, before top-k/top-p) with their ids.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with a contiguous last dim, got {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    device = logits.device
    for name, tensor in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seeds", seeds),
                         ("log_min_p", temperature if log_min_p is None else log_min_p)):
        if tensor.shape != (num_rows,):
            raise ValueError(f"{name} must be [{num_rows}], got {tuple(tensor.shape)}")
    if (bias_ids is None) != (bias_values is None):
        raise ValueError("bias_ids and bias_values go together")
    if bias_ids is not None and (bias_ids.shape != bias_values.shape or bias_ids.shape[0] != num_rows
                                 or bias_ids.stride() != bias_values.stride() or bias_ids.stride(1) != 1):
        raise ValueError(f"bias_ids {tuple(bias_ids.shape)} and bias_values {tuple(bias_values.shape)} "
                         f"must be [{num_rows}, nb] with equal strides")
    allowed_kind = 0
    if allowed is not None:
        if allowed.dtype == torch.bool and allowed.shape == (num_rows, vocab_size):
            allowed_kind = 1
        elif allowed.dtype == torch.int32 and allowed.shape == (num_rows, triton.cdiv(vocab_size, 32)):
            allowed_kind = 2
        else:
            raise ValueError(f"allowed must be bool [{num_rows}, {vocab_size}] or int32 "
                             f"[{num_rows}, {triton.cdiv(vocab_size, 32)}], got {allowed.dtype} {tuple(allowed.shape)}")
        if allowed.stride(1) != 1:
            raise ValueError("allowed needs a contiguous last dim")

    block_v = min(MAX_VOCAB_BLOCK, triton.next_power_of_2(vocab_size))
    # The CPU interpreter pays per operation, not per element: there, take many rows per program.
    tile_numel = ROW_TILE_NUMEL if logits.is_cuda else INTERPRETER_TILE_NUMEL
    block_b = min(max(1, tile_numel // block_v), triton.next_power_of_2(num_rows))
    processed = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    _process_logits_kernel[(triton.cdiv(num_rows, block_b), triton.cdiv(vocab_size, block_v))](
        logits, bias_ids if bias_ids is not None else logits, bias_values if bias_values is not None else logits,
        allowed if allowed is not None else logits, processed,
        num_rows, vocab_size, 0 if bias_ids is None else bias_ids.shape[1], logits.stride(0),
        0 if bias_ids is None else bias_ids.stride(0), 0 if allowed is None else allowed.stride(0),
        HAS_BIAS=bias_ids is not None and bias_ids.shape[1] > 0, ALLOWED_KIND=allowed_kind,
        BLOCK_B=block_b, BLOCK_V=block_v)

    token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    topk_ids = torch.empty(num_rows, num_logprobs, dtype=torch.int64, device=device)
    topk_logprobs = torch.empty(num_rows, num_logprobs, dtype=torch.float32, device=device)
    _sample_kernel[(triton.cdiv(num_rows, block_b),)](
        processed, temperature, top_k, top_p, seeds, temperature if log_min_p is None else log_min_p, token_ids,
        topk_ids if num_logprobs else token_ids, topk_logprobs if num_logprobs else processed,
        num_rows, vocab_size, num_logprobs, HAS_MIN_P=log_min_p is not None, BLOCK_B=block_b, BLOCK_V=block_v,
        NUM_PIVOTS=NUM_PIVOTS, num_warps=SAMPLE_NUM_WARPS)
    if num_logprobs == 0:
        return SamplingOutput(token_ids)
    return SamplingOutput(token_ids, topk_ids, topk_logprobs)
