"""The sandbox's limits: what one LIP process may use, how each limit is enforced, and the reason
its client sees when it hits one (SECURITY.md has the table).

wasm isolates a guest's memory and control flow; everything else a guest can exhaust (CPU, wall
time, host calls, output, KV pages, handles) is counted here or where it is spent. A limit that
is hit ends (or refuses) only the offending process, and `Process._end` frees what it held.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

import wasmtime

from ..errors import LimitExceeded


@dataclass(frozen=True)
class ProcessLimits:
    """Per-process limits; None is unlimited. `wasm_stack_bytes` and whether `fuel` is on at
    all are properties of the runtime's wasm engine: they come from `Runtime(limits=...)`, and
    per-process limits (a tenant's) may only change the others."""

    # Linear memory (memory.grow returns -1 past it). wasmtime applies it to each memory: with
    # `memories` at 1 it is the process's total (a WASI command and a componentize-py component
    # each use one; wasmtime-py 50 has no store-wide memory limiter).
    memory_bytes: int = 256 * 2**20
    wasm_stack_bytes: int = 1 * 2**20  # wasm call stack: deeper recursion traps
    table_elements: int = 100_000  # elements of any one table
    instances: int = 64  # wasm instances in the process's store (a component has several)
    tables: int = 64
    memories: int = 1  # more would multiply memory_bytes
    cpu_time_s: float | None = 600.0  # CPU time spent advancing the process (host calls included)
    wall_time_s: float | None = None  # from spawn to exit, blocked time included
    fuel: int | None = None  # wasm instructions (roughly), when the runtime consumes fuel
    hostcalls_per_s: int = 200_000  # calls over this in one second are refused (LIMIT_EXCEEDED)
    output_bytes: int = 256 * 2**20  # bytes sent to the user plus stdout/stderr
    kv_pages: int | None = None  # distinct pages in the KV files the process holds open or its preds write
    kv_handles: int = 4096  # open KV handles
    preds_in_flight: int = 256  # preds submitted and not yet waited for (parallel branches)
    # host memory in next-token distributions: kind-0 preds in flight plus a Python guest's live
    # `distribution` resources (4 bytes per vocabulary entry each: 600 KB at 151,936 tokens)
    distribution_bytes: int = 256 * 2**20
    time_slice_ticks: int = 1  # epoch intervals (10 ms) a resumed guest computes at least before it yields


def _amount(value: float) -> str:
    return f"{value:g}"


def _mib(value: int) -> str:
    return f"{value / 2**20:g} MiB"


class Usage:
    """What one process has used of its limits so far. Touched by the process's worker thread,
    except `over_time`, which the watchdog calls too."""

    __slots__ = ("limits", "started", "output_bytes", "hostcalls", "_window_start", "check_at", "_check_every")

    def __init__(self, limits: ProcessLimits):
        self.limits = limits
        self.started = time.monotonic()
        self.output_bytes = 0
        self.hostcalls = 0  # in the current one-second window
        self._window_start = self.started
        # Fixed one-second windows. The clock is read every 1/16 of the rate, so a window a
        # guest left idle is replaced within that many calls and a window holds at most 17/16
        # of the rate (reading it only past the limit let a stale window's room and a fresh
        # one's add up at once). As with any fixed window, a second spanning the end of one
        # window and the start of the next may see up to twice the rate.
        self._check_every = max(1, limits.hostcalls_per_s // 16)
        self.check_at = self._check_every  # hostcalls at which check_rate runs next

    def charge_hostcall(self) -> None:
        """Count one host call; raise LimitExceeded past the per-second rate. The common path
        is one addition and one comparison (SystemCalls.dispatch calls this on every host call)."""
        self.hostcalls += 1
        if self.hostcalls >= self.check_at:
            self.check_rate()

    def check_rate(self) -> None:
        """The rest of `charge_hostcall`, once `hostcalls` reached `check_at`."""
        now = time.monotonic()
        limit = self.limits.hostcalls_per_s
        if now - self._window_start >= 1.0:
            self._window_start, self.hostcalls, self.check_at = now, 1, self._check_every
            if limit >= 1:
                return
        if self.hostcalls > limit:
            raise LimitExceeded(f"host-call rate limit {limit}/s exceeded")
        self.check_at = min(self.hostcalls + self._check_every, limit + 1)

    def charge_output(self, nbytes: int) -> str | None:
        """Count output bytes; the kill reason once the total passes the limit, else None."""
        self.output_bytes += nbytes
        if self.output_bytes > self.limits.output_bytes:
            return f"killed: output limit {_mib(self.limits.output_bytes)} exceeded"
        return None

    def over_time(self, cpu_time_s: float) -> str | None:
        """The kill reason if the process is past its CPU or wall time, else None."""
        limits = self.limits
        if limits.cpu_time_s is not None and cpu_time_s > limits.cpu_time_s:
            return f"killed: cpu time limit {_amount(limits.cpu_time_s)}s exceeded"
        if limits.wall_time_s is not None and time.monotonic() - self.started > limits.wall_time_s:
            return f"killed: wall time limit {_amount(limits.wall_time_s)}s exceeded"
        return None


# The end reasons of a process that a limit stopped: those this module writes, and wasmtime's
# refusal, at start, of a memory larger than the limit.
LIMIT_REASON = re.compile(r"^killed: .*\blimit\b.*\b(exceeded|exhausted)$|^trapped: .*\(memory near its limit"
                          r"|^failed to start: .*exceeds memory limits", re.S)  # a trap's message has lines


def ended_by_limit(reason: str | None) -> bool:
    """Whether a process with this end reason was stopped by one of its limits."""
    return reason is not None and LIMIT_REASON.match(reason) is not None


def trap_reason(fiber, limits: ProcessLimits, memory_bytes: int | None, instantiating: bool) -> str:
    """The end reason for a guest that trapped: a limit's name where a limit caused it."""
    code = fiber.trap_code
    if code == wasmtime.TrapCode.STACK_OVERFLOW:
        return f"killed: wasm stack limit {_mib(limits.wasm_stack_bytes)} exceeded"
    if code == wasmtime.TrapCode.OUT_OF_FUEL:
        return f"killed: fuel limit {limits.fuel} exhausted"
    if instantiating:
        return f"failed to start: {fiber.trap}"
    # memory.grow failing is no trap; a guest that then gives up usually traps or exits, with
    # its memory within the last of its 16 growth steps below the limit.
    if memory_bytes is not None and memory_bytes > limits.memory_bytes * 15 // 16:
        return f"trapped: {fiber.trap} (memory near its limit of {_mib(limits.memory_bytes)})"
    return f"trapped: {fiber.trap}"


def store_limits(store: wasmtime.Store, limits: ProcessLimits) -> None:
    """Apply the limits wasmtime enforces itself to a process's store."""
    store.set_limits(memory_size=limits.memory_bytes, table_elements=limits.table_elements,
                     instances=limits.instances, tables=limits.tables, memories=limits.memories)
    if limits.fuel is not None:
        store.set_fuel(limits.fuel)
