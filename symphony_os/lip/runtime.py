"""The level-1 scheduler: worker threads poll LIP processes as fibers; a batch driver runs the
engine when every worker has finished its round, so the `pred`s of a round share a batch.

Each process belongs to one worker (its Store is only ever touched by that thread). A worker's
round polls every ready process once: each runs until it blocks in a host call, yields at the
end of its epoch slice, or ends. Completed preds and delivered messages put their processes
back on their worker's ready queue. Processes whose decode steps C took (the decode lane,
fiber_native.c) come back on a list of their own, and the round resumes all of them in one
native call (fiber.LaneRound): no Python runs per process but the engine's submit.
"""
from __future__ import annotations

import array
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import wasmtime

from ..engine.gc_tuning import tune_gc, untune_gc
from ..engine.loop import Engine
from ..wasm.component_linker import ComponentLinker
from ..wasm.fiber import AsyncLinker, EpochTicker, LaneRound, Ready, make_async_engine
from ..wasm.program import Program, load_program, load_program_file
from .component import ComponentProcess, component_linker
from .core_abi import WASI_CALLS, CoreCalls, wasi_failure
from .process import Process, ProcessLimits, submit_lane_requests
from .syscalls import Wait
from .timers import Timers
from .tools import ToolRegistry, default_tools

_get_ident = threading.get_ident
BLOCKING_CALLS = ("pred_wait", "pred", "recv", "poll_oneoff", "tokenize")  # may return a Wait: a fiber waits
EPOCH_INTERVAL_S = 0.01  # one epoch tick: a guest's time slice is a multiple of this
log = logging.getLogger("symphony.runtime")


class Watchdog:
    """A thread that kills processes past their wall time every `interval_s`, even while they
    wait (a `recv` nobody answers). CPU time is checked by each process whenever it is advanced."""

    def __init__(self, processes: Callable[[], Iterable[Process]], interval_s: float = 0.1):
        self._processes = processes
        self.interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="symphony-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self._check()

    def _check(self) -> None:
        try:
            for process in list(self._processes()):
                if process.limits.wall_time_s is not None and not process.finished:
                    reason = process.usage.over_time(0.0)
                    if reason is not None:
                        process.kill(reason)
        except Exception:  # the watchdog must outlive any one bad round
            log.exception("checking process deadlines failed")


class Worker:
    """A scheduler thread and the processes it owns; with `threaded=False` its rounds run on
    the thread that drives batches (`BatchDriver.run`), with no thread of its own."""

    def __init__(self, index: int, driver: "BatchDriver", threaded: bool = True):
        self.index = index
        self.driver = driver
        self.processes: set[Process] = set()
        # process -> preempted. Keyed by the process itself: its hash is its address, so a
        # wake-up reads nothing of the (by then cold) process to queue it.
        self._ready: dict[Process, bool] = {}
        self._urgent = 0  # queued processes that were not merely preempted
        # The decode lane's: processes whose lane request was answered, put here by their answer
        # on the driving thread (Process.lane_answered), moved to _lane_ready by `kick`.
        self._lane_answered: list[Process] = []
        self._lane_ready: list[Process] = []
        # Of those answered, the ones with no next step queued (their answer says so; moved by
        # `kick` into _unspeculated): the next batch waits for their round.
        self.lane_unspeculated: list[Process] = []
        self._unspeculated = False
        self._round_woken = False  # the round running holds processes woken otherwise
        self._lane_round = LaneRound()
        self._lock = threading.Lock()  # taken directly: a Condition's own `with` is Python code
        self._cond = threading.Condition(self._lock)
        self._stopping = False
        self._round_urgent = False
        self._cpu_per_wall = 1.0  # the share of its rounds' wall time this thread spent on a CPU
        self.thread = threading.Thread(target=self._loop, name=f"symphony-worker-{index}", daemon=True) \
            if threaded else None

    @property
    def holds_batch(self) -> bool:
        """Are there processes the next batch should wait for: woken (a pred done, a message,
        a kill) or just started, queued or being polled now? Preempted guests, which only
        compute, hold nothing back."""
        # Read in the order opposite to _take_round's writes (the lane list emptied only once
        # _round_urgent is set), without the lock: a round being taken is never missed.
        return bool(self._lane_answered) or bool(self._lane_ready) or self._urgent > 0 or self._round_urgent

    @property
    def lane_only(self) -> bool:
        """Are the processes queued for its next round (if any) in the decode lane with their
        next steps queued already (engine/speculation.py), none woken otherwise, and no round
        of woken processes running? Then the next batch need not wait for that round
        (BatchDriver._step)."""
        return self._urgent == 0 and not self._round_woken and not self._unspeculated

    @property
    def has_ready(self) -> bool:
        return bool(self._ready) or bool(self._lane_ready)

    def add(self, process: Process) -> None:
        process.wake = self.wake
        process.lane_answered = self._lane_answered
        process.lane_unspeculated = self.lane_unspeculated
        with self._lock:
            self.processes.add(process)
        self.wake(process)

    def wake(self, process: Process, preempted: bool = False) -> None:
        """Queue `process` for this worker's next round (any thread). Wake-ups from the batch
        driver (completed preds) are only queued: the driver starts the next round once it has
        delivered all of them, so one round takes every process the batch released."""
        driving = _get_ident() == self.driver.driving_thread  # the driver's own wake-ups are deferred
        with self._lock:
            queued = self._ready.get(process)  # None, or whether it was queued as preempted
            if queued is None or (queued and not preempted):
                self._urgent += (not preempted) - (queued is False)
                self._ready[process] = preempted
            if not driving and self.thread is not None:
                self._cond.notify()
        if not driving and self.thread is None:
            self.driver.round_done()  # the driving thread runs this worker's rounds

    def kick(self) -> None:
        """Start a round if anything is queued (after the driver delivered a batch)."""
        with self._lock:
            answered = self._lane_answered
            if answered:
                self._lane_ready += answered
                answered.clear()  # (the processes hold this list)
            self._unspeculated = bool(self.lane_unspeculated)
            self.lane_unspeculated.clear()
            if self._ready or self._lane_ready:
                self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not self._lane_ready and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                batch, lane = self._take_round()
            self._run_round(batch, lane)
            self.driver.round_done()

    def run_ready(self) -> bool:
        """Run one round of the queued processes here and now; False if none was queued."""
        with self._lock:
            if not self._ready and not self._lane_ready:
                return False
            batch, lane = self._take_round()
        self._run_round(batch, lane)
        return True

    def _take_round(self) -> tuple[list[tuple[Process, bool]], list[Process]]:
        batch = list(self._ready.items())
        self._ready.clear()
        lane = self._lane_ready
        self._round_woken = self._urgent > 0
        self._round_urgent = self._urgent > 0 or bool(lane)  # before the lists empty (holds_batch)
        self._lane_ready = []
        self._urgent = 0
        return batch, lane

    def _run_round(self, batch: list[tuple[Process, bool]], lane: list[Process] = ()) -> None:
        # CPU time: each process is charged the wall time it took, times the share of wall time
        # this thread spent on a CPU in the round before (the thread's CPU time, read once per
        # round: 0.5 us a read here). Charged as each process ends its turn, while its fields
        # are in the cache: a pass over all of them afterwards found them cold (1024 processes).
        cpu_started, cpu_per_wall, clock = time.thread_time(), self._cpu_per_wall, time.perf_counter
        if self._round_urgent and any(preempted for _, preempted in batch):
            # The woken first; then the next batch need not wait for the slices of guests that
            # only compute (it did, one slice each, for every token of every other process).
            batch.sort(key=lambda entry: entry[1])
            release_at = next(i for i, (_, preempted) in enumerate(batch) if preempted)
        else:
            release_at = None
        round_started = started = clock()
        last = len(batch) - 1
        for index, (process, _) in enumerate(batch):
            if index == release_at:
                if lane:  # (their preds are for the next batch too)
                    self._run_lane(lane, cpu_per_wall)
                    lane, started = (), clock()
                with self._lock:
                    self._round_urgent = self._round_woken = False
                self.driver.round_done()
            # The next process's native state is fetched into the cache while this one runs:
            # with a thousand processes a round, each one's is cold by its turn (fiber_native.c).
            outcome = process.advance(batch[index + 1][0].poll_address if index < last else None)
            now = clock()  # one read per process: its end is the next one's start
            process.cpu_time_s += (now - started) * cpu_per_wall
            started = now
            if outcome != "waiting":  # the common case first
                self._after(process, outcome)
        if lane:
            self._run_lane(lane, cpu_per_wall)
            started = clock()
        wall = started - round_started
        if wall > 0:
            self._cpu_per_wall = min(1.0, (time.thread_time() - cpu_started) / wall)
        with self._lock:
            self._round_urgent = self._round_woken = False

    def _after(self, process: Process, outcome: str) -> None:
        """What a process's turn that did not leave it waiting asks of its worker."""
        if outcome == "preempted":
            self.wake(process, preempted=True)
        elif outcome == "continue":
            self.wake(process)
        elif outcome == "ended":
            with self._lock:
                self.processes.discard(process)

    def _run_lane(self, lane: list[Process], cpu_per_wall: float) -> None:
        """Resume the processes whose lane request was answered, in one native call (C charges
        each its CPU time); their next requests go to the engine, and the few that did
        anything else go on the ordinary way."""
        lane_round = self._lane_round
        asked, others = lane_round.run(array.array("Q", [process.poll_address for process in lane]), cpu_per_wall)
        if asked:
            submit_lane_requests(lane, lane_round, asked)
        if others:
            clock = time.perf_counter
            indices, states = lane_round.others, lane_round.states
            for k in range(others):
                process = lane[indices[k]]
                started = clock()
                outcome = process.after_lane_round(states[k])
                process.cpu_time_s += (clock() - started) * cpu_per_wall
                if outcome != "waiting":
                    self._after(process, outcome)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


class BatchDriver:
    """Runs `engine.step()` once no worker holds the batch back (see `Worker.holds_batch`):
    the preds of every process a batch released land together in the next batch, and guests
    that only compute never delay one. It runs on a thread of its own, or, with
    `own_thread=False`, inside `Runtime.wait` on the caller's thread, which then also runs
    the rounds of workers without a thread (measured: a forward pass on the 50M CPU model took
    22.7 ms on the main thread and 26-30 ms on any other; and no thread hand-off per batch)."""

    def __init__(self, engine: Engine, own_thread: bool = True):
        self.engine = engine
        self.workers: list[Worker] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.driving_thread: int | None = None  # the ident of the thread running batches (Worker.wake)
        self.thread = threading.Thread(target=self.run, name="symphony-batch-driver", daemon=True) \
            if own_thread else None

    def round_done(self) -> None:
        with self._cond:
            self._cond.notify()

    def _ready_to_step(self) -> bool:
        return bool(len(self.engine.scheduler)) and not any(w.holds_batch for w in self.workers)

    def run(self, until=lambda: False) -> None:
        """Run batches (and the rounds of thread-less workers) on this thread until `stop()`
        or `until()` is true. On the main thread, Ctrl-C is raised between rounds: raised
        inside a guest's host call (a ctypes callback), it left wasmtime without the call's
        answer, and wasmtime aborted the process ("callback must be set")."""
        here = [worker for worker in self.workers if worker.thread is None]
        interrupted: list[int] = []

        def defer(signum, frame) -> None:
            if interrupted:  # a second Ctrl-C while the first waits: at once, as Python would
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            interrupted.append(signum)

        deferring = (threading.current_thread() is threading.main_thread()
                     and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if deferring:
            signal.signal(signal.SIGINT, defer)
        try:
            self.driving_thread = threading.get_ident()
            while True:
                if interrupted:
                    raise KeyboardInterrupt
                ran = False
                for worker in here:
                    ran = worker.run_ready() or ran
                with self._cond:
                    if self._stopping or until():
                        return
                    if not self._ready_to_step():
                        if not ran and not any(worker.has_ready for worker in here):
                            self._cond.wait(timeout=0.05)
                        continue
                self._step(here, lambda: bool(interrupted) or self._stopping or until())
        finally:
            self.driving_thread = None
            if deferring and signal.getsignal(signal.SIGINT) is defer:  # not one installed meanwhile
                signal.signal(signal.SIGINT, signal.default_int_handler)
            if interrupted and sys.exc_info()[0] is None:  # it came in the last round or batch
                raise KeyboardInterrupt

    def _step(self, here: list[Worker], done: Callable[[], bool]) -> None:
        """One batch. Then, while the processes it woke all wait in the decode lane with their
        next steps queued already (engine/speculation.py), the next batch is launched before
        their round, and the round runs while the device computes it (on a device that runs
        asynchronously: the host's work between passes hidden behind the device's), until
        `done()`."""
        engine = self.engine
        launched = engine.launch()
        while launched is not None:
            try:
                self._await_rounds(here)  # (none at first: the batch was launched with every round done)
            finally:  # (a batch launched is completed, whatever a round raised: a second Ctrl-C)
                engine.complete(launched)
            for worker in self.workers:
                worker.kick()
            if not len(engine.scheduler) or not all(worker.lane_only for worker in self.workers) or done():
                return
            launched = engine.launch()

    def _await_rounds(self, here: list[Worker]) -> None:
        """Run the rounds of thread-less workers here, and wait for the others' to end: the rounds
        the next batch waits for (not those of guests that only compute)."""
        for worker in self.workers:
            worker.kick()  # (launching may have answered preds: those it refused)
        for worker in here:
            while worker.holds_batch and worker.run_ready():
                pass
            if worker.has_ready:  # guests that only compute: a slice each while the device works
                worker.run_ready()
        with self._cond:
            while not self._stopping and any(worker.holds_batch for worker in self.workers if worker.thread is not None):
                self._cond.wait(timeout=0.05)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


def _handler(name: str, blocking: bool):
    method = getattr(CoreCalls, name)
    failed = wasi_failure if name in WASI_CALLS else int  # a WASI function answers a WASI errno

    def handle(call, args):
        process: Process = call.fiber.owner
        memory = process.memory if process.memory is not None else process.memory_for(call)  # (no call, mostly)
        outcome = process.syscalls.dispatch(name, failed, method, process.abi, memory, *args)
        if outcome.__class__ is Wait:
            return process.block_on(outcome, call)
        return Ready((outcome,)) if blocking else (outcome,)

    return handle


class Runtime:
    """Runs LIP processes over an `Engine`: `load` programs, `spawn` processes, `wait` for them."""

    def __init__(self, engine: Engine, workers: int = 1, limits: ProcessLimits = ProcessLimits(),
                 drive_in_caller: bool = False, tools: ToolRegistry | None = None):
        self.engine = engine
        self.limits = limits
        self.tools = tools if tools is not None else default_tools()  # the operator's tools
        self.timers = Timers()  # sleeping guests' deadlines
        self.wasm_engine = make_async_engine(epoch_interruption=True, max_wasm_stack_bytes=limits.wasm_stack_bytes,
                                             consume_fuel=limits.fuel is not None)
        self.linker = AsyncLinker(self.wasm_engine)
        self.linker.define_wasi()
        i32 = wasmtime.ValType.i32()
        self.linker.linker.allow_shadowing = True
        for module, table in (("wasi_snapshot_preview1", CoreCalls.wasi_table()),  # ours instead of wasmtime's
                              ("symphony", CoreCalls.table())):
            for name, arity in table.items():
                blocking = name in BLOCKING_CALLS
                define = self.linker.define_async if blocking else self.linker.define_func
                define(module, name, [i32] * arity, [i32], _handler(name, blocking))
            self.linker.linker.allow_shadowing = False
        # drive_in_caller: batches and process rounds run inside wait() on the caller's thread
        # (one waiter only: `symphony run`), instead of on threads of their own.
        self.driver = BatchDriver(engine, own_thread=not drive_in_caller)
        self.workers = [Worker(i, self.driver, threaded=not drive_in_caller) for i in range(workers)]
        self.driver.workers = self.workers
        self.processes: dict[int, Process] = {}
        self._ticker = EpochTicker(self.wasm_engine, EPOCH_INTERVAL_S)
        # Started with the first process that has a wall-time limit: a thread taking the GIL ten
        # times a second costs the thread running guests its share of waiting (see EpochTicker).
        self._watchdog = Watchdog(lambda: self.processes.values())
        self._watchdog_started = False
        self._watchdog_lock = threading.Lock()
        self._started = False
        self._closed = False  # its threads run once: a closed runtime cannot start again
        self._next_worker = 0
        self.component_linker: ComponentLinker | None = None

    def start(self) -> "Runtime":
        if self._closed:
            raise RuntimeError("this Runtime was closed; make a new one to run more processes")
        if not self._started:
            self._started = True
            tune_gc(collect_all=self.driver.thread is not None)  # one-thread: `symphony run`
            self._ticker.start()
            for worker in self.workers:
                if worker.thread is not None:
                    worker.thread.start()
            if self.driver.thread is not None:
                self.driver.thread.start()
        return self

    def close(self) -> None:
        """Kill what still runs and stop the threads; the runtime cannot start again."""
        self._closed = True
        processes = list(self.processes.values())
        for process in processes:
            process.kill("runtime shut down")
        if self.driver.thread is None and self._started:  # nobody else runs them: end them here
            deadline = time.monotonic() + 5
            self.driver.run(until=lambda: all(p.ended.is_set() for p in processes) or time.monotonic() > deadline)
        for process in processes:
            process.ended.wait(timeout=5)
        if self._started:
            for worker in self.workers:
                worker.stop()
            self.driver.stop()
            for worker in self.workers:
                if worker.thread is not None:
                    worker.thread.join()
            if self.driver.thread is not None:
                self.driver.thread.join()
            self._ticker.stop()
            if self._watchdog_started:
                self._watchdog.stop()
            self.timers.stop()
            self._started = False
            untune_gc()

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def load(self, source: str | Path | bytes, name: str = "program", compile_time_s: float | None = None) -> Program:
        """Validate and compile a program from a path or bytes (raises ProgramError).
        `compile_time_s`: refuse a module whose compilation takes longer (untrusted bytes)."""
        if isinstance(source, (bytes, bytearray)):
            return load_program(self.wasm_engine, bytes(source), name, compile_time_s=compile_time_s)
        return load_program_file(self.wasm_engine, source)

    def spawn(self, program: Program, args: list[str] = (), env: dict[str, str] | None = None,
              tenant: str = "default", on_output=None, on_log=None, on_exit=None,
              limits: ProcessLimits | None = None) -> Process:
        """Start a process of `program`; it runs on one of the workers, under `limits` (default:
        the runtime's; fuel can be given per process only if the runtime's limits set it)."""
        limits = limits or self.limits
        if (limits.fuel is None) != (self.limits.fuel is None) or limits.wasm_stack_bytes != self.limits.wasm_stack_bytes:
            raise ValueError("fuel on/off and wasm_stack_bytes are the runtime's: set them in Runtime(limits=...)")
        self.start()
        if limits.wall_time_s is not None and not self._watchdog_started:
            with self._watchdog_lock:  # (spawn may be called from any thread)
                if not self._watchdog_started:
                    self._watchdog_started = True
                    self._watchdog.start()
        session = self.engine.kvfs.session(tenant, max_handles=limits.kv_handles)
        kind, linker = (ComponentProcess, self._component_linker()) if program.is_component else (Process, self.linker)
        process = kind(program, list(args), dict(env or {}), self.engine, session, linker, limits,
                       on_output=on_output, on_log=on_log, on_exit=on_exit, tools=self.tools, timers=self.timers)
        self.processes[process.pid] = process
        worker = min(self.workers, key=lambda w: len(w.processes))
        worker.add(process)
        return process

    def _component_linker(self) -> ComponentLinker:
        """The linker for component programs (Python LIPs), made when the first one spawns."""
        if self.component_linker is None:
            self.component_linker = component_linker(self.wasm_engine)
        return self.component_linker

    def kill(self, pid: int, reason: str = "killed") -> None:
        self.processes[pid].kill(reason)

    def wait(self, process: Process, timeout_s: float | None = None) -> int | None:
        """Wait for the process to end; its exit code (None on timeout)."""
        if self.driver.thread is None and self._started:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            self.driver.run(until=lambda: process.ended.is_set()
                            or (deadline is not None and time.monotonic() > deadline))
        if not process.ended.wait(0 if self.driver.thread is None else timeout_s):
            return None
        self.processes.pop(process.pid, None)
        return process.exit_code
