"""Attention over the paged KV pool, behind one interface with several backends.

Every backend takes the same `AttentionMetadata` (built once per batch, shared by all layers)
and the per-layer cache views `k_cache`, `v_cache` of shape
`[num_pages, page_size, num_kv_heads, head_dim]`. Tokens of a batch are packed: sequence b owns
query rows `query_start_loc[b] : query_start_loc[b + 1]`, its new tokens are already stored
at the end of its `context_lens[b]` cached tokens, and query row j of b sits at absolute
index `context_lens[b] - query_len_b + j` (causal: it sees cache indices up to that one).
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Plain description of one batch's attention layout (see the module docstring)."""

    slot_mapping: torch.Tensor  # [T] int64: flat slot (page * page_size + offset) of each new token
    page_table: torch.Tensor  # [B, max_pages] int32, padded with 0
    context_lens: torch.Tensor  # [B] int32, cached tokens per sequence after this batch's append
    query_start_loc: torch.Tensor  # [B + 1] int32
    query_lens: list[int]
    context_lens_host: list[int]
    page_size: int
    sliding_window: int | None = None
    # Filled by the backend's prepare(): tensors reused by every layer of the batch.
    cache: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host)


class TorchAttention:
    """The reference backend: gathers each sequence's pages into a padded batch and calls
    torch's scaled_dot_product_attention with an explicit causal mask. Runs anywhere."""

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.page_table.device
        num_seqs, max_q = meta.num_seqs, meta.max_query_len
        # Keys are gathered whole pages at a time (a few large copies instead of one per
        # token), so the key axis is max_pages * page_size long; the mask hides the tail.
        key_len = meta.page_table.shape[1] * meta.page_size
        key_index = torch.arange(key_len, device=device)
        ctx = meta.context_lens.long()[:, None]
        q_lens = torch.tensor(meta.query_lens, device=device)[:, None]
        query_index = torch.arange(max_q, device=device)[None, :]
        query_pos = ctx - q_lens + query_index  # [B, max_q] absolute index of each query row
        causal = key_index[None, None, :] <= query_pos[:, :, None]
        # Padded query rows see key 0 only, so their softmax stays finite; their output is dropped.
        query_valid = query_index < q_lens
        padded = ~query_valid[:, :, None] & (key_index[None, None, :] == 0)
        meta.cache["mask"] = ((causal & query_valid[:, :, None]) | padded)[:, None]  # [B, 1, max_q, key_len]
        if meta.sliding_window:  # for the layers that slide
            window = causal & (key_index[None, None, :] > query_pos[:, :, None] - meta.sliding_window)
            meta.cache["window_mask"] = ((window & query_valid[:, :, None]) | padded)[:, None]
        meta.cache["query_valid"] = query_valid.expand(num_seqs, -1)
        meta.cache["pages"] = meta.page_table.long().flatten()

    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, sliding: bool) -> torch.Tensor:
        """`sliding`: this layer attends within meta.sliding_window (when the model has one)."""
        num_seqs, max_q = meta.num_seqs, meta.max_query_len
        pages = meta.cache["pages"]  # flat [B * max_pages]: index_select copies whole pages
        # [B, Hkv, max_pages * page_size, D]
        keys = k_cache.index_select(0, pages).view(num_seqs, -1, *k_cache.shape[2:]).transpose(1, 2)
        values = v_cache.index_select(0, pages).view(num_seqs, -1, *v_cache.shape[2:]).transpose(1, 2)
        if max_q == 1:
            queries = q[:, :, None, :]  # [B, H, 1, D]: one row per sequence, already in order
        else:
            valid = meta.cache["query_valid"]
            queries = q.new_zeros(num_seqs, max_q, *q.shape[1:])
            queries[valid] = q
            queries = queries.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.cache["window_mask" if sliding and meta.sliding_window else "mask"],
            scale=scale,
            enable_gqa=queries.shape[1] != keys.shape[1],
        )
        if max_q == 1:
            return out[:, :, 0, :]
        return out.transpose(1, 2)[meta.cache["query_valid"]]


class TritonAttention:
    """Symphony's Triton kernels (`kernels/`): paged decode with split-K, paged prefill/extend
    (both with sliding windows), and K/V stores, reading pages in place (no gather). Meant for
    CUDA; on CPU it runs only under TRITON_INTERPRET=1 (tests)."""

    name = "triton"

    def __init__(self):
        from ..kernels import kv_store, paged_attention

        self._store_kv = kv_store.store_kv
        self._decode = paged_attention.paged_decode_attention
        self._prefill = paged_attention.paged_prefill_attention

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, sliding: bool) -> torch.Tensor:
        window = meta.sliding_window if sliding else None
        if meta.max_query_len == 1:
            return self._decode(q, k_cache, v_cache, meta.page_table, meta.context_lens, scale, window=window)
        return self._prefill(q, k_cache, v_cache, meta.page_table, meta.query_start_loc, meta.context_lens, scale,
                             window=window)


# Upstream flash-attn 2 refuses a paged cache whose pages hold fewer tokens ("Paged KV cache
# block size must be divisible by 256"), in both its decode and its varlen kernels.
FLASH_ATTN_PAGE_MULTIPLE = 256


class FlashAttention:
    """flash-attn's paged-KV kernels (`pip install '.[gpu]'`, CUDA only): `flash_attn_with_kvcache`
    for decode batches, `flash_attn_varlen_func` over the pages for prefill/extend. Both read the
    pool in place: its layout `[num_pages, page_size, num_kv_heads, head_dim]` is flash-attn's,
    the page table is its `block_table`, and its causal mask is aligned to the bottom right, as
    ours is. New K/V go in through the Triton store kernel. Decode runs eagerly: flash-attn is
    not among the CUDA graphs' backends until it has been measured on a GPU."""

    name = "flash-attn"

    def __init__(self, page_size: int, dtype: torch.dtype):
        reason = flash_attn_unavailable(page_size, dtype)
        if reason is not None:
            raise ValueError(f"the flash-attn backend cannot run here: {reason}")
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from ..kernels import kv_store

        self._store_kv = kv_store.store_kv
        self._decode = flash_attn_with_kvcache
        self._varlen = flash_attn_varlen_func

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.max_query_len > 1:  # the keys' offsets, as the varlen kernel takes them
            meta.cache["cu_seqlens_k"] = F.pad(meta.context_lens.cumsum(0, dtype=torch.int32), (1, 0))

    def store(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, sliding: bool) -> torch.Tensor:
        # Keys (pos - window, pos] for the query at pos: flash-attn's window counts the left keys.
        window = (meta.sliding_window - 1, 0) if sliding and meta.sliding_window else (-1, -1)
        if meta.max_query_len == 1:
            out = self._decode(q[:, None], k_cache, v_cache, cache_seqlens=meta.context_lens,
                               block_table=meta.page_table, softmax_scale=scale, causal=True, window_size=window)
            return out[:, 0]
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc,
                            cu_seqlens_k=meta.cache["cu_seqlens_k"], max_seqlen_q=meta.max_query_len,
                            max_seqlen_k=meta.max_context_len, softmax_scale=scale, causal=True,
                            window_size=window, block_table=meta.page_table)


def flash_attn_unavailable(page_size: int, dtype: torch.dtype) -> str | None:
    """Why the flash-attn backend cannot serve pages of `page_size` tokens of `dtype` here; None
    when it can."""
    try:
        import flash_attn
    except ImportError:
        return "flash-attn is not installed (pip install '.[gpu]' on a CUDA machine)"
    except Exception as error:  # installed but broken (e.g. built for another torch): say so
        return f"flash-attn does not import ({type(error).__name__}: {error})"
    varlen = getattr(flash_attn, "flash_attn_varlen_func", None)
    if not hasattr(flash_attn, "flash_attn_with_kvcache") or varlen is None \
            or "block_table" not in inspect.signature(varlen).parameters:
        return f"flash-attn {getattr(flash_attn, '__version__', '?')} has no paged varlen kernel (2.6 or later has)"
    if page_size % FLASH_ATTN_PAGE_MULTIPLE:
        return f"its paged KV needs pages of a multiple of {FLASH_ATTN_PAGE_MULTIPLE} tokens (page size {page_size})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it runs float16 and bfloat16 only (dtype {str(dtype).replace('torch.', '')})"
    return None


BACKENDS = {"torch": TorchAttention, "triton": TritonAttention, "flash-attn": FlashAttention}


def select_backend(device: torch.device, requested: str | None = None, page_size: int = 16,
                   dtype: torch.dtype = torch.bfloat16):
    """The attention backend for `device` and pages of `page_size` tokens of `dtype`: `requested`
    (or $SYMPHONY_ATTENTION) when given; else flash-attn on CUDA when it imports and takes these
    pages, then Triton on CUDA, and the torch reference elsewhere."""
    requested = requested or os.environ.get("SYMPHONY_ATTENTION") or None
    cuda = torch.device(device).type == "cuda"
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(f"unknown attention backend {requested!r}; choose one of {sorted(BACKENDS)}")
        if requested == "flash-attn":
            if not cuda:
                raise ValueError("the flash-attn backend runs on CUDA only; choose torch or triton here")
            return FlashAttention(page_size, dtype)
        return BACKENDS[requested]()
    if cuda:
        return FlashAttention(page_size, dtype) if flash_attn_unavailable(page_size, dtype) is None \
            else TritonAttention()
    return TorchAttention()


def describe_backend(backend, device: torch.device, page_size: int, dtype: torch.dtype) -> str:
    """The backend's name and, on CUDA where it is not flash-attn, why not (`symphony info`)."""
    if torch.device(device).type != "cuda" or backend.name == "flash-attn":
        return backend.name
    reason = flash_attn_unavailable(page_size, dtype)
    return f"{backend.name} (flash-attn: {reason or 'available, not chosen'})"
