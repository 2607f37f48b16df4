"""The paged KV pool: K/V storage for every layer in fixed-size pages, with reference counts.

Layout (shared with the attention kernels and flash-attn's paged KV API): `k` and `v` are
`[num_layers, num_pages, page_size, num_kv_heads, head_dim]`; a sequence's token i lives in page
`pages[i // page_size]`, slot `i % page_size`. The pool only hands out and frees pages; which
pages belong to which KV file is KVFS's business.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import PoolExhausted

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


@dataclass(frozen=True)
class PoolStats:
    """Page counts of the pool; `swapped` counts pages held in host memory."""

    total: int
    used: int
    shared: int
    free: int
    swapped: int
    peak_used: int
    page_size: int
    bytes_per_page: int


class HostPage:
    """One page's K and V (all layers) copied to host memory by `KVPool.swap_out`."""

    __slots__ = ("k", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k = k
        self.v = v


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed pool tensor. On the host through numpy, whose zeros come from calloc: the
    operating system's zero pages, mapped as they are first written (torch writes every byte
    first: 0.12 s per 256 MiB here, all of it resident at once, for a pool mostly unused)."""
    host = _NUMPY_DTYPES.get(dtype)
    if torch.device(device).type == "cpu" and host is not None:
        return torch.from_numpy(np.zeros(shape, dtype=host))
    return torch.zeros(shape, dtype=dtype, device=device)


class KVPool:
    """Fixed-size pages of K/V with reference counts.

    `reclaim(n)` may be set by the owner (KVFS) to free or swap pages when an allocation finds
    fewer than `n` free pages; it returns when it has done what it can.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_swapped: int | None = None,
    ):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.refcount = [0] * num_pages
        # A stack: recently freed pages are reused first (warm in cache).
        self._free = list(range(num_pages - 1, -1, -1))
        self._shared = 0
        self._swapped = 0
        # Pages swap_out may hold in host memory at once (default: as many as the pool has).
        # Without a bound, guests holding files open past the pool would fill the host's memory.
        self.max_swapped = num_pages if max_swapped is None else max_swapped
        if self.max_swapped < 0:
            raise ValueError(f"max_swapped must be >= 0, got {max_swapped}")
        self._peak_used = 0
        self.reclaim: Callable[[int], None] | None = None

    @property
    def bytes_per_page(self) -> int:
        """Bytes of K plus V for one page over all layers."""
        per_layer = self.page_size * self.k.shape[3] * self.k.shape[4] * self.k.element_size()
        return 2 * self.k.shape[0] * per_layer

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def stats(self) -> PoolStats:
        used = self.num_pages - len(self._free)
        return PoolStats(
            total=self.num_pages,
            used=used,
            shared=self._shared,
            free=len(self._free),
            swapped=self._swapped,
            peak_used=self._peak_used,
            page_size=self.page_size,
            bytes_per_page=self.bytes_per_page,
        )

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages (refcount 1 each); asks `reclaim` first when short.

        Raises PoolExhausted when there still are not enough, without taking any.
        """
        if n <= 0:
            return []
        if len(self._free) < n and self.reclaim is not None:
            self.reclaim(n - len(self._free))
        if len(self._free) < n:
            raise PoolExhausted(
                f"KV pool exhausted: need {n} pages, {len(self._free)} free of {self.num_pages} "
                f"({self.page_size} tokens each); close or remove KV files, or start with a larger pool"
            )
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self.refcount[page] = 1
        self._peak_used = max(self._peak_used, self.num_pages - len(self._free))
        return pages

    def incref(self, pages: list[int]) -> None:
        """Add one reference to each page (a fork or a shared read)."""
        for page in pages:
            count = self.refcount[page]
            if count <= 0:
                raise RuntimeError(f"incref of free page {page}")
            if count == 1:
                self._shared += 1
            self.refcount[page] = count + 1

    def pin(self, page: int) -> None:
        """`incref` of one page a file alone holds (a tentative step's, KVFS.reserve_tentative)."""
        if self.refcount[page] != 1:
            raise RuntimeError(f"pin of page {page}, held {self.refcount[page]} times")
        self._shared += 1
        self.refcount[page] = 2

    def unpin(self, page: int) -> None:
        """`decref` of one page (the pin's)."""
        self.decref((page,))

    def decref(self, pages: list[int]) -> None:
        """Drop one reference from each page; a page with none left returns to the free list."""
        for page in pages:
            count = self.refcount[page]
            if count <= 0:
                raise RuntimeError(f"decref of free page {page}")
            if count == 2:
                self._shared -= 1
            self.refcount[page] = count - 1
            if count == 1:
                self._free.append(page)

    def copy_page(self, src: int) -> int:
        """A new private page holding a copy of `src` (copy-on-write)."""
        (dst,) = self.allocate(1)
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])
        return dst

    def copy_tokens(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy token slots (flat `page * page_size + offset` indices) in every layer."""
        layers = self.k.shape[0]
        k_flat = self.k.view(layers, -1, *self.k.shape[3:])
        v_flat = self.v.view(layers, -1, *self.v.shape[3:])
        k_flat[:, dst_slots] = k_flat[:, src_slots]
        v_flat[:, dst_slots] = v_flat[:, src_slots]

    @property
    def swap_room(self) -> int:
        """How many more pages swap_out may take to host memory (0 also when `max_swapped` was
        lowered below what is swapped out already)."""
        return max(0, self.max_swapped - self._swapped)

    def _require_swap_room(self, pages: int) -> None:
        if pages > self.swap_room:
            raise PoolExhausted(f"KV pages swapped to host memory are at their limit of {self.max_swapped}")

    def swap_out(self, page: int) -> HostPage:
        """Copy a page to host memory and drop this reference to it (PoolExhausted when the
        host already holds `max_swapped` pages)."""
        self._require_swap_room(1)
        pin = self.device.type == "cuda"
        k = torch.empty_like(self.k[:, page], device="cpu", pin_memory=pin)
        v = torch.empty_like(self.v[:, page], device="cpu", pin_memory=pin)
        k.copy_(self.k[:, page])
        v.copy_(self.v[:, page])
        self.decref([page])
        self._swapped += 1
        return HostPage(k, v)

    def copy_host_pages(self, pages: list[HostPage]) -> list[HostPage]:
        """Copies of swapped-out pages, for a second file; PoolExhausted, before copying any,
        when the host has no room for them all."""
        self._require_swap_room(len(pages))
        self._swapped += len(pages)
        return [HostPage(page.k.clone(), page.v.clone()) for page in pages]

    def swap_in(self, host: HostPage) -> int:
        """A new device page holding a swapped-out page's contents."""
        (page,) = self.allocate(1)
        self.k[:, page].copy_(host.k, non_blocking=True)
        self.v[:, page].copy_(host.v, non_blocking=True)
        self._swapped -= 1
        return page

    def discard(self, host: HostPage) -> None:
        """Forget a swapped-out page that will never be swapped back in."""
        self._swapped -= 1
