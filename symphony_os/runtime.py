"""The level-1 scheduler: worker threads poll LIP processes as fibers; a batch driver runs the
engine when every worker has finished its round, so the `pred`s of a round share a batch.

Each process belongs to one worker (its Store is only ever touched by that thread). A worker's
round polls every ready process once: each runs until it blocks in a host call, yields at the
end of its epoch slice, or ends. Completed preds and delivered messages put their processes
back on their worker's ready queue.
"""
from __future__ import annotations

import threading
from collections import deque
from pathlib import Path

import wasmtime

from .engine import Engine
from .fiber import AsyncLinker, EpochTicker, Pending, Ready, make_async_engine
from .guest_memory import GuestMemory
from .hostcalls import CALLS, HostCalls, Block
from .process import Process, ProcessLimits
from .program import Program, load_program, load_program_file

BLOCKING_CALLS = ("pred_wait", "recv")
EPOCH_INTERVAL_S = 0.01  # one epoch tick: a guest's time slice is a multiple of this


class Worker:
    """A scheduler thread and the processes it owns."""

    def __init__(self, index: int, driver: "BatchDriver"):
        self.index = index
        self.driver = driver
        self.processes: set[Process] = set()
        self._ready: deque[Process] = deque()
        self._queued: set[int] = set()
        self._cond = threading.Condition()
        self._stopping = False
        self.rounds = 0
        self.idle = True
        self.thread = threading.Thread(target=self._loop, name=f"symphony-worker-{index}", daemon=True)

    def add(self, process: Process) -> None:
        process.wake = self.wake
        with self._cond:
            self.processes.add(process)
        self.wake(process)

    def wake(self, process: Process) -> None:
        """Queue `process` for this worker's next round (any thread)."""
        with self._cond:
            if process.pid not in self._queued:
                self._queued.add(process.pid)
                self._ready.append(process)
                self.idle = False
                self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not self._stopping:
                    self.idle = True
                    self._cond.wait()
                if self._stopping:
                    return
                batch = list(self._ready)
                self._ready.clear()
                self._queued.clear()
            for process in batch:
                if process.ready_to_resume() and process.advance():
                    self.wake(process)  # it yielded its slice: run it again next round
                if process.finished:
                    with self._cond:
                        self.processes.discard(process)
            with self._cond:
                self.rounds += 1
                if not self._ready:
                    self.idle = True
            self.driver.round_done()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


class BatchDriver:
    """Runs `engine.step()` once every worker is idle or has finished a round since the last
    batch: the preds submitted during a round land in one batch, and a busy worker (a guest
    computing) cannot hold batches back for longer than one round."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.workers: list[Worker] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.thread = threading.Thread(target=self._loop, name="symphony-batch-driver", daemon=True)

    def round_done(self) -> None:
        with self._cond:
            self._cond.notify()

    def notify(self) -> None:
        self.round_done()

    def _loop(self) -> None:
        seen = [0] * len(self.workers)
        while True:
            with self._cond:
                while not self._stopping and not (
                    len(self.engine.scheduler)
                    and all(w.idle or w.rounds > seen[i] for i, w in enumerate(self.workers))
                ):
                    self._cond.wait(timeout=0.05)
                if self._stopping:
                    return
                seen = [w.rounds for w in self.workers]
            self.engine.step()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


def _handler(name: str, blocking: bool):
    def handle(call, args):
        process: Process = call.fiber.owner
        outcome = process.hostcalls.call(name, GuestMemory(call.memory_location), args)
        if isinstance(outcome, Block):
            return process.block_on(outcome, call)
        return Ready([outcome]) if blocking else [outcome]

    return handle


class Runtime:
    """Runs LIP processes over an `Engine`: `load` programs, `spawn` processes, `wait` for them."""

    def __init__(self, engine: Engine, workers: int = 1, limits: ProcessLimits = ProcessLimits()):
        self.engine = engine
        self.limits = limits
        self.wasm_engine = make_async_engine(epoch_interruption=True)
        self.linker = AsyncLinker(self.wasm_engine)
        self.linker.define_wasi()
        i32 = wasmtime.ValType.i32()
        self.linker.linker.allow_shadowing = True
        self.linker.define_func("wasi_snapshot_preview1", "fd_write", [i32] * 4, [i32], _handler("fd_write", False))
        self.linker.linker.allow_shadowing = False
        for name, arity in HostCalls.table().items():
            blocking = name in BLOCKING_CALLS
            define = self.linker.define_async if blocking else self.linker.define_func
            define("symphony", name, [i32] * arity, [i32], _handler(name, blocking))
        self.driver = BatchDriver(engine)
        self.workers = [Worker(i, self.driver) for i in range(workers)]
        self.driver.workers = self.workers
        self.processes: dict[int, Process] = {}
        self._ticker = EpochTicker(self.wasm_engine, EPOCH_INTERVAL_S)
        self._started = False
        self._next_worker = 0

    def start(self) -> "Runtime":
        if not self._started:
            self._started = True
            self._ticker.start()
            for worker in self.workers:
                worker.thread.start()
            self.driver.thread.start()
        return self

    def close(self) -> None:
        """Kill what still runs and stop the threads."""
        for process in list(self.processes.values()):
            process.kill("runtime shut down")
        for process in list(self.processes.values()):
            process.ended.wait(timeout=5)
        if self._started:
            for worker in self.workers:
                worker.stop()
            self.driver.stop()
            for worker in self.workers:
                worker.thread.join()
            self.driver.thread.join()
            self._ticker.stop()
            self._started = False

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def load(self, source: str | Path | bytes, name: str = "program") -> Program:
        """Validate and compile a program from a path or bytes (raises ProgramError)."""
        if isinstance(source, (bytes, bytearray)):
            return load_program(self.wasm_engine, bytes(source), name)
        return load_program_file(self.wasm_engine, source)

    def spawn(self, program: Program, args: list[str] = (), env: dict[str, str] | None = None,
              tenant: str = "default", on_output=None, on_log=None, on_exit=None) -> Process:
        """Start a process of `program`; it runs on one of the workers."""
        self.start()
        session = self.engine.kvfs.session(tenant, max_handles=self.limits.kv_handles)
        process = Process(program, list(args), dict(env or {}), self.engine, session, self.linker, self.limits,
                          on_output=on_output, on_log=on_log, on_exit=on_exit)
        self.processes[process.pid] = process
        worker = min(self.workers, key=lambda w: len(w.processes))
        worker.add(process)
        return process

    def kill(self, pid: int, reason: str = "killed") -> None:
        self.processes[pid].kill(reason)

    def wait(self, process: Process, timeout_s: float | None = None) -> int | None:
        """Wait for the process to end; its exit code (None on timeout)."""
        if not process.ended.wait(timeout_s):
            return None
        self.processes.pop(process.pid, None)
        return process.exit_code
