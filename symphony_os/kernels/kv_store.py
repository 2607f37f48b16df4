"""Writes into the paged KV pool in Triton: new tokens' K/V into their slots, and whole pages
copied across every layer (copy-on-write of a shared page).

Pool layout: `[num_layers, num_pages, page_size, num_kv_heads, head_dim]` for K and for V; a
layer's cache is the view `pool[layer]`. A flat slot is `page * page_size + offset`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

COPY_BLOCK = 1024  # elements per step of a page copy


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_k_token, stride_k_head, stride_v_token, stride_v_head,
                     stride_page, stride_slot, stride_head,
                     PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program t: all heads of token t into its slot (skipped when the slot is negative)."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        head = tl.arange(0, BLOCK_H)
        dim = tl.arange(0, BLOCK_D)
        mask = (head[:, None] < NUM_KV_HEADS) & (dim[None, :] < HEAD_DIM)
        cache_offset = ((slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_slot
                        + head[:, None] * stride_head + dim[None, :])
        k = tl.load(k_ptr + token * stride_k_token + head[:, None] * stride_k_head + dim[None, :], mask=mask)
        v = tl.load(v_ptr + token * stride_v_token + head[:, None] * stride_v_head + dim[None, :], mask=mask)
        tl.store(k_cache_ptr + cache_offset, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offset, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_pages_kernel(pool_k_ptr, pool_v_ptr, src_pages_ptr, dst_pages_ptr, stride_layer, stride_page,
                       PAGE_NUMEL: tl.constexpr, BLOCK: tl.constexpr):
    """Program (pair, layer): page src_pages[pair] -> dst_pages[pair] of one layer, K and V."""
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src = tl.load(src_pages_ptr + pair).to(tl.int64)
    dst = tl.load(dst_pages_ptr + pair).to(tl.int64)
    src_base = layer * stride_layer + src * stride_page
    dst_base = layer * stride_layer + dst * stride_page
    for start in range(0, PAGE_NUMEL, BLOCK):
        offset = start + tl.arange(0, BLOCK)
        mask = offset < PAGE_NUMEL
        tl.store(pool_k_ptr + dst_base + offset, tl.load(pool_k_ptr + src_base + offset, mask=mask), mask=mask)
        tl.store(pool_v_ptr + dst_base + offset, tl.load(pool_v_ptr + src_base + offset, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new tokens' keys and values into one layer's cache, in place.

    k, v `[T, Hkv, D]` (any strides with a contiguous last dim, e.g. slices of a fused qkv);
    k_cache, v_cache `[num_pages, page_size, Hkv, D]`, last dim contiguous, converted to on
    store; slot_mapping `[T]` int64 (int32 works too) flat slots `page * page_size + offset`.
    A negative slot skips its token (padding rows of a fixed-size batch).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit caches "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("k, v and the caches need a contiguous last dim; the caches equal strides")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def copy_pages(pool_k: torch.Tensor, pool_v: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """Copy whole pages, K and V of every layer, in place: page `src_pages[i]` to `dst_pages[i]`.

    pool_k, pool_v `[num_layers, num_pages, page_size, Hkv, D]`, contiguous, same shape;
    src_pages, dst_pages `[N]` integer page ids on the pool's device. Destinations must be
    distinct and not among the sources (copy-on-write gives fresh pages).
    """
    if pool_k.shape != pool_v.shape or not (pool_k.is_contiguous() and pool_v.is_contiguous()):
        raise ValueError(f"pool_k {tuple(pool_k.shape)} and pool_v {tuple(pool_v.shape)} must be contiguous, same shape")
    if src_pages.shape != dst_pages.shape or src_pages.dim() != 1:
        raise ValueError(f"src_pages {tuple(src_pages.shape)} and dst_pages {tuple(dst_pages.shape)} must be [N]")
    num_layers = pool_k.shape[0]
    if src_pages.numel() == 0 or num_layers == 0:
        return
    page_numel = pool_k[0, 0].numel()
    _copy_pages_kernel[(src_pages.numel(), num_layers)](
        pool_k, pool_v, src_pages, dst_pages, pool_k.stride(0), pool_k.stride(1),
        PAGE_NUMEL=page_numel, BLOCK=min(COPY_BLOCK, triton.next_power_of_2(page_numel)))
