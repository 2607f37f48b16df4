"""The server's processes: launched for a tenant, streamed to one attached client at a time,
detached and re-attached, killed when their client vanished for longer than a grace period
(unless launched detached), and forgotten a while after they end.

Everything here runs on the event loop's thread: the runtime calls back from its worker
threads, and those callbacks hop over with `call_soon_threadsafe`. A client receives frames
(plain dicts, msgpack-encoded by the server):
    {"type": "output", "data": bytes}       what the LIP sent
    {"type": "log", "text": str}            its stdout/stderr
    {"type": "exit", "code": int, "state": str, "reason": str}
    {"type": "error", "message": str}       a client frame the server refused
Frames wait in the process's FrameBuffer until its client has sent them, whether or not one is
attached: past `BUFFER_BYTES` the oldest are dropped (and the client told how many). A client
that attaches to an ended process gets its exit frame again. Ended processes are remembered for
a while, at most `ENDED_PER_TENANT` of them per tenant, holding at most
`ENDED_BYTES_PER_TENANT` of unsent frames in all.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..lip.process import Process, ProcessState
from ..lip.runtime import Runtime
from ..wasm.program import Program
from .logs import event
from .metrics import PROCESS, RequestTimer, ServerMetrics
from .program_store import StoredProgram
from .tenants import QuotaExceeded, Tenant

log = logging.getLogger("symphony.server")

BUFFER_BYTES = 4 * 2**20  # frames not yet sent to a client, per process
FRAME_OVERHEAD_BYTES = 64  # counted per frame, so empty frames are bounded too
LOG_TAIL_CHARS = 4096  # of the log, shown by GET /processes
ENDED_PER_TENANT = 256  # ended processes remembered per tenant (the oldest are forgotten first)
ENDED_BYTES_PER_TENANT = 64 * 2**20  # and their frames no client took, in all (the same way)


class AlreadyAttached(Exception):
    """Another client is attached to the process."""


def frame_bytes(frame: dict) -> int:
    payload = frame.get("data") or frame.get("text") or frame.get("message") or ""
    return len(payload) + FRAME_OVERHEAD_BYTES


class FrameBuffer:
    """A process's frames on their way to its client, oldest first; `max_bytes` (None:
    unbounded) bounds them by dropping the oldest, and the next frame taken then is a log
    frame saying how many were dropped. The client's sender takes a frame in two steps:
    `peek` (waits for one), then `pop` once it was sent, so a frame whose send was
    interrupted (the client left) stays for the next client."""

    def __init__(self, max_bytes: int | None = BUFFER_BYTES):
        self.max_bytes = max_bytes
        self.dropped = 0
        self._frames: deque[tuple[dict, int]] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def bytes(self) -> int:
        return self._bytes

    def push(self, frame: dict) -> None:
        size = frame_bytes(frame)
        self._frames.append((frame, size))
        self._bytes += size
        while self.max_bytes is not None and self._bytes > self.max_bytes and len(self._frames) > 1:
            self._bytes -= self._frames.popleft()[1]
            self.dropped += 1
        self._ready.set()

    async def peek(self) -> dict:
        while not self._frames:
            self._ready.clear()
            await self._ready.wait()
        if self.dropped:
            notice = {"type": "log", "text": f"symphony: {self.dropped} frames were dropped: the client did not "
                                             f"take them (more than {self.max_bytes} bytes waited)\n"}
            self._frames.appendleft((notice, frame_bytes(notice)))
            self._bytes += frame_bytes(notice)
            self.dropped = 0
        return self._frames[0][0]

    def pop(self, frame: dict) -> None:
        """Remove `frame`, the one `peek` returned, unless it was dropped meanwhile."""
        if self._frames and self._frames[0][0] is frame:
            self._bytes -= self._frames.popleft()[1]

    async def get(self) -> dict:
        frame = await self.peek()
        self.pop(frame)
        return frame


@dataclass(eq=False)
class ServedProcess:
    pid: int  # the tenant's own numbering: a tenant learns nothing of how many processes others run
    tenant: Tenant
    program: StoredProgram
    args: list[str]
    detached: bool
    process: Process | None = None
    launched_at: float = field(default_factory=time.time)
    frames: FrameBuffer = field(default_factory=FrameBuffer)
    attached: bool = False
    unattended_since: float | None = field(default_factory=time.monotonic)
    ended_at: float | None = None
    exit_frame: dict[str, Any] | None = None
    exit_delivered: bool = False
    log_tail: str = ""
    timer: RequestTimer | None = None  # its times, for the metrics

    @property
    def running(self) -> bool:
        return self.ended_at is None

    def info(self) -> dict:
        p = self.process
        return {"pid": self.pid, "tenant": self.tenant.name, "program": self.program.sha256,
                "name": self.program.name, "args": self.args, "state": p.state.value,
                "exit_code": p.exit_code, "end_reason": p.end_reason, "detached": self.detached,
                "attached": self.attached, "cpu_time_s": round(p.cpu_seconds, 4),
                "launched_at": self.launched_at, "log_tail": self.log_tail}


class ProcessTable:
    def __init__(self, runtime: Runtime, loop: asyncio.AbstractEventLoop, grace_s: float = 30.0,
                 retention_s: float = 600.0, metrics: ServerMetrics | None = None):
        self.runtime = runtime
        self.metrics = metrics  # processes' times go there (ServerMetrics.request)
        self.loop = loop
        self.grace_s = grace_s
        self.retention_s = retention_s
        self.records: dict[tuple[str, int], ServedProcess] = {}  # (tenant, pid) -> its process
        self._last_pid: dict[str, int] = {}  # tenant -> the pid it was given last
        self.ended_per_tenant = ENDED_PER_TENANT
        self.ended_bytes_per_tenant = ENDED_BYTES_PER_TENANT
        self._ended: dict[str, deque[int]] = {}  # tenant -> pids of its ended processes, oldest first

    # ---- launching and finding ----

    def launch(self, tenant: Tenant, program: Program, stored: StoredProgram, args: list[str],
               env: dict[str, str], detached: bool = False, buffer_bytes: int | None = BUFFER_BYTES,
               measured: bool = True) -> ServedProcess:
        """Start a process of `program` for `tenant` (raises QuotaExceeded). `buffer_bytes`
        bounds its frames waiting for a client (None: unbounded, for a caller that bounds them
        itself). `measured`: its times go to the metrics as a process's (a caller that measures
        it as something else says False)."""
        self.check_process_quota(tenant)
        pid = self._last_pid.get(tenant.name, 0) + 1
        record = ServedProcess(pid, tenant, stored, list(args), detached, frames=FrameBuffer(buffer_bytes))
        if measured and self.metrics is not None:
            record.timer = self.metrics.request(PROCESS)
        hop = self.loop.call_soon_threadsafe
        record.process = self.runtime.spawn(
            program, args, env, tenant=tenant.name, limits=tenant.quotas.process_limits(self.runtime.limits),
            on_output=lambda data: hop(self._on_output, record, data),
            on_log=lambda text: hop(self._on_log, record, text),
            on_exit=lambda process: hop(self._on_exit, record))
        self._last_pid[tenant.name] = pid
        self.records[(tenant.name, pid)] = record
        event(log, "process launched", pid=pid, tenant=tenant.name, runtime_pid=record.process.pid,
              program=stored.sha256, name=stored.name, detached=detached)
        return record

    def get(self, tenant: str, pid: int) -> ServedProcess | None:
        """The process, if it exists and belongs to `tenant` (others' are invisible)."""
        return self.records.get((tenant, pid))

    def list(self, tenant: str, include_ended: bool = False) -> list[ServedProcess]:
        return [r for r in self.records.values() if r.tenant.name == tenant and (include_ended or r.running)]

    def running_count(self, tenant: str) -> int:
        return sum(1 for r in self.records.values() if r.tenant.name == tenant and r.running)

    def check_process_quota(self, tenant: Tenant) -> None:
        """Raise QuotaExceeded if `tenant` may not start another process now."""
        limit = tenant.quotas.max_processes
        if limit is not None and self.running_count(tenant.name) >= limit:
            raise QuotaExceeded(f"process quota: tenant {tenant.name!r} already runs {limit} processes")

    def kill(self, record: ServedProcess, reason: str = "killed") -> None:
        if record.running:
            record.process.kill(reason)

    # ---- clients ----

    def attach(self, record: ServedProcess) -> FrameBuffer:
        """Become the process's one client: its frames, starting with those no client took yet
        (an ended process's exit frame again, if a client took it before)."""
        if record.attached:
            raise AlreadyAttached(f"process {record.pid} already has a client attached; detach it first")
        if record.exit_delivered:  # taken by a client before: again, once (delivered when taken)
            record.frames.push(record.exit_frame)
            record.exit_delivered = False
        record.attached = True
        record.unattended_since = None
        return record.frames

    def detach(self, record: ServedProcess, on_purpose: bool) -> None:
        """The client left; the frames it did not take wait for the next. `on_purpose`: it
        detached, so the process runs on; otherwise it vanished and the grace period starts
        (unless the process was launched detached)."""
        if not record.attached:
            return
        record.attached = False
        if on_purpose:
            record.detached = True
        record.unattended_since = time.monotonic()
        event(log, "client detached" if on_purpose else "client vanished", pid=record.pid,
              tenant=record.tenant.name)

    def delivered_exit(self, record: ServedProcess) -> None:
        record.exit_delivered = True

    # ---- callbacks from the runtime (on the loop) ----

    def _push(self, record: ServedProcess, frame: dict) -> None:
        record.frames.push(frame)

    def _on_output(self, record: ServedProcess, data: bytes) -> None:
        if record.timer is not None:
            record.timer.token()
        record.frames.push({"type": "output", "data": data})

    def _on_log(self, record: ServedProcess, text: str) -> None:
        record.log_tail = (record.log_tail + text[-LOG_TAIL_CHARS:])[-LOG_TAIL_CHARS:]
        self._push(record, {"type": "log", "text": text})

    def _on_exit(self, record: ServedProcess) -> None:
        process = record.process
        record.ended_at = time.monotonic()
        self.runtime.wait(process, 0)  # forget it in the runtime's table
        event(log, "process ended", pid=record.pid, tenant=record.tenant.name, state=process.state.value,
              code=process.exit_code, reason=process.end_reason, cpu_time_s=round(process.cpu_time_s, 4))
        record.exit_frame = {"type": "exit", "code": process.exit_code, "state": process.state.value,
                             "reason": process.end_reason}
        if record.timer is not None:
            record.timer.finish("killed" if process.state is ProcessState.KILLED else
                                "exited" if process.exit_code == 0 else "failed")
        self._push(record, record.exit_frame)
        self._forget_oldest_ended(record)

    def _forget_oldest_ended(self, record: ServedProcess) -> None:
        """Remember at most `ended_per_tenant` ended processes of the tenant, holding at most
        `ended_bytes_per_tenant` of unsent frames in all (each process's own bound times the
        processes a tenant may end in a row had no bound: 256 of them held 1 GB), forgetting
        the oldest first; an attached one stays until the reaper takes it."""
        ended = self._ended.setdefault(record.tenant.name, deque())
        ended.append(record.pid)
        tenant = record.tenant.name
        held = sum(old.frames.bytes for old in (self.records.get((tenant, pid)) for pid in ended) if old is not None)
        while len(ended) > self.ended_per_tenant or (held > self.ended_bytes_per_tenant and len(ended) > 1):
            old = self.records.get((tenant, ended.popleft()))
            if old is not None:
                held -= old.frames.bytes
                if not old.attached:
                    del self.records[(tenant, old.pid)]

    # ---- housekeeping ----

    def reap(self) -> None:
        """Kill processes whose client vanished past the grace period (each process enforces
        its own limits: limits.py); forget ended processes after `grace_s`, or `retention_s` for
        a detached one whose exit no client has seen yet."""
        now = time.monotonic()
        for record in list(self.records.values()):
            if record.running:
                if (not record.detached and record.unattended_since is not None
                        and now - record.unattended_since > self.grace_s):
                    self.kill(record, f"no client attached for {self.grace_s} s (launch it detached to keep it)")
                continue
            keep = self.retention_s if record.detached and not record.exit_delivered else self.grace_s
            if now - record.ended_at > keep:
                self.records.pop((record.tenant.name, record.pid), None)

    async def reap_forever(self, interval_s: float = 0.2) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.reap()
            except Exception:  # housekeeping must go on
                log.exception("reaping processes failed")

    def kill_all(self, reason: str) -> None:
        for record in list(self.records.values()):
            self.kill(record, reason)

    def counts_by_state(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for record in self.records.values():
            state = record.process.state.value
            counts[state] = counts.get(state, 0) + 1
        return counts
