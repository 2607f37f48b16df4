"""A LIP process: one wasmtime Store and instance, its KV handle table, its I/O, and the fiber
its guest code runs on. A process is advanced only by the worker thread that owns it."""
from __future__ import annotations

import enum
import itertools
import logging
import math
import threading
import time
from collections import deque
from typing import Callable

import wasmtime

from ..errors import ErrorCode, InputClosed, LimitExceeded, SymphonyError
from ..wasm.fiber import AsyncLinker, FastCalls, Fiber, HostCall, instance_export, set_time_slice
from ..wasm.guest_memory import GuestMemory, memory_locator
from ..wasm.program import Program
from ..engine.sampling import GREEDY, Sample
from ..engine.scheduler import PredRequest
from .core_abi import CoreCalls, pred_fast_shape, pred_submit_fast_shape, pred_wait_fast_shape
from .limits import ProcessLimits, Usage, store_limits, trap_reason
from .syscalls import SystemCalls, Wait
from .timers import Timers
from .tools import ToolRegistry

log = logging.getLogger("symphony.process")

EXIT_TRAPPED = 134  # like a process killed by SIGABRT
EXIT_KILLED = 137  # like a process killed by SIGKILL
# Messages delivered and not yet taken by `recv`: past either bound `deliver` refuses more, so a
# client cannot grow the server's memory faster than the LIP reads.
INBOX_BYTES = 16 * 2**20
INBOX_MESSAGES = 4096


class ProcessState(str, enum.Enum):
    RUNNABLE = "runnable"
    BLOCKED_ON_PRED = "blocked-on-pred"
    BLOCKED_ON_RECV = "blocked-on-recv"
    BLOCKED_ON_SLEEP = "blocked-on-sleep"  # WASI poll_oneoff on a clock
    BLOCKED_ON_TOKENIZE = "blocked-on-tokenize"  # a long text, on the engine's tokenizer thread
    EXITED = "exited"
    KILLED = "killed"


_STATE_OF = {state.value: state for state in ProcessState}  # faster than ProcessState(value)
_RUNNABLE = ProcessState.RUNNABLE  # a module global: an enum member's attribute lookup costs more
_NO_LIMIT_NS = 2**62  # a decode lane's CPU time, with no CPU-time limit
_NO_LIMIT_TOKENS = 2**62  # a decode lane's tokens, with no KV page limit
_pids = itertools.count(1)


class Process:
    """Create with `Runtime.spawn`. `on_output(bytes)` receives what the LIP sends; `on_log(str)`
    its stdout/stderr (kept in `log` only when there is no `on_log`: the caller keeps what it
    needs); `on_exit(process)` runs once when it ends (on its worker's thread)."""

    # Slots: a round touches every process's fields; no per-process dict to fetch (and a
    # misspelt attribute fails at once).
    __slots__ = ("pid", "program", "args", "engine", "kv", "tools", "timers", "limits", "state", "exit_code",
                 "end_reason", "log", "_on_output", "_on_log", "_on_exit", "_inbox", "_inbox_bytes", "_inbox_lock",
                 "_input_closed", "_kill_reason", "ended", "cpu_time_s", "usage", "syscalls", "abi", "store",
                 "_time_slice_ticks", "_fiber", "_fresh", "_instantiating", "_memory", "memory", "_blocked", "wake",
                 "_woken_by_pred", "monotonic_origin", "_cpu_time_limit", "poll_address", "_linker", "_decoding",
                 "_lane_answer", "lane_answered", "lane_unspeculated", "_lane_kv", "_lane_streak", "_speculation", "_spec_backoff", "_spec_skip",
                 "__weakref__")
    POLLS_TO_RESUME = 1  # polls that run the guest on after its blocking call is answered

    def __init__(self, program: Program, args: list[str], env: dict[str, str], engine, kv_session,
                 linker: AsyncLinker, limits: ProcessLimits, *, timers: Timers,
                 on_output: Callable[[bytes], None] | None = None,
                 on_log: Callable[[str], None] | None = None,
                 on_exit: Callable[["Process"], None] | None = None, tools: ToolRegistry | None = None):
        self.pid = next(_pids)
        self.program = program
        self.args = list(args)
        self.engine = engine
        self.kv = kv_session
        self.tools = tools if tools is not None else ToolRegistry()  # what the `tool` call may reach
        self.timers = timers  # what a sleep waits on: the runtime's (one thread for all its processes)
        self.limits = limits
        self.state = ProcessState.RUNNABLE
        self.exit_code: int | None = None
        self.end_reason: str | None = None
        self.log: list[str] = []
        self._on_output = on_output
        self._on_log = on_log
        self._on_exit = on_exit
        self._inbox: deque[bytes] = deque()
        self._inbox_bytes = 0
        self._inbox_lock = threading.Lock()  # deliver (any thread) and pop_input (the worker)
        self._input_closed = False
        self._kill_reason: str | None = None
        self.ended = threading.Event()
        self.cpu_time_s = 0.0  # thread CPU time spent advancing this process (guest code and host calls)
        self.usage = Usage(limits)
        # Compared on every advance; Usage.over_time (a call) runs only past it.
        self._cpu_time_limit = math.inf if limits.cpu_time_s is None else limits.cpu_time_s
        self.syscalls = SystemCalls(self)  # the calls' semantics, for either ABI
        self.abi = self._abi()  # the guest's way in: pointers (a core module) or values (a component)
        self.store = wasmtime.Store(linker.engine)
        self.store.set_wasi(self._wasi_config(program, self.args, env))
        # Where the guest's WASI monotonic clock starts (its 0 is the WASI context's creation):
        # read after it, so an absolute sleep on that clock ends late by microseconds, never early.
        self.monotonic_origin = time.monotonic()
        store_limits(self.store, limits)
        set_time_slice(self.store, limits.time_slice_ticks)
        self._time_slice_ticks = limits.time_slice_ticks  # a fresh slice when a guest resumes
        self._fiber: Fiber | None = linker.start_instantiate(self.store, program.module, owner=self)
        self.poll_address = self._fiber.slot_address  # what the worker prefetches (advance)
        self._instantiating = True
        self._fresh = True  # a fiber not polled yet: its time slice starts at its first poll
        self._memory: wasmtime.Memory | None = None  # the guest's memory, once instantiated
        self.memory: GuestMemory | None = None  # checked access to it
        self._blocked: tuple[Wait, HostCall | None] | None = None  # the call it waits in
        self._decoding: _DecodeAnswer | None = None  # or the fast decode step it waits in (_fast_pred)
        self._linker = linker
        self.wake: Callable[["Process"], None] = lambda process: None  # set by the worker
        # The decode lane's (_open_lane): where its answers put the process (the worker's list,
        # set by the worker), and the one answer object its requests reuse.
        self.lane_answered: list["Process"] = []
        self.lane_unspeculated: list["Process"] = []  # and those of them with no next step queued
        self._lane_answer = _LaneAnswer(self)
        self._lane_kv = -1  # the handle of the last fast pred_submit (_open_lane_after_wait)
        self._lane_streak = 0  # lane requests in a row since the lane last closed
        self._speculation = None  # the next step, queued by the engine before the guest asks (_LaneAnswer)
        # After a guest asked for another step than the one queued for it: answers to let go by
        # before the next try (_spec_skip), doubling with each miss in a row up to 64 (a guest
        # that does not feed its tokens back, forcing or scoring text, costs one wasted step a try).
        self._spec_backoff = self._spec_skip = 0
        self._woken_by_pred = self._pred_done  # one bound method, not one per pred

    # ---- I/O, callable from any thread ----

    def emit_output(self, data: bytes) -> None:
        self._charge_output(len(data))
        if self._on_output is not None:
            self._on_output(data)

    def capture_log(self, data: bytes) -> None:
        self._charge_output(len(data))
        text = data.decode("utf-8", "replace")
        if self._on_log is not None:
            self._on_log(text)
        else:
            self.log.append(text)

    def deliver(self, message: bytes) -> None:
        """A message from the user, for the LIP's next `recv`. Raises InputClosed once the
        input was closed or the process ended, LimitExceeded while its unread messages fill
        the inbox (INBOX_BYTES, INBOX_MESSAGES)."""
        if self._input_closed or self.ended.is_set():
            raise InputClosed(f"process {self.pid} {'has ended' if self.ended.is_set() else 'had its input closed'}: "
                              "it takes no more messages")
        with self._inbox_lock:
            if len(self._inbox) >= INBOX_MESSAGES or self._inbox_bytes + len(message) > INBOX_BYTES:
                raise LimitExceeded(f"process {self.pid} has {len(self._inbox)} unread messages "
                                    f"({self._inbox_bytes} bytes; at most {INBOX_MESSAGES} and {INBOX_BYTES} bytes): "
                                    "wait for its output before sending more")
            self._inbox.append(bytes(message))
            self._inbox_bytes += len(message)
        self._wake_if(ProcessState.BLOCKED_ON_RECV)

    def close_input(self) -> None:
        """No more messages: a pending or later `recv` returns `closed`."""
        self._input_closed = True
        self._wake_if(ProcessState.BLOCKED_ON_RECV)

    def kill(self, reason: str = "killed") -> None:
        """End the process at its next scheduling point (even inside a blocking call)."""
        if self._kill_reason is None:
            self._kill_reason = reason
        fiber = self._fiber
        if fiber is not None:
            fiber.lane_close()  # (a guest in the lane is resumed by C: it must come this way)
        self.wake(self)

    def _charge_output(self, nbytes: int) -> None:
        """Output and log count against `output_bytes`: past it the process is killed and the
        bytes refused (the server keeps unread frames, so this also bounds its memory)."""
        reason = self.usage.charge_output(nbytes)
        if reason is not None:
            self.kill(reason)
            raise LimitExceeded(reason)

    def _wake_if(self, state: ProcessState) -> None:
        if self.state == state:
            self.wake(self)

    def input_ready(self) -> bool:
        return bool(self._inbox) or self._input_closed

    def peek_input(self) -> bytes | None:
        return self._inbox[0] if self._inbox else None

    def pop_input(self) -> None:
        with self._inbox_lock:
            self._inbox_bytes -= len(self._inbox.popleft())

    # ---- used by the host calls while the guest runs ----

    def memory_for(self, call: HostCall) -> GuestMemory:
        """Checked access to the calling guest's memory: the process's own view once it is
        instantiated, through the caller before (a start function's host calls)."""
        if self.memory is None:
            return GuestMemory(call.memory_location)
        return self.memory

    def block_on(self, wait: Wait, call: HostCall | None) -> Wait:
        """Suspend the guest until `wait` is over (the fiber waits on it); the worker
        completes the call later."""
        self._blocked = (wait, call)
        self.state = _STATE_OF[wait.state]
        if wait.future is not None:
            wait.future.add_done_callback(self._woken_by_pred)
        elif self.input_ready():
            self.wake(self)
        return wait

    def finish_block(self, wait: Wait, call: HostCall | None):
        """The result of a call whose wait is over: its value as the ABI encodes it, or, if
        that raises, `wait.failed` of the error's code (an unexpected exception is logged,
        INTERNAL)."""
        try:
            value = wait.then(*wait.args)
            encode = wait.encode
            if encode is None:
                return value
            return encode(self.memory if self.memory is not None else self.memory_for(call), value)
        except SymphonyError as error:
            return wait.failed(self.syscalls.error_code(error))
        except Exception:
            log.exception("pid %s: finishing a blocking call failed", self.pid)
            return wait.failed(ErrorCode.INTERNAL)

    def _pred_done(self, _future) -> None:
        self.wake(self)

    # ---- driven by the owning worker ----

    @property
    def cpu_seconds(self) -> float:
        """`cpu_time_s` with what the decode lane charged since it was last taken back."""
        fiber = self._fiber
        return self.cpu_time_s + (fiber.lane_cpu_ns * 1e-9 if fiber is not None else 0.0)

    @property
    def finished(self) -> bool:
        return self.exit_code is not None  # set with the state, by _end only

    def advance(self, prefetch: int | None = None) -> str:
        """Run the guest until it blocks, yields or ends. Returns "waiting" (blocked, or not
        ready yet), "preempted" (its time slice ended: still runnable), "continue" (it will
        run on at once: instantiation done) or "ended". The worker adds the CPU time it took
        to `cpu_time_s`; past its limit the process ends here (past its wall time, the
        watchdog kills it: limits.Watchdog). `prefetch`: the `poll_address` of the process
        the worker advances next (`Fiber.poll`)."""
        try:  # the body inline (no call): it runs for every process in every round
            if self.exit_code is not None:  # finished
                return "ended"
            if self._kill_reason is None and self.cpu_time_s > self._cpu_time_limit:
                self._kill_reason = self.usage.over_time(self.cpu_time_s)
            if self._kill_reason is not None:
                self._end(ProcessState.KILLED, EXIT_KILLED, self._kill_reason)
                return "ended"
            resumed, ticks = False, 0
            decoding = self._decoding
            if decoding is not None:  # a fast decode step (_fast_pred): its answer is in the fiber's slot
                if not decoding.done:
                    return "waiting"
                self._decoding = None
                if decoding.ticket:  # its pred_wait ends the ticket (on the worker: the tickets are its)
                    self.syscalls.tickets.pop(decoding.ticket, None)
                self.state = _RUNNABLE
                resumed, ticks = True, self._time_slice_ticks
            elif self._blocked is not None:
                wait, call = self._blocked
                if not (wait.future.done() if wait.future is not None else self.input_ready()):
                    return "waiting"
                self._blocked = None
                wait.complete((self.finish_block(wait, call),))
                self.state = _RUNNABLE
                resumed, ticks = True, self._time_slice_ticks  # its old deadline passed while it waited
            fiber = self._fiber
            if self._fresh:  # the slice set at spawn (or by the instantiation) ran out in the rounds since
                self._fresh = False
                ticks = self._time_slice_ticks
            finished = fiber.poll(ticks, prefetch)  # True at once for a fiber that is done
            if not finished and resumed and self._blocked is None and self.POLLS_TO_RESUME == 2:
                # A component's first poll after a blocking call only finishes that call (measured);
                # the second runs the guest on. A core module's first poll runs on at once (a
                # second would give it two time slices while the next batch waits for it).
                finished = fiber.poll()
            return self._after_poll(fiber, finished)
        except Exception as error:  # a host bug this guest reached: it ends, the worker goes on
            return self._internal_error(error)

    def after_lane_round(self, state: int) -> str:
        """`advance` for a process in a decode-lane round (runtime.Worker): `state` is the
        answer of the poll C made (fiber.LaneRound), or -1 when it made none."""
        fiber = self._fiber
        if state == -1:  # its lane closed (a kill, its CPU time): the ordinary way
            if fiber is not None and fiber.lane_state:
                self._lane_fold()
            return self.advance()
        try:
            self._decoding = None  # its request was answered and the guest ran on
            self.state = _RUNNABLE
            return self._after_poll(fiber, fiber.after_lane_round(state))
        except Exception as error:
            return self._internal_error(error)

    def _after_poll(self, fiber: Fiber, finished: bool) -> str:
        """advance()'s outcome once the guest was polled."""
        if not finished:
            if self._blocked is not None or self._decoding is not None:
                return "waiting"
            if fiber.lane_waiting:  # a decode step C took (the lane): to the engine
                self._lane_submit()
                return "waiting"
            if fiber.lane_state:  # a pred_submit C answered must not wait for the guest's next slice
                self._lane_fold()
            # Out of its time slice (instantiation too: a start function that computes holds no
            # batch back, or every process's preds waited for it to end).
            return "preempted"
        try:
            if self._kill_reason is not None:  # asked for while it ran (past its output limit, say)
                self._end(ProcessState.KILLED, EXIT_KILLED, self._kill_reason)
            elif fiber.exit_code is not None:
                self._end(ProcessState.EXITED, fiber.exit_code, f"exit {fiber.exit_code}")
            elif fiber.trap is not None:
                memory_bytes = self._memory.data_len(self.store) if self._memory is not None else None
                reason = trap_reason(fiber, self.limits, memory_bytes, self._instantiating)
                self._end(ProcessState.KILLED, EXIT_KILLED if reason.startswith("killed:") else EXIT_TRAPPED, reason)
            elif self._instantiating:
                self._instantiating = False
                self._fiber = self._main_fiber(fiber.result[0])
                self.poll_address = self._fiber.slot_address
                # What every call touches, fetched while the worker polls the process before
                # (measured, null rounds at 1024 processes: 0.935 of the time without; 16
                # and 256 unchanged).
                self._fiber.prefetch_with((self, self.syscalls, self.abi, self.usage, self.memory, self.kv))
                self._fresh = True
                return "continue"
            else:
                code = int(fiber.result[0]) if fiber.result else 0  # a component's run() returns it
                self._end(ProcessState.EXITED, code, f"exit {code}")
            return "ended"
        except Exception as error:
            return self._internal_error(error)

    def _internal_error(self, error: Exception) -> str:
        """A host bug this guest reached: it ends, the worker goes on."""
        log.exception("pid %s: internal error while advancing", self.pid)
        if not self.finished:
            self._end(ProcessState.KILLED, EXIT_TRAPPED, f"internal error: {type(error).__name__}: {error}")
        return "ended"

    def _wasi_config(self, program: Program, args: list[str], env: dict[str, str]) -> wasmtime.WasiConfig:
        wasi = wasmtime.WasiConfig()
        wasi.argv = [program.name, *args]
        wasi.env = list(env.items())
        # stdout/stderr reach the log through our own fd_write (core_abi.CoreCalls.fd_write).
        return wasi

    def _abi(self) -> CoreCalls:
        """The adapter between the guest and `syscalls`: a core module's (ComponentProcess has
        its own)."""
        return CoreCalls(self.syscalls)

    def _main_fiber(self, instance: wasmtime.Instance) -> Fiber:
        """The call that runs the program once instantiated: WASI's `_start`."""
        self._memory = instance_export(self.store, instance, b"memory")
        self.memory = GuestMemory(memory_locator(self.store, self._memory))
        fiber = Fiber.of_command(self.store, instance_export(self.store, instance, b"_start"), owner=self)
        linker, vocab = self._linker, self.engine.loaded.config.vocab_size
        calls = linker.fast_calls.get(("decode", vocab))
        if calls is None:  # made once per linker and vocabulary: the shapes of a decode step
            shapes = [pred_fast_shape(vocab), pred_submit_fast_shape(vocab), pred_wait_fast_shape()]
            calls = linker.fast_calls[("decode", vocab)] = FastCalls(
                linker, [shape for shape in shapes if ("symphony", shape.name) in linker.keys])
        if len(calls.functions) == 3:
            fiber.set_fast_calls(calls, self._memory, (self._fast_pred, self._fast_pred_submit, self._fast_pred_wait))
            fiber.set_lane(0, 1, 2, self._lane_fold)
        return fiber

    def _fast_pred(self, fiber: Fiber, args: tuple, token: int) -> bool | None:
        """A decode step in the common shape (core_abi.pred_fast_shape: one greedy sampled token
        continuing the file behind args[0], its arguments checked by fiber_native.c), queued
        without the system-call layer's decoding: ~600 Python bytecodes a token fewer. What
        that layer would check here still holds: the host-call rate is charged (its check,
        once a while, goes the ordinary way), the handle is checked by the engine, and with a
        KV page limit only a token that fits in the file's own last page is taken (so no page
        is added). None sends the call the ordinary way: a file the prefix cache tracks, a new
        page under the limit, the rate check due."""
        kv, calls, usage = args[0], self.syscalls, self.usage
        if kv in calls.prefix_files or usage.hostcalls + 1 >= usage.check_at:
            return None
        if self.limits.kv_pages is not None and not self._fits_last_page(kv):
            return None
        usage.hostcalls += 1  # Usage.charge_hostcall, short of its check (above)
        answer = _DecodeAnswer(self)
        try:
            self.engine.submit_decode(self.kv, kv, token, answer)
        except SymphonyError as error:  # a bad or read-only handle: answered now, as `pred` would
            fiber.answer_fast_call(int(calls.error_code(error)))
            return True
        self._decoding = answer
        self.state = ProcessState.BLOCKED_ON_PRED
        self._open_lane(kv, len(calls.tickets), True)
        return False

    def _fast_pred_submit(self, fiber: Fiber, args: tuple, token: int) -> int | None:
        """`pred_submit` of a decode step in the common shape (core_abi.pred_submit_fast_shape):
        its ticket, as SystemCalls.pred_submit gives it, with the same checks as _fast_pred and
        the in-flight limit; None sends it the ordinary way."""
        kv, calls, usage = args[0], self.syscalls, self.usage
        if (kv in calls.prefix_files or usage.hostcalls + 1 >= usage.check_at
                or len(calls.tickets) >= self.limits.preds_in_flight):
            return None
        if self.limits.kv_pages is not None and not self._fits_last_page(kv):
            return None
        usage.hostcalls += 1
        try:
            request = self.engine.submit_decode(self.kv, kv, token)
        except SymphonyError as error:
            return int(calls.error_code(error))
        ticket = calls._next_ticket
        calls._next_ticket = ticket + 1
        calls.tickets[ticket] = request
        self._lane_kv = kv  # where the lane may open once the guest waits for it
        return ticket

    def _fast_pred_wait(self, fiber: Fiber, args: tuple, _value: int) -> bool | None:
        """`pred_wait` on a ticket whose answer is a sampled token (core_abi.pred_wait_fast_shape:
        its buffer checked): answered now if its batch ran, else once it does, straight into
        the fiber's slot. The ticket ends as SystemCalls.pred_wait ends it (on an error too).
        None (an unknown ticket, another kind of answer, log-probabilities to write, the rate
        check due): the ordinary way."""
        ticket, calls, usage = args[0], self.syscalls, self.usage
        request = calls.tickets.get(ticket)
        if (request is None or request.want.__class__ is not Sample or request.want.logprobs
                or usage.hostcalls + 1 >= usage.check_at):
            return None
        usage.hostcalls += 1
        future = request.future
        if future.done():
            del calls.tickets[ticket]
            fiber.answer_fast_call(_answer_value(self, *future.outcome()))
            self._open_lane_after_wait(request, len(calls.tickets))
            return True
        answer = _DecodeAnswer(self, ticket)
        self._decoding = answer
        self.state = ProcessState.BLOCKED_ON_PRED
        future.add_done_callback(answer.settled)
        self._open_lane_after_wait(request, len(calls.tickets) - 1)
        return False

    # ---- the decode lane: decode steps answered in C (fiber_native.c), no Python a token ----

    def _open_lane(self, kv: int, in_flight: int, queued: bool) -> None:
        """Let C take the guest's next decode steps on `kv`, a handle a fast pred just used
        (writable, its own): pred_submit's tickets, pred_wait on them, blocking preds. It
        stays open while the guest makes only those calls, and no longer than the checks made
        here allow: the host-call rate's next check, the CPU time left, and under a KV page
        limit the room left in the file's own last page (`queued`: a pred on it is queued and
        not yet in the file), so that no step adds a page. `in_flight`: the tickets that stay
        in flight meanwhile (the lane adds one at most). Not on a file the prefix cache tracks."""
        limits, usage = self.limits, self.usage
        budget = usage.check_at - usage.hostcalls - 1
        if (budget < 2 or in_flight >= limits.preds_in_flight or kv in self.syscalls.prefix_files
                or self._kill_reason is not None):
            return
        room = _NO_LIMIT_TOKENS
        if limits.kv_pages is not None:
            room = self._last_page_room(kv, queued) if in_flight == 0 else 0
            if room < 1:
                return
        left_s = self._cpu_time_limit - self.cpu_time_s
        ns_limit = _NO_LIMIT_NS if left_s > _NO_LIMIT_NS * 1e-9 else max(0, int(left_s * 1e9))
        self._fiber.lane_open(kv, budget, room, self.syscalls._next_ticket, ns_limit, self._time_slice_ticks)

    def _open_lane_after_wait(self, request, in_flight: int) -> None:
        """_open_lane once the guest waits for a fast pred_submit's ticket: on that pred's handle,
        if it still names that file, writable (a call since may have closed it)."""
        kv = self._lane_kv
        try:
            if kv < 0 or self.kv.file_of(kv, write=True) is not request.file:
                return
        except SymphonyError:
            return
        self._open_lane(kv, in_flight, not request.future.done())

    def _last_page_room(self, kv: int, queued: bool) -> int:
        """Tokens the file behind `kv` takes in its own resident last page (none: a page shared,
        swapped out or full), after the one pred `queued` on it."""
        try:
            file = self.kv.file_of(kv)
        except SymphonyError:
            return 0
        pool = self.engine.pool
        if file.host_pages or not file.pages or pool.refcount[file.pages[-1]] != 1:
            return 0
        used = (file.length + queued) % pool.page_size
        return 0 if used == 0 else pool.page_size - used

    def _lane_fold(self) -> None:
        """Take back what the lane counted (Fiber.lane_take): its host calls, its ticket counter,
        the CPU time it charged, and a pred_submit it answered that nobody queued yet, queued now
        under its ticket (as the ordinary way queues it at once: it runs even if the process
        ends). Runs before the host handles any call that closed the lane, and wherever the host
        takes the process back. Never raises."""
        fiber = self._fiber
        self._lane_streak = 0
        if self._speculation is not None:  # the guest did not ask for it
            self.engine.abandon(self._speculation)
            self._speculation = None
        calls_made, ticket, ns, pending, pending_ticket, token = fiber.lane_take()
        self.usage.hostcalls += calls_made
        self.cpu_time_s += ns * 1e-9
        calls = self.syscalls
        if ticket > calls._next_ticket:
            calls._next_ticket = ticket
        if pending == 1:
            try:
                request = self.engine.submit_decode(self.kv, fiber.lane_request()[0], token)
            except Exception as error:  # (the handle was good when the lane opened, and no call came since)
                request = PredRequest(None, [token], None, GREEDY)
                request.future.set_exception(error)
            calls.tickets[pending_ticket] = request

    def _lane_submit(self) -> None:
        """The guest waits in a lane call (its poll said so): its request to the engine."""
        kv, token = self._fiber.lane_request()
        self._decoding = self._lane_answer
        self.state = ProcessState.BLOCKED_ON_PRED
        self._queue_lane_step(kv, token)

    def _queue_lane_step(self, kv: int, token: int) -> None:
        """A lane request to the engine, answered through the process's _LaneAnswer: the step the
        engine queued for it already, if it is this one (adopted), else submitted now. A
        refusal, or a host error, answers this process's step alone (_lane_refused)."""
        answer = self._lane_answer
        answer.done = False
        self._lane_streak += 1
        engine = self.engine
        speculation = self._speculation
        try:
            if speculation is not None:
                self._speculation = None
                if speculation.request.tokens[0] == token and engine.adopt(speculation, answer):
                    answer.request = speculation.request
                    self._spec_backoff = 0
                    return
                self._speculation_missed(speculation)
            answer.request = engine.submit_decode(self.kv, kv, token, answer)
        except Exception as error:
            self._lane_refused(error)

    def _speculation_missed(self, speculation) -> None:
        """The guest asked for another step than the one the engine queued for it: that one
        dropped, and the next try put off (see _spec_backoff)."""
        self.engine.abandon(speculation)
        self._spec_backoff = self._spec_skip = min(64, 2 * self._spec_backoff or 1)

    def _lane_refused(self, error: Exception) -> None:
        """A lane request the engine refused: answered now with the error's code, as pred would
        (INTERNAL, logged, for a host bug), and the lane closed (the ordinary way looks at the
        next call)."""
        fiber = self._fiber
        fiber.lane_close()
        fiber.answer_fast_call(_answer_value(self, None, error))
        self._lane_answer.done = True
        self.wake(self)

    def _fits_last_page(self, kv: int) -> bool:
        """Does one more token on the file behind `kv` fit in its own resident last page, with no
        other pred of this process in flight (so no page is added: check_kv_pages would pass)?"""
        if self.syscalls.tickets:
            return False
        try:
            file = self.kv.file_of(kv)
        except SymphonyError:
            return False
        pool = self.engine.pool
        return (file.length % pool.page_size != 0 and not file.host_pages and bool(file.pages)
                and pool.refcount[file.pages[-1]] == 1)

    def _end(self, state: ProcessState, code: int, reason: str) -> None:
        if self._fiber is not None:
            if self._fiber.lane_state:
                self._lane_fold()  # its CPU time, and a pred_submit C answered
            self._fiber.close()
        if self._speculation is not None:
            self.engine.abandon(self._speculation)
            self._speculation = None
        if self._blocked is not None and self._blocked[0].cancel is not None:
            self._blocked[0].cancel()  # a sleep's timer, say
        self._blocked = None
        self._decoding = None
        with self._inbox_lock:
            self._inbox.clear()
            self._inbox_bytes = 0
        self.engine.drop_queued(self.kv)  # preds no batch started: their pages go now, not after one
        self.kv.close_all()
        self.syscalls.tickets.clear()
        self.state, self.exit_code, self.end_reason = state, code, reason
        self.ended.set()
        if self._on_exit is not None:
            self._on_exit(self)


def _answer_value(process: Process, result, error: BaseException | None) -> int:
    """What `pred` or `pred_wait` of a sampled token returns: the token, or the error's code."""
    if error is None:
        return result.token
    if isinstance(error, SymphonyError):
        return int(process.syscalls.error_code(error))
    # A host bug (a failed forward, say): logged, as finish_block logs it.
    log.error("pid %s: a decode step failed: %s: %s", process.pid, type(error).__name__, error)
    return int(ErrorCode.INTERNAL)


def submit_lane_requests(processes: list["Process"], lane, asked: int) -> None:
    """The requests a decode-lane round made (fiber.LaneRound: `lane.requests[:asked]` index
    `processes`), to the engine: each guest waits in its call (its `_decoding` is its
    _LaneAnswer still: it never left its lane). The one loop a lane round runs in Python."""
    requests, kvs, tokens = lane.requests, lane.kvs, lane.tokens
    for k in range(asked):
        processes[requests[k]]._queue_lane_step(kvs[k], tokens[k])


class _DecodeAnswer:
    """How a fast decode step's answer reaches its guest (Process._fast_pred, _fast_pred_wait):
    the engine settles it in place of a PredFuture (or a ticket's future calls `settled`), the
    value goes straight into the fiber's slot, and the process is woken. Runs on the engine's
    thread. `ticket`: the pred_wait's ticket, ended when the process resumes (0: none)."""

    __slots__ = ("process", "ticket", "done")

    def __init__(self, process: Process, ticket: int = 0):
        self.process = process
        self.ticket = ticket
        self.done = False

    def settle(self, result, error: BaseException | None) -> None:
        process = self.process
        process._fiber.answer_fast_call(_answer_value(process, result, error))
        self.done = True  # after the answer: the worker polls the guest once it sees this
        process.wake(process)

    def settled(self, future) -> None:
        self.settle(*future.outcome())


class _LaneAnswer(_DecodeAnswer):
    """A decode-lane request's answer (Process._lane_submit): the value into the fiber's slot, and
    the process onto its worker's list of answered lane processes, resumed by C in the worker's
    next round (runtime.Worker). Reused for each of the process's requests; runs on the thread
    that drives batches, the only one that touches that list."""

    __slots__ = ("request",)

    def __init__(self, process: Process):
        super().__init__(process)
        self.request = None  # the pred it answers (its file: the next speculation's)

    def settle(self, result, error: BaseException | None) -> None:
        """The answer into the slot, the process onto its worker's list; and, while the guest
        keeps to its lane on an engine whose passes run asynchronously, the step it will most
        likely ask for next (feeding the token back) queued at once (engine/speculation.py): the
        next batch need not wait for its round."""
        process = self.process
        fiber = process._fiber
        fiber.answer_fast_call(_answer_value(process, result, error))
        self.done = True
        engine = process.engine
        if engine.runs_async:  # (else nothing overlaps a pass: no step is worth queueing early)
            if error is None and process._lane_streak >= 2 and fiber.lane_state == 1 and process._speculation is None:
                if process._spec_skip:
                    process._spec_skip -= 1
                else:
                    process._speculation = engine.speculate(self.request.file, result.token)
            if process._speculation is None:
                process.lane_unspeculated.append(process)
        process.lane_answered.append(process)
