"""Checked access to a guest's linear memory: the only place host code reaches guest bytes
(reads, writes, and tensors over a checked range for torch to write a result into).

Every (pointer, length) pair is validated against the memory's size before use. Our wasm
engine never moves a memory (`make_async_engine` sets memory_may_move off) and a wasm memory
never shrinks, so a process keeps one `GuestMemory`: its base address and size are read once
and the size again only when an access reaches past it (the guest may have grown its memory).
Violations raise `BadPointer`, which host calls turn into an error code.
"""
from __future__ import annotations

import ctypes
import struct
from typing import Callable

import torch
import wasmtime

from ..errors import BadPointer
from .fiber import context_address, memory_location

MAX_I32 = 2**31 - 1
_I32 = struct.Struct("<i")


class GuestMemory:
    """A view of one guest memory. `locate()` returns (base address, size in bytes); it costs
    ctypes calls, so it is asked on the first access and again only when an access reaches
    past the size known so far. Bytes move through a memoryview of the memory (no foreign
    call: ctypes' string_at / memmove cost 0.4-0.6 us each here, a slice 0.05)."""

    __slots__ = ("_locate", "_base", "_size", "_view")

    def __init__(self, locate: Callable[[], tuple[int, int]]):
        self._locate = locate
        self._base = 0
        self._size = -1  # not located yet
        self._view = memoryview(b"")

    def _relocate(self) -> None:
        self._base, self._size = self._locate()
        array = (ctypes.c_char * self._size).from_address(self._base) if self._size else b""
        self._view = memoryview(array).cast("B")

    def check(self, ptr: int, length: int) -> None:
        """Raise BadPointer unless [ptr, ptr + length) lies inside memory (an output buffer the
        guest offers is checked whole, however much of it is then used)."""
        if not (0 <= ptr and 0 <= length and ptr + length <= self._size):
            if ptr == 0 and length == 0:
                return  # an empty buffer at NULL: nothing to locate
            self._relocate()  # the memory may have grown since
            if not (0 <= ptr <= MAX_I32 and 0 <= length <= MAX_I32 and ptr + length <= self._size):
                raise BadPointer(f"guest range [{ptr}, {ptr}+{length}) is outside memory of {self._size} bytes")

    @property
    def size(self) -> int:
        """The memory's size in bytes now."""
        self._relocate()
        return self._size

    def read(self, ptr: int, length: int) -> bytes:
        self.check(ptr, length)
        return bytes(self._view[ptr:ptr + length]) if length else b""

    def write(self, ptr: int, data: bytes) -> None:
        self.check(ptr, len(data))
        if data:
            self._view[ptr:ptr + len(data)] = data

    def read_str(self, ptr: int, length: int) -> str:
        try:
            return self.read(ptr, length).decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadPointer(f"guest string at {ptr} is not valid UTF-8: {error}") from None

    def read_i32s(self, ptr: int, count: int) -> list[int]:
        if count < 0 or count > MAX_I32 // 4:
            raise BadPointer(f"bad element count {count}")
        if not (0 <= ptr and ptr + 4 * count <= self._size):  # check()'s first test, inline
            self.check(ptr, 4 * count)
        if count == 1:  # a decode step's token
            return list(_I32.unpack_from(self._view, ptr))
        return list(struct.unpack_from(f"<{count}i", self._view, ptr)) if count else []

    def write_i32s(self, ptr: int, values: list[int]) -> None:
        self.write(ptr, struct.pack(f"<{len(values)}i", *values))

    def write_f32s(self, ptr: int, values: list[float]) -> None:
        self.write(ptr, struct.pack(f"<{len(values)}f", *values))

    def f32_tensor(self, ptr: int, count: int) -> torch.Tensor | None:
        """The guest's float32s [ptr, ptr + 4 * count) as a tensor over exactly those bytes, for
        a host op to write its result into (`out=`; an op that would resize it raises, it cannot
        reach past the range); None when `ptr` is not 4-aligned or `count` is 0. Use it while
        the guest is suspended, at once: it shares the guest's memory."""
        self.check(ptr, 4 * count)
        if ptr % 4 or not count:
            return None
        return torch.frombuffer(self._view[ptr:ptr + 4 * count], dtype=torch.float32)

    def write_tensor(self, ptr: int, tensor: torch.Tensor) -> None:
        """Copy a contiguous CPU tensor's bytes (e.g. a float32 distribution) into the guest:
        one memmove (about 20 us for 600 KB)."""
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        self.check(ptr, nbytes)
        if nbytes:
            ctypes.memmove(self._base + ptr, tensor.data_ptr(), nbytes)


def memory_locator(store: wasmtime.Store, memory: wasmtime.Memory) -> Callable[[], tuple[int, int]]:
    """A `locate` for a known memory export: two ctypes calls, instead of wasmtime-py's
    `data_ptr`/`data_len` wrappers or a lookup of the export through the caller each time."""
    context = context_address(store)
    return lambda: memory_location(context, memory._memory)
