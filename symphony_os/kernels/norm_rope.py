"""The decoder layer's small elementwise steps as one Triton kernel each: RMSNorm (alone, or
with the residual add before it) and the rotary embedding. In torch they are 8 and 5 kernels
(the add one more); at decode batch sizes each of those costs 1-3 us however small the tensor,
which on an H100 was a quarter of a Llama-3-8B batch-1 step (1.9 of 7.6 ms of kernel time).

All compute in fp32 and round as `symphony_os.model`'s torch versions do where it matters:
RMSNorm rounds the normalized row to the input dtype before multiplying by the weight, like
transformers; the residual add rounds its sum to the dtype (the residual stream is kept in it);
the rotary embedding rounds once at the end.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normalized(x, weight_ptr, out_ptr, cols, mask, eps, N: tl.constexpr):
    """RMSNorm of the fp32 row x, rounded to out's dtype before and after the weight."""
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (weight * normed.to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, rows_per_outer, stride_outer, stride_inner, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: row r of x viewed as [outer, inner, N] (row r = outer r // inner, inner r % inner)."""
    row = tl.program_id(0)
    offset = (row // rows_per_outer).to(tl.int64) * stride_outer + (row % rows_per_outer) * stride_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * N + cols, _normalized(x, weight_ptr, out_ptr, cols, mask, eps, N), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: sum = residual[r] + x[r] (rounded to the dtype), out = RMSNorm(sum)."""
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (residual + x).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row + cols, summed, mask=mask)
    tl.store(out_ptr + row + cols, _normalized(summed.to(tl.float32), weight_ptr, out_ptr, cols, mask, eps, N),
             mask=mask)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, stride_token, stride_head, stride_cos,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program t: every head of token t; rotate-half layout, cos/sin rows repeat their halves."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, BLOCK_H)[:, None]
    dim = tl.arange(0, BLOCK_D)[None, :]
    mask = (head < num_heads) & (dim < HALF)
    source = x_ptr + token * stride_token + head * stride_head + dim
    first = tl.load(source, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(source + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_cos + dim, mask=dim < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cos + dim, mask=dim < HALF, other=0.0).to(tl.float32)
    target = out_ptr + (token * num_heads + head) * (2 * HALF) + dim
    tl.store(target, (first * cos - second * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(target + HALF, (second * cos + first * sin).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x `[T, N]` or `[T, H, N]` (any strides with a contiguous
    last dim, e.g. heads sliced from a fused qkv), weight `[N]` of x's dtype. Returns a new
    contiguous tensor of x's shape."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or weight.shape != x.shape[-1:] or weight.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} needs a contiguous last dim and a weight of that size and dtype")
    n = x.shape[-1]
    inner, stride_inner = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // n
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](x, weight, out, inner, x.stride(0), stride_inner, eps, N=n, BLOCK=block,
                                  num_warps=min(16, max(1, block // 256)))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x) for contiguous x, residual `[T, N]` of one dtype
    and weight `[N]`: a layer's residual add and the norm after it, in one pass. Both new."""
    if x.dim() != 2 or residual.shape != x.shape or not (x.is_contiguous() and residual.is_contiguous()) \
            or residual.dtype != x.dtype or weight.shape != x.shape[-1:] or weight.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)} and weight {tuple(weight.shape)} "
                         "must be contiguous [T, N], [T, N] and [N] of one dtype")
    n = x.shape[-1]
    out, summed = torch.empty_like(x), torch.empty_like(x)
    if x.shape[0]:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, summed, eps, N=n, BLOCK=block,
                                            num_warps=min(16, max(1, block // 256)))
    return out, summed


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x `[T, H, D]` (contiguous last dim) with cos, sin `[T, 1, D]`
    (contiguous; the halves of each row equal, as `cat((freqs, freqs))` gives). Returns a new
    contiguous tensor."""
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1 or head_dim % 2 or cos.shape != (num_tokens, 1, head_dim) or not cos.is_contiguous() \
            or sin.shape != cos.shape or not sin.is_contiguous():
        raise ValueError(f"x {tuple(x.shape)} and cos/sin {tuple(cos.shape)} do not fit")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        half = head_dim // 2
        _rope_kernel[(num_tokens,)](x, cos, sin, out, num_heads, x.stride(0), x.stride(1), cos.stride(0),
                                    HALF=half, BLOCK_H=triton.next_power_of_2(num_heads),
                                    BLOCK_D=triton.next_power_of_2(half))
    return out
