"""Guest calls as native wasmtime fibers, many of them polled from one Python thread.

wasmtime runs each async call on its own fiber stack. When the guest calls a host function
that cannot answer yet, the handler returns `Pending`; wasmtime suspends that guest and
`Fiber.poll()` returns False, so a scheduler can go on to poll other guests. Once some other
code calls `pending.complete(values)`, the next poll resumes the guest with those values. With
`set_time_slice` a guest that computes for a whole epoch slice also yields, so one busy guest
cannot starve the others on its thread.

This is the only module that touches wasmtime's async C API for core modules (component.py
does the same for components, with these Fibers); wasmtime-py 50 reaches it only through its
ctypes layer (`wasmtime._ffi`). The C API's rules, and what breaking them did:
- Everything a future was created from (store, Func, argument and result arrays, trap and
  error slots, linker, module) must stay alive and unchanged until the future is deleted:
  freeing a Func mid-call aborted the process with a Rust panic. `Fiber` holds them.
- A store may have only one call future alive at a time, and a store must be used by one
  thread at a time. `Fiber` refuses a second call on a busy store.
- An exception must never escape a ctypes callback into wasmtime (an async callback that
  returns without a continuation panics the process). Every callback here catches everything
  and turns it into a guest trap. wasmtime-py's own callbacks park exceptions in one global
  slot shared by all threads, so none of them is used here.
- A blocking call crosses into Python not at all while the guest runs: wasmtime calls C
  (fiber_native.c, built on first use by native_build.py), which records the call in the
  fiber's slot and suspends the guest; `Fiber.poll` then runs the handler on the polling
  thread's own stack and, once the answer is written, raises the byte the call's continuation
  reads (also C). A handler running inside the guest's call, through a ctypes callback on the
  guest's fiber stack, cost three times as much at 1024 guests (see fiber_native.c).
- A call in a shape the host named (`FastCall`, `Fiber.set_fast_calls`: a LIP's decode step) is
  recognised by C as it is recorded, and its handler gets its arguments and the one value it
  reads from guest memory already checked, with no HostCall (lip/process.py's `_fast_pred`).
- The decode lane goes further (`Fiber.set_lane`, `lane_open`, `LaneRound`): C answers a LIP's
  decode steps on one KV handle itself, and resumes a whole round of guests waiting in them in
  one call; any other call closes the lane, and the host takes back what it counted
  (`Fiber.lane_fold`) before that call is handled. Python runs nothing per guest and token
  there but the engine's queueing (lip/process.py's `submit_lane_requests`).
- The slot (`_Slot`, fiber_native.c's sym_fiber_slot, checked field by field at import) is
  all the memory the two halves share: a call's arguments are copied into it, its answer is
  written into it, and C copies that to wasmtime's own arrays; Python reads and writes no
  memory that wasmtime hands out by address.
"""
from __future__ import annotations

import array
import atexit
import ctypes
import itertools
import struct
import sys
import threading
from pathlib import Path
from typing import Callable, Sequence, Union

import wasmtime
from wasmtime import _ffi as ffi

from .native_build import load_library

Value = Union[int, float]

_KIND_OF_TYPE = {str(wasmtime.ValType.i32()): 0, str(wasmtime.ValType.i64()): 1,
                 str(wasmtime.ValType.f32()): 2, str(wasmtime.ValType.f64()): 3}

# Room on each fiber stack for the host (ctypes, the interpreter, handlers) beyond what wasm
# may use: the fiber stacks are reserved lazily, so this costs address space, not memory.
HOST_STACK_BYTES = 4 << 20
# A component's call reports a trap as an error whose message ends with the trap's own ("Caused
# by: wasm trap: call stack exhausted"), with no code: the codes the limits name, by message.
_TRAP_CODE_OF_MESSAGE = {"call stack exhausted": wasmtime.TrapCode.STACK_OVERFLOW,
                         "all fuel consumed by WebAssembly": wasmtime.TrapCode.OUT_OF_FUEL,
                         "interrupt": wasmtime.TrapCode.INTERRUPT}


def raw_prototype(name: str, restype, *argtypes):
    """A prototype of our own for a wasmtime C function (dll[...] leaves wasmtime-py's shared one
    alone). Pointers cross as plain integers (c_void_p): ctypes converts those far faster than
    typed pointers, and these functions run on every host call."""
    function = ffi.dll[name]
    function.restype, function.argtypes = restype, list(argtypes)
    return function


_vp, _size = ctypes.c_void_p, ctypes.c_size_t
# wasmtime-py 50 declares this function as returning an error pointer, but the C function
# returns void (its return register holds garbage): reading that "error" segfaulted.
_epoch_deadline_async_yield_and_update = raw_prototype("wasmtime_context_epoch_deadline_async_yield_and_update",
                                                       None, _vp, ctypes.c_uint64)
_set_epoch_deadline = raw_prototype("wasmtime_context_set_epoch_deadline", None, _vp, ctypes.c_uint64)
_future_poll = raw_prototype("wasmtime_call_future_poll", ctypes.c_bool, _vp)
_future_delete = raw_prototype("wasmtime_call_future_delete", None, _vp)
_define_func = raw_prototype("wasmtime_linker_define_func", _vp, _vp, ctypes.c_char_p, _size, ctypes.c_char_p, _size,
                             _vp, _vp, _vp, _vp)
_define_async_func = raw_prototype("wasmtime_linker_define_async_func", _vp, _vp, ctypes.c_char_p, _size,
                                   ctypes.c_char_p, _size, _vp, _vp, _vp, _vp)
_caller_export_get = raw_prototype("wasmtime_caller_export_get", ctypes.c_bool, _vp, ctypes.c_char_p, _size,
                                   ctypes.POINTER(ffi.wasmtime_extern_t))
_caller_context = raw_prototype("wasmtime_caller_context", _vp, _vp)
_memory_data = raw_prototype("wasmtime_memory_data", _vp, _vp, ctypes.POINTER(ffi.wasmtime_memory_t))
_memory_data_size = raw_prototype("wasmtime_memory_data_size", _size, _vp, ctypes.POINTER(ffi.wasmtime_memory_t))

_MEMORY_EXPORT = b"memory"
_instance_export_get = raw_prototype("wasmtime_instance_export_get", ctypes.c_bool, _vp,
                                     ctypes.POINTER(ffi.wasmtime_instance_t), ctypes.c_char_p, _size,
                                     ctypes.POINTER(ffi.wasmtime_extern_t))


def instance_export(store: wasmtime.Store, instance: wasmtime.Instance, name: bytes):
    """The export `name` of `instance` as a wasmtime Func or Memory (None: there is none, or it
    is another kind): one lookup, where `Instance.exports` wraps every export of the module."""
    item = ffi.wasmtime_extern_t()
    if not _instance_export_get(store._context(), ctypes.byref(instance._instance), name, len(name),
                                ctypes.byref(item)):
        return None
    if item.kind == ffi.WASMTIME_EXTERN_FUNC.value:
        return wasmtime.Func._from_raw(item.of.func)
    if item.kind == ffi.WASMTIME_EXTERN_MEMORY.value:
        return wasmtime.Memory._from_raw(item.of.memory)
    return None

# The C half (fiber_native.c): the callbacks of our host functions, and the poll.
_native = load_library(Path(__file__).with_name("fiber_native.c"))
_fiber_poll = _native.sym_fiber_poll
_fiber_poll.restype, _fiber_poll.argtypes = ctypes.c_int, [_vp, ctypes.c_uint64, _vp]
_ticker_run = _native.sym_ticker_run  # EpochTicker's loop
_ticker_run.restype, _ticker_run.argtypes = None, [_vp, _vp, _vp, _vp, ctypes.c_uint64]
_engine_clone = raw_prototype("wasmtime_engine_clone", _vp, _vp)
_engine_delete = raw_prototype("wasm_engine_delete", None, _vp)
_INCREMENT_EPOCH = ctypes.cast(ffi.dll["wasmtime_engine_increment_epoch"], _vp).value
_NANOSLEEP = ctypes.cast(ctypes.CDLL(None).nanosleep, _vp).value  # the C library's
_native.sym_lane_init.restype, _native.sym_lane_init.argtypes = None, [_vp]
_native.sym_lane_init(ctypes.cast(ctypes.CDLL(None).clock_gettime, _vp))
_lane_round = _native.sym_lane_round
_lane_round.restype = ctypes.c_uint64
_lane_round.argtypes = [_vp, ctypes.c_uint64, ctypes.c_uint64, _vp, _vp, _vp, _vp, _vp, _vp]
_fiber_polled = _native.sym_fiber_polled
_fiber_polled.restype, _fiber_polled.argtypes = _vp, []
_POLL_FINISHED, _POLL_CALLED, _POLL_FAST_CALL, POLL_LANE = 1, 2, 3, 4  # sym_fiber_poll's answers (0: waiting or yielded)
_BLOCKING_CALL = ctypes.cast(_native.sym_fiber_blocking_call, _vp).value
_SYNC_CALL = ctypes.cast(_native.sym_fiber_sync_call, _vp).value

MAX_BLOCKING_ARGS, MAX_RESULTS, MAX_PREFETCHED_OBJECTS, MAX_FAST_CALLS = 16, 4, 8, 4
_NONE = 2**64 - 1  # fiber_native.c's SYM_FAST_NONE
_VALUE_BYTES = 32  # a wasmtime_val_t: the kind byte, then the value at offset 8
_MEMORY_HANDLE_BYTES = ctypes.sizeof(ffi.wasmtime_memory_t)


class _FastShape(ctypes.Structure):
    """fiber_native.c's sym_fast_call: a FastCall as C checks it."""

    _fields_ = [("function", ctypes.c_uint64), ("fixed_mask", ctypes.c_uint64), ("nonnegative_mask", ctypes.c_uint64),
                ("fixed", ctypes.c_int32 * MAX_BLOCKING_ARGS), ("read_arg", ctypes.c_uint64),
                ("read_bound", ctypes.c_uint64), ("span_arg", ctypes.c_uint64), ("span_scale", ctypes.c_uint64)]


class _Slot(ctypes.Structure):
    """fiber_native.c's sym_fiber_slot: what the two halves share, one per fiber (that file says
    what each field is). Checked field by field against the C side at import."""

    _fields_ = [("future", _vp), ("context", _vp), ("called", ctypes.c_uint64), ("function", ctypes.c_uint64),
                ("caller", _vp), ("results", _vp), ("trap_ret", _vp), ("nargs", ctypes.c_uint64),
                ("answered", ctypes.c_uint8 * 8), ("nresults", ctypes.c_uint64), ("trap", _vp),
                ("args", ctypes.c_uint8 * (_VALUE_BYTES * MAX_BLOCKING_ARGS)),
                ("answer", ctypes.c_uint8 * (_VALUE_BYTES * MAX_RESULTS)), ("stack", _vp),
                ("host_objects", _vp * MAX_PREFETCHED_OBJECTS),
                ("host_object_bytes", ctypes.c_uint64 * MAX_PREFETCHED_OBJECTS),
                ("fast", _FastShape * MAX_FAST_CALLS), ("fast_memory", _vp),
                ("fast_memory_handle", ctypes.c_uint8 * _MEMORY_HANDLE_BYTES), ("fast_index", ctypes.c_uint64),
                ("fast_value", ctypes.c_int64), ("lane_open", ctypes.c_uint64), ("lane_kv", ctypes.c_int64),
                ("lane_budget", ctypes.c_int64), ("lane_room", ctypes.c_int64), ("lane_ticket", ctypes.c_int64),
                ("lane_pending", ctypes.c_uint64), ("lane_pending_ticket", ctypes.c_int64),
                ("lane_token", ctypes.c_int64), ("lane_calls", ctypes.c_uint64), ("lane_ns", ctypes.c_uint64),
                ("lane_ns_limit", ctypes.c_uint64), ("lane_ticks", ctypes.c_uint64),
                ("lane_shapes", ctypes.c_uint64 * 3)]


def _check_slot_layout() -> None:
    names = [name for name, _ in _Slot._fields_]
    declared = [ctypes.sizeof(_Slot), *(getattr(_Slot, name).offset for name in names),
                ctypes.sizeof(_FastShape), _FastShape.fixed.offset, _FastShape.read_arg.offset, MAX_FAST_CALLS,
                MAX_BLOCKING_ARGS, MAX_RESULTS, MAX_PREFETCHED_OBJECTS, _VALUE_BYTES, _MEMORY_HANDLE_BYTES]
    native = (ctypes.c_uint32 * len(declared))()
    count = _native.sym_fiber_slot_layout(native, len(declared))
    if count != len(declared) or list(native) != declared:
        raise ImportError(f"fiber.py's _Slot ({declared}) does not match fiber_native.c's sym_fiber_slot "
                          f"({list(native)[:count]}): size, field offsets, then the sizes of its arrays")


_native.sym_fiber_slot_layout.restype = ctypes.c_uint
_native.sym_fiber_slot_layout.argtypes = [ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint]
_check_slot_layout()
# The slot as 64-bit words, for the fields a round touches (a memoryview index is ~30 ns; a
# Structure attribute several times that): each word's index, from _Slot's offsets.
_FUTURE, _CONTEXT, _CALLED, _FUNCTION, _CALLER, _ANSWERED, _TRAP, _FAST_INDEX, _FAST_VALUE = (
    getattr(_Slot, name).offset // 8
    for name in ("future", "context", "called", "function", "caller", "answered", "trap", "fast_index", "fast_value"))
(_LANE_OPEN, _LANE_KV, _LANE_BUDGET, _LANE_ROOM, _LANE_TICKET, _LANE_PENDING, _LANE_PENDING_TICKET, _LANE_TOKEN,
 _LANE_CALLS, _LANE_NS, _LANE_NS_LIMIT, _LANE_TICKS, _LANE_SHAPES) = (
    getattr(_Slot, name).offset // 8
    for name in ("lane_open", "lane_kv", "lane_budget", "lane_room", "lane_ticket", "lane_pending",
                 "lane_pending_ticket", "lane_token", "lane_calls", "lane_ns", "lane_ns_limit", "lane_ticks",
                 "lane_shapes"))
_HOST_OBJECTS, _HOST_OBJECT_BYTES = _Slot.host_objects.offset // 8, _Slot.host_object_bytes.offset // 8
_ARGS_OFFSET, _ANSWER_OFFSET, _FAST_OFFSET = _Slot.args.offset, _Slot.answer.offset, _Slot.fast.offset
# A fast call's one i32 result, as two words of the slot's first answer value: its kind (i32 is
# 0) with the padding, then the value (a wasmtime_val_t: the kind byte, the value at offset 8).
_ANSWER_KIND, _ANSWER_VALUE = _ANSWER_OFFSET // 8, _ANSWER_OFFSET // 8 + 1
# Where an object's memory starts, before its id(): CPython's GC header (16 bytes) and, for an
# instance with a __dict__, the two words before that. And the most prefetched of one object
# (its first lines: a large object's size would be fetched on every poll).
_OBJECT_PREFIX = 32
_MAX_OBJECT_BYTES = 1024


def _address(pointer) -> int:
    return ctypes.cast(pointer, _vp).value or 0


def context_address(store: wasmtime.Store) -> int:
    """The address of `store`'s context, as the raw prototypes here take it."""
    return _address(store._context())


def memory_location(context: int, memory: ffi.wasmtime_memory_t) -> tuple[int, int]:
    """(base address, size in bytes) of `memory` in the store whose context is at `context`."""
    handle = ctypes.byref(memory)
    return _memory_data(context, handle) or 0, _memory_data_size(context, handle)


def make_async_engine(epoch_interruption: bool = True, max_wasm_stack_bytes: int = 1 << 20,
                      consume_fuel: bool = False) -> wasmtime.Engine:
    """An engine whose guests run as fibers. With `epoch_interruption`, every store needs
    `set_time_slice` (otherwise its guests stop at once with an interrupt trap). With
    `consume_fuel`, give each store fuel (`Store.set_fuel`); a guest out of fuel traps.
    wasmtime 50 has no async on/off switch: a store is async because its calls are."""
    config = wasmtime.Config()
    config.epoch_interruption = epoch_interruption
    config.consume_fuel = consume_fuel
    config.max_wasm_stack = max_wasm_stack_bytes
    # A memory keeps its base address for life (it grows inside its 4 GiB reservation), so
    # the host can keep a guest's base address instead of asking on every host call.
    config.memory_may_move = False
    ffi.wasmtime_config_async_stack_size_set(config.ptr(), max_wasm_stack_bytes + HOST_STACK_BYTES)
    return wasmtime.Engine(config)


def set_time_slice(store: wasmtime.Store, epoch_ticks: int) -> None:
    """Make guests in `store` yield to `Fiber.poll()` (which then returns False) when their
    time slice ends, instead of trapping. The first slice (and a fresh one at `Fiber.poll`)
    lasts `epoch_ticks` whole intervals of the engine's epoch at least: it ends at the
    (epoch_ticks + 1)th tick from now, since the next tick may come a microsecond later (a
    slice of one tick then ended before a guest that had just resumed from a pred could reach
    its next one, and the batch went without it).
    After a yield, the guest runs from its next poll until the `epoch_ticks`th tick: 0 to
    10 ms a round at one tick for a guest that only computes (measured: 56 ms of compute took
    0.39 s beside four processes decoding with 15 ms forward passes). Kept short: in `symphony
    run` a round and the batches share one thread, so each such slice delays the next batch."""
    store.set_epoch_deadline(epoch_ticks + 1)
    _epoch_deadline_async_yield_and_update(context_address(store), epoch_ticks)


class EpochTicker:
    """Increments `engine`'s epoch every `interval_s` seconds: the clock behind `set_time_slice`.
    The ticks come from C (fiber_native.c's sym_ticker_run) on a thread of its own that never
    takes the GIL, so a tick never waits for the thread running guests, nor makes it wait
    (measured: ticks in Python cost 2.5% of hello's run at batch 8, and ~10% of the null round
    at 1024 processes). Use as a context manager, or call `start()` and `stop()` (which waits
    10 ms at most); a ticker runs once."""

    def __init__(self, engine: wasmtime.Engine, interval_s: float = 0.01):
        self.engine = engine
        self.interval_s = interval_s
        self._stop = ctypes.c_uint32(0)
        self._clone: int | None = None  # the engine the C loop ticks: its own reference
        self._thread = threading.Thread(target=self._run, name="epoch-ticker", daemon=True)

    def _run(self) -> None:
        _ticker_run(self._clone, _INCREMENT_EPOCH, _NANOSLEEP, ctypes.addressof(self._stop),
                    max(1, round(self.interval_s * 1e9)))

    def start(self) -> "EpochTicker":
        self._clone = _engine_clone(self.engine.ptr())
        self._thread.start()
        _running_tickers.add(self)
        return self

    def stop(self) -> None:
        self._stop.value = 1
        if self._thread.is_alive():
            self._thread.join()
        _running_tickers.discard(self)
        clone, self._clone = self._clone, None
        if clone is not None and not self._thread.is_alive():
            _engine_delete(clone)

    def __enter__(self) -> "EpochTicker":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


_running_tickers: set[EpochTicker] = set()


@atexit.register
def _stop_tickers() -> None:
    """At exit, before modules are torn down: a ticker's thread is inside C, which Python's
    shutdown neither waits for nor stops, reading a flag that module teardown may free."""
    for ticker in list(_running_tickers):
        ticker.stop()


class Ready:
    """A handler's answer that is available now: one value per declared result."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[Value] = ()):
        self.values = values


class Pending:
    """A handler's answer that arrives later. Some other code calls `complete(values)`, or
    `fail(message)` to trap the guest with `message`; the guest resumes at its fiber's next
    poll. Both may be called from any thread: they only record the answer, which the polling
    thread hands to wasmtime. `abandoned` turns True if the guest's call was dropped (its fiber
    closed) before an answer came, so the work can be skipped."""

    __slots__ = ("values", "failure", "done", "abandoned")

    def __init__(self):
        self.values: Sequence[Value] = ()
        self.failure: str | None = None
        self.abandoned = False
        self.done = False

    def complete(self, values: Sequence[Value] = ()) -> None:
        self.values = values
        self.done = True  # last: the poller reads `done` first

    def fail(self, message: str) -> None:
        self.failure = message
        self.done = True


HostResult = Union[Ready, Pending]
Handler = Callable[["HostCall", list], HostResult]


class FastCall:
    """The common shape of one blocking host function, which fiber_native.c recognises as the
    guest makes the call, so that Python can take it without decoding it (`Fiber.set_fast_calls`):
    `fixed` arguments (index -> value) equal, those in `nonnegative` >= 0, an output buffer at
    args[span_arg] of span_scale * args[span_arg + 1] bytes inside the guest's memory, and the
    i32 at the address in args[read_arg] inside memory and in [0, read_bound): that value is
    what the handler gets (0 without `read_arg`). Anything else is an ordinary call."""

    __slots__ = ("module", "name", "fixed", "nonnegative", "read_arg", "read_bound", "span_arg", "span_scale")

    def __init__(self, module: str, name: str, fixed: dict[int, int], nonnegative: Sequence[int] = (),
                 read_arg: int | None = None, read_bound: int = 0, span_arg: int | None = None, span_scale: int = 1):
        used = (*fixed, *nonnegative, *(() if read_arg is None else (read_arg,)),
                *(() if span_arg is None else (span_arg, span_arg + 1)))
        if not all(0 <= i < MAX_BLOCKING_ARGS for i in used):
            raise ValueError(f"a fast call's arguments are among the first {MAX_BLOCKING_ARGS}")
        self.module, self.name = module, name
        self.fixed, self.nonnegative = dict(fixed), tuple(nonnegative)
        self.read_arg, self.read_bound, self.span_arg, self.span_scale = read_arg, read_bound, span_arg, span_scale


class FastCalls:
    """Up to MAX_FAST_CALLS shapes (FastCall) of functions of one linker, each a function with
    one i32 result, checked and laid out once as fiber_native.c reads them: each fiber that
    takes them (`Fiber.set_fast_calls`) copies the layout. A shape's index is its place in
    `shapes`."""

    __slots__ = ("functions", "layout")

    def __init__(self, linker: "AsyncLinker", shapes: Sequence[FastCall]):
        if len(shapes) > MAX_FAST_CALLS:
            raise ValueError(f"a fiber takes at most {MAX_FAST_CALLS} fast calls")
        self.layout = (_FastShape * MAX_FAST_CALLS)()
        self.functions: list[_HostFunction] = []
        for entry, shape in zip(self.layout, shapes):
            key = linker.keys[(shape.module, shape.name)]
            function = _FUNCTIONS[key]
            if function.results.kinds != (0,):
                raise ValueError(f"{function.qualified_name}: a fast call returns one i32")
            arity = len(function.params.kinds)
            if any(i >= arity for i in (*shape.fixed, *shape.nonnegative)) or \
                    (shape.read_arg is not None and shape.read_arg >= arity) or \
                    (shape.span_arg is not None and shape.span_arg + 1 >= arity):
                raise ValueError(f"{function.qualified_name} takes {arity} arguments")
            entry.fixed_mask = sum(1 << i for i in shape.fixed)
            entry.nonnegative_mask = sum(1 << i for i in shape.nonnegative)
            for i, value in shape.fixed.items():
                entry.fixed[i] = value
            entry.read_arg = _NONE if shape.read_arg is None else shape.read_arg
            entry.span_arg = _NONE if shape.span_arg is None else shape.span_arg
            entry.read_bound, entry.span_scale = shape.read_bound, shape.span_scale
            entry.function = key
            self.functions.append(function)


class HostCall:
    """What a handler knows about the call it serves: the `fiber` being polled (whose `owner`
    says which guest this is) and the caller's exported memory. It is valid until the call
    completes; touch guest memory only from the thread that polls the fiber. `fiber` is
    cleared once a handler has returned a Pending: a waiting call must not keep a fiber that
    its host has dropped alive (that fiber's deletion is what ends the wait). A blocking call's
    handler runs after wasmtime's callback returned, while the guest is suspended in the call:
    wasmtime keeps the caller in the suspended call's state until the call completes."""

    __slots__ = ("fiber", "_caller", "_context", "_memory")

    def __init__(self, caller: int, fiber: Fiber | None):
        self.fiber = fiber
        self._caller = caller
        self._context = None
        self._memory = None

    def memory_location(self) -> tuple[int, int]:
        """(base address, size in bytes) of the caller's memory export "memory", as it is now.
        Re-read it after anything that may grow memory. Fits `GuestMemory(locate=...)`."""
        if self._caller is None:
            raise RuntimeError("this host call has already completed")
        if self._memory is None:
            item = ffi.wasmtime_extern_t()
            found = _caller_export_get(self._caller, _MEMORY_EXPORT, len(_MEMORY_EXPORT), ctypes.byref(item))
            if not found or item.kind != ffi.WASMTIME_EXTERN_MEMORY.value:
                raise LookupError("the guest exports no memory named 'memory'")
            self._context = _caller_context(self._caller)
            self._memory = item.of.memory
        return memory_location(self._context, self._memory)


_NO_VALUES = (ffi.wasmtime_val_t * 1)()  # what a call of no params and no results points at
_ZEROS = [0] * MAX_PREFETCHED_OBJECTS  # (prefetch_with's padding)

# A wasmtime_val_t: the kind byte, then the value at offset 8 (kind -> struct code and padding).
_VALUE_CODE = {0: "i20x", 1: "q16x", 2: "f20x", 3: "d16x"}


class _ValueLayout:
    """How a list of values of the given kinds sits in an array of wasmtime_val_t: read and
    written with one struct call, in a buffer of ours (a slot, or a call's own arrays)."""

    __slots__ = ("kinds", "_reader", "_writer")

    def __init__(self, kinds: tuple[int, ...]):
        self.kinds = kinds
        self._reader = struct.Struct("<" + "".join("8x" + _VALUE_CODE[kind] for kind in kinds))
        self._writer = struct.Struct("<" + "".join("B7x" + _VALUE_CODE[kind] for kind in kinds))

    def read(self, buffer: memoryview, offset: int = 0) -> tuple[Value, ...]:
        return self._reader.unpack_from(buffer, offset) if self.kinds else ()

    def write(self, buffer: memoryview, offset: int, values: Sequence[Value], what: str) -> None:
        if len(values) != len(self.kinds):
            raise ValueError(f"{what} takes {len(self.kinds)} values, got {len(values)}")
        if len(values) == 1:
            self._writer.pack_into(buffer, offset, self.kinds[0], values[0])
        elif values:
            fields = [field for pair in zip(self.kinds, values) for field in pair]
            self._writer.pack_into(buffer, offset, *fields)


class _HostFunction:
    __slots__ = ("qualified_name", "params", "results", "handler")

    def __init__(self, qualified_name: str, param_kinds: tuple[int, ...],
                 result_kinds: tuple[int, ...], handler: Callable):
        self.qualified_name = qualified_name
        self.params = _ValueLayout(param_kinds)
        self.results = _ValueLayout(result_kinds)
        self.handler = handler


# Callback data crosses C as integer keys into this map (never Python object pointers); each
# entry leaves in the finalizer wasmtime calls when it drops the function. Single dict
# operations are atomic under the GIL, so threads may share it without a lock.
_FUNCTIONS: dict[int, _HostFunction] = {}
_next_key = itertools.count(1)
_LANE_FIBERS: dict[int, "Fiber"] = {}  # slot address -> a fiber with a decode lane (Fiber.set_lane)
_STORES_IN_CALL: set[int] = set()


def _all_open(objects: Sequence[object]) -> bool:
    """False if any wasmtime-py object among `objects` has already been closed (freed)."""
    for item in objects:
        if isinstance(item, wasmtime.Managed):
            try:
                item.ptr()
            except ValueError:
                return False
    return True


class _PerThread(threading.local):
    fiber: "Fiber | None" = None


_polling = _PerThread()  # the fiber this thread is polling: host callbacks run inside its poll


def polling_fiber() -> "Fiber | None":
    """The fiber this thread is polling now (host functions run inside its poll), or None."""
    return _polling.fiber


def _kinds(types: Sequence[wasmtime.ValType]) -> tuple[int, ...]:
    try:
        return tuple(_KIND_OF_TYPE[str(t)] for t in types)
    except KeyError as error:
        raise TypeError(f"only i32, i64, f32 and f64 cross this boundary, not {error}") from None


def _new_trap(message: str) -> int:
    data = message.encode("utf-8", "replace")
    return _address(ffi.wasmtime_trap_new(data, len(data)))


def _trap_for(function: _HostFunction | None, error: BaseException) -> int:
    """A guest trap describing `error`, which is also kept on the polled fiber for the host's
    logs. A KeyboardInterrupt or SystemExit is re-raised by `Fiber.poll()` after wasmtime
    returns, so it still reaches the host."""
    fiber = _polling.fiber
    if fiber is not None:
        fiber.error = error
        if not isinstance(error, Exception):
            fiber._deferred = error
    return _new_trap(_failure_message(function, error))


def _failure_message(function: _HostFunction | None, error: BaseException) -> str:
    name = function.qualified_name if function is not None else "a host function"
    try:
        detail = f"{type(error).__name__}: {error}"
    except BaseException:  # a broken __str__ must not escape either
        detail = type(error).__name__
    return f"{name} failed: {detail}"


# Our callback prototypes, with every pointer as a plain integer (see raw_prototype).
_FINALIZER = ctypes.CFUNCTYPE(None, _vp)


@ctypes.CFUNCTYPE(_vp, ctypes.c_uint64)
def _handle_sync_call(key):
    """Runs a `define_func` handler for fiber_native.c's sym_fiber_sync_call, which recorded
    the call in the polled fiber's slot: the answer goes there too. Returns 0, or a trap
    pointer. Never raises."""
    function, call, fiber = _FUNCTIONS.get(key), None, _polling.fiber
    polled_by_lane = fiber is None  # polled by LaneRound, in C: found by its slot, polled here meanwhile
    if polled_by_lane:
        fiber = _polling.fiber = _LANE_FIBERS.get(_fiber_polled())
    try:
        view, fields = fiber._view, fiber._fields
        if fields[_LANE_OPEN] == 2:  # the lane closed for this call: the host takes back its counts first
            fiber.lane_fold()
        if fields[_FAST_INDEX]:  # a fast call (Fiber.set_fast_calls): its handler first
            value = fiber._fast[fields[_FAST_INDEX] - 1][1](fiber, function.params.read(view, _ARGS_OFFSET),
                                                           fields[_FAST_VALUE])
            if value is not None:
                fields[_ANSWER_KIND] = 0
                fields[_ANSWER_VALUE] = value & 0xFFFFFFFF
                return 0
        call = HostCall(fields[_CALLER], fiber)
        values = function.handler(call, function.params.read(view, _ARGS_OFFSET))
        function.results.write(view, _ANSWER_OFFSET, values, function.qualified_name)
        return 0
    except BaseException as error:
        return _trap_for(function, error)
    finally:
        if call is not None:
            call._caller = None
        if polled_by_lane:
            _polling.fiber = None


_native.sym_fiber_init_memory_size.restype, _native.sym_fiber_init_memory_size.argtypes = None, [_vp]
_native.sym_fiber_init_memory_size(ctypes.cast(ffi.dll["wasmtime_memory_data_size"], _vp))
_native.sym_fiber_init.restype, _native.sym_fiber_init.argtypes = None, [_vp, _vp, _vp, _vp]
_native.sym_fiber_init(ctypes.cast(_future_poll, _vp), ctypes.cast(_set_epoch_deadline, _vp),
                       ctypes.cast(ffi.dll["wasmtime_trap_new"], _vp), ctypes.cast(_handle_sync_call, _vp))


def _answer(fiber: "Fiber", function: "_HostFunction | None", values: Sequence[Value]) -> None:
    """Write a blocking call's answer into the fiber's slot (a failure to becomes the guest's
    trap) and raise the byte its continuation reads: the continuation copies it where wasmtime
    wants it (fiber_native.c)."""
    try:
        function.results.write(fiber._view, _ANSWER_OFFSET, values, function.qualified_name)
    except BaseException as error:
        fiber._fields[_TRAP] = _trap_for(function, error)
    fiber._fields[_ANSWERED] = 1


def _deliver(fiber: "Fiber") -> None:
    """Answer the call the fiber waits in with its done Pending's values (or trap). Runs on the
    polling thread, inside `Fiber.poll` (so no other thread can close the fiber meanwhile).
    Never raises."""
    pending, fiber._wait = fiber._wait, None
    fiber._wait_call._caller = None  # the call is over
    fiber._wait_call = None
    fields = fiber._fields
    if pending.failure is not None:
        fields[_TRAP] = _new_trap(pending.failure)
        fields[_ANSWERED] = 1
        return
    function = _FUNCTIONS.get(fields[_FUNCTION])
    try:  # _answer, inline: once per waited call
        function.results.write(fiber._view, _ANSWER_OFFSET, pending.values, function.qualified_name)
    except BaseException as error:
        fields[_TRAP] = _trap_for(function, error)
    fields[_ANSWERED] = 1


@_FINALIZER
def _forget_function(key, functions: dict = _FUNCTIONS) -> None:
    """wasmtime dropped the last linker or store that held this host function. (The map is
    bound here: at interpreter exit a linker may be freed after this module's globals are.)"""
    functions.pop(key, None)


class AsyncLinker:
    """The host functions guests import, and async instantiation into a store. One linker can
    serve many stores, on many threads."""

    def __init__(self, engine: wasmtime.Engine):
        self.engine = engine
        self.linker = wasmtime.Linker(engine)
        self.keys: dict[tuple[str, str], int] = {}  # (module, name) -> the key of the function defined last
        self.fast_calls: dict[object, FastCalls] = {}  # FastCalls its users made once, by a key of theirs

    def define_wasi(self) -> None:
        """Provide WASI preview 1 (configure each store with `Store.set_wasi`)."""
        self.linker.define_wasi()

    def define_async(self, module: str, name: str, params: Sequence[wasmtime.ValType],
                     results: Sequence[wasmtime.ValType], handler: Handler) -> None:
        """Provide `module.name`, which may block: `handler(call, args)` returns `Ready(values)`
        or a `Pending` that the guest waits on. If it raises, the guest traps."""
        if len(params) > MAX_BLOCKING_ARGS:
            raise TypeError(f"a blocking host function takes at most {MAX_BLOCKING_ARGS} parameters")
        self._define(_define_async_func, _BLOCKING_CALL, module, name, params, results, handler)

    def define_func(self, module: str, name: str, params: Sequence[wasmtime.ValType],
                    results: Sequence[wasmtime.ValType],
                    handler: Callable[[HostCall, list], Sequence[Value]]) -> None:
        """Provide `module.name`, which never blocks: `handler(call, args)` returns the result
        values. Cheaper than `define_async` for a call that never waits: the handler runs
        inside the guest's call (a ctypes callback), where a blocking call costs one more poll
        (measured warm, one guest: 1.1 against 1.9-2.1 us). If it raises, the guest traps."""
        self._define(_define_func, _SYNC_CALL, module, name, params, results, handler)

    def _define(self, define, callback: int, module: str, name: str, params, results, handler) -> None:
        if len(results) > MAX_RESULTS:
            raise TypeError(f"a host function of a fiber returns at most {MAX_RESULTS} results")
        key = next(_next_key)
        _FUNCTIONS[key] = _HostFunction(f"{module}.{name}", _kinds(params), _kinds(results), handler)
        self.keys[(module, name)] = key
        module_bytes, name_bytes = module.encode(), name.encode()
        func_type = wasmtime.FuncType(list(params), list(results))  # a name keeps it alive for the call
        error = define(self.linker.ptr(), module_bytes, len(module_bytes), name_bytes, len(name_bytes),
                       func_type.ptr(), callback, key, _address(_forget_function))
        if error:
            _FUNCTIONS.pop(key, None)
            raise wasmtime.WasmtimeError._from_ptr(ctypes.cast(error, ctypes.POINTER(ffi.wasmtime_error_t)))

    def start_instantiate(self, store: wasmtime.Store, module: wasmtime.Module,
                          owner: object = None) -> "Fiber":
        """Instantiation as a fiber (its start function may block); `result` is [Instance]."""
        return Fiber._instantiation(self, store, module, owner)

    def instantiate(self, store: wasmtime.Store, module: wasmtime.Module,
                    owner: object = None) -> wasmtime.Instance:
        """Instantiate `module` in `store`, polling until done (a start function that waits
        on a Pending keeps this spinning: use `start_instantiate` for those). Raises
        WasmtimeError on a missing import or a trap."""
        fiber = self.start_instantiate(store, module, owner)
        while not fiber.poll():
            pass
        if fiber.result is None or fiber.exit_code is not None:
            raise wasmtime.WasmtimeError(f"instantiation failed: {fiber.trap or f'exit {fiber.exit_code}'}")
        return fiber.result[0]


class LaneRound:
    """fiber_native.c's sym_lane_round with its arrays (one per polling thread): resumes a
    round of fibers whose lane request was answered, each until its next one, in one call.
    `run(addresses, scale)` takes their `slot_address`es and the CPU share to charge wall
    time by; then `requests[:asked]` are the indices of those that made a new lane request
    (`kvs`, `tokens`: its handle and token) and `others[:n_others]` of the rest, with each
    one's poll answer in `states` (-1: not polled, its lane closed; else `after_lane_round`'s)."""

    def __init__(self):
        self._capacity = 0
        self._n_others = ctypes.c_uint64()
        self._n_others_address = ctypes.addressof(self._n_others)

    def _grow(self, n: int) -> None:
        self._capacity = n
        self._buffers = [(ctypes.c_uint32 * n)(), (ctypes.c_int32 * n)(), (ctypes.c_int32 * n)(),
                         (ctypes.c_uint32 * n)(), (ctypes.c_int32 * n)()]
        self._addresses = [ctypes.addressof(buffer) for buffer in self._buffers]
        self.requests, self.kvs, self.tokens, self.others, self.states = (memoryview(b).cast("B").cast(b._type_._type_)
                                                                          for b in self._buffers)

    def run(self, addresses: array.array, scale: float) -> tuple[int, int]:
        """(requests made, others)."""
        n = len(addresses)
        if n > self._capacity:
            self._grow(max(n, 2 * self._capacity))
        requests, kvs, tokens, others, states = self._addresses
        asked = _lane_round(addresses.buffer_info()[0], n, int(scale * 65536), requests, kvs, tokens, others, states,
                            self._n_others_address)
        return asked, self._n_others.value


class Fiber:
    """A guest call in progress on its own wasmtime fiber stack.

    `poll()` runs the guest until it finishes, waits on a Pending, or its time slice ends;
    it returns True once finished. Then exactly one of these is set: `result` (the list of
    return values), `trap` (the message: a wasm trap, an epoch interrupt, running out of fuel,
    a failed Pending, a handler's exception) or `exit_code` (WASI proc_exit; `result` is then
    []). `trap_code` names wasm traps (e.g. TrapCode.OUT_OF_FUEL); `error` keeps a handler's
    exception. `owner` is any object the host attaches (handlers see it as `call.fiber.owner`).
    `slot_address` is where its native state lies: what `poll(prefetch=)` of another fiber takes.

    The store must outlive the fiber, be polled from one thread at a time, and run one fiber
    at a time. `close()` (also done on finishing) frees wasmtime's future.
    """

    # Slots: a scheduler touches every fiber's fields on every round; no per-fiber dict to fetch.
    __slots__ = ("owner", "result", "trap", "trap_code", "exit_code", "error", "_deferred", "_wait", "_wait_call",
                 "_slot", "slot_address", "_view", "_fields", "_store", "_collect", "_keep", "_trap_slot",
                 "_error_slot", "_future", "_fast", "lane_fold")

    def __init__(self, store: wasmtime.Store, func: wasmtime.Func, args: Sequence[Value] = (),
                 owner: object = None):
        func_type = func.type(store)
        param_kinds, result_kinds = _kinds(func_type.params), _kinds(func_type.results)
        params = (ffi.wasmtime_val_t * len(param_kinds))()
        _ValueLayout(param_kinds).write(memoryview(params).cast("B"), 0, args, "this guest function")
        results = (ffi.wasmtime_val_t * len(result_kinds))()
        result_layout = _ValueLayout(result_kinds)

        def start(trap_slot, error_slot):
            return ffi.wasmtime_func_call_async(store._context(), ctypes.byref(func._func), params,
                                                len(param_kinds), results, len(result_kinds),
                                                trap_slot, error_slot)

        self._start(store, owner, start, lambda: list(result_layout.read(memoryview(results).cast("B"))),
                    keep=(func, params, results))

    @classmethod
    def _instantiation(cls, linker: AsyncLinker, store: wasmtime.Store, module: wasmtime.Module,
                       owner: object) -> "Fiber":
        instance = ffi.wasmtime_instance_t()

        def start(trap_slot, error_slot):
            return ffi.wasmtime_linker_instantiate_async(linker.linker.ptr(), store._context(),
                                                         module.ptr(), ctypes.byref(instance),
                                                         trap_slot, error_slot)

        return cls.of_call(store, start, lambda: [wasmtime.Instance._from_raw(instance)],
                           keep=(linker.linker, module, instance), owner=owner)

    @classmethod
    def of_command(cls, store: wasmtime.Store, func: wasmtime.Func, owner: object = None) -> "Fiber":
        """A fiber of a WASI command's `_start`, which takes and returns nothing (program.py
        checked that at load): `Fiber(store, func)` without asking its type (a process's start
        paid ~40 us of wasmtime-py objects for it)."""
        def start(trap_slot, error_slot):
            return ffi.wasmtime_func_call_async(store._context(), ctypes.byref(func._func), _NO_VALUES, 0,
                                                _NO_VALUES, 0, trap_slot, error_slot)

        fiber = cls.__new__(cls)
        fiber._start(store, owner, start, list, keep=(func,))
        return fiber

    @classmethod
    def of_call(cls, store: wasmtime.Store, start, collect, keep: tuple, owner: object = None) -> "Fiber":
        """A fiber of any async call of wasmtime's C API (a component's call or instantiation,
        say): `start(trap_slot, error_slot)` starts it and returns its call future, `collect()`
        gives `result` once it finished, and `keep` holds what the future points into until it
        is closed."""
        fiber = cls.__new__(cls)
        fiber._start(store, owner, start, collect, keep)
        return fiber

    def _start(self, store: wasmtime.Store, owner: object, start, collect, keep: tuple) -> None:
        if not isinstance(store, wasmtime.Store):
            raise TypeError(f"expected a wasmtime.Store, got {type(store).__name__}")
        if id(store) in _STORES_IN_CALL:
            raise RuntimeError("this store already runs a fiber; a store runs one call at a time")
        self.owner = owner
        self.result: list | None = None
        self.trap: str | None = None
        self.trap_code: wasmtime.TrapCode | None = None
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self._deferred: BaseException | None = None
        self._wait: Pending | None = None  # the answer of the host call it waits in, while it waits
        self._wait_call: HostCall | None = None  # and that call
        self._slot = _Slot()
        self.slot_address, self._view = ctypes.addressof(self._slot), memoryview(self._slot).cast("B")
        self._fields = self._view.cast("Q")
        self._fields[_CONTEXT] = _address(store._context())
        self._store = store
        self._collect = collect
        self._keep = keep  # what the future points into; see the module docstring
        self._trap_slot = ctypes.POINTER(ffi.wasm_trap_t)()
        self._error_slot = ctypes.POINTER(ffi.wasmtime_error_t)()
        self._future = _address(start(ctypes.byref(self._trap_slot), ctypes.byref(self._error_slot)))
        self._fields[_FUTURE] = self._future
        self._fast: list | None = None  # set_fast_calls' (function, handler) by shape
        self.lane_fold: Callable[[], None] | None = None  # set_lane's
        fields = self._fields  # prefetch_with(()), inline: the fiber's own two (the rest of the slot is 0)
        fields[_HOST_OBJECTS], fields[_HOST_OBJECTS + 1] = id(self) - _OBJECT_PREFIX, id(fields) - _OBJECT_PREFIX
        fields[_HOST_OBJECT_BYTES] = min(_OBJECT_PREFIX + sys.getsizeof(self), _MAX_OBJECT_BYTES)
        fields[_HOST_OBJECT_BYTES + 1] = min(_OBJECT_PREFIX + sys.getsizeof(fields), _MAX_OBJECT_BYTES)
        _STORES_IN_CALL.add(id(store))

    @property
    def done(self) -> bool:
        return self._future is None

    def prefetch_with(self, objects: Sequence[object]) -> None:
        """Fetch these host objects into the cache too whenever this fiber is prefetched (see
        `poll`): what handling its calls touches, which a scheduler of many guests finds cold.
        They replace those given before. At most MAX_PREFETCHED_OBJECTS with the fiber's own
        two; None is skipped. CPython's id() is the object's address; an object freed since
        costs nothing (a prefetch never faults)."""
        objects = [self, self._fields, *[item for item in objects if item is not None]]
        unused = MAX_PREFETCHED_OBJECTS - len(objects)
        if unused < 0:
            raise ValueError(f"at most {MAX_PREFETCHED_OBJECTS - 2} objects besides the fiber's own")
        getsizeof = sys.getsizeof
        fields = self._fields
        addresses = [id(item) - _OBJECT_PREFIX for item in objects]
        sizes = [min(_OBJECT_PREFIX + getsizeof(item), _MAX_OBJECT_BYTES) for item in objects]
        if unused:
            addresses += _ZEROS[:unused]
            sizes += _ZEROS[:unused]
        fields[_HOST_OBJECTS:_HOST_OBJECTS + MAX_PREFETCHED_OBJECTS] = array.array("Q", addresses)
        fields[_HOST_OBJECT_BYTES:_HOST_OBJECT_BYTES + MAX_PREFETCHED_OBJECTS] = array.array("Q", sizes)

    def set_fast_calls(self, calls: "FastCalls", memory: wasmtime.Memory,
                       handlers: Sequence[Callable[["Fiber", tuple, int], "int | bool | None"]]) -> None:
        """Take the guest's calls in the shapes of `calls` each through its handler, with no
        HostCall and nothing decoded twice: `handler(fiber, args, value)` (`value`: the i32 that
        FastCall reads). The handler returns None to send the call the ordinary way (its own
        handler then runs as for any call). For a blocking function it returns True once it
        answered with `answer_fast_call` (the guest runs on), or False: the guest waits until
        `answer_fast_call` is called (from any thread). For one that never blocks it returns the
        result. It must not raise. `memory` is the guest's memory export."""
        if len(handlers) != len(calls.functions):
            raise ValueError(f"{len(calls.functions)} fast calls take as many handlers, got {len(handlers)}")
        slot = self._slot
        slot.fast_memory = memory_location(self._fields[_CONTEXT], memory._memory)[0]
        ctypes.memmove(slot.fast_memory_handle, ctypes.byref(memory._memory), _MEMORY_HANDLE_BYTES)
        self._fast = [*zip(calls.functions, handlers), *([None] * (MAX_FAST_CALLS - len(handlers)))]
        ctypes.memmove(ctypes.addressof(slot) + _FAST_OFFSET, calls.layout, ctypes.sizeof(calls.layout))  # last

    # ---- the decode lane (fiber_native.c): a LIP's decode steps answered in C ----

    def set_lane(self, pred: int | None, submit: int | None, wait: int | None, fold: Callable[[], None]) -> None:
        """Make the fast calls of these indices (in `set_fast_calls`' FastCalls; None: none) the lane's
        `pred`, `pred_submit` and `pred_wait`. `fold()` is the host's way of taking back what
        the lane counted (`lane_take`) once C closed it: it runs before the call that closed it
        is handled (on the polling thread), or wherever else the host looks first."""
        fields = self._fields
        fields[_LANE_OPEN] = 0
        for i, index in enumerate((pred, submit, wait)):
            fields[_LANE_SHAPES + i] = 0 if index is None else index + 1
        self.lane_fold = fold
        _LANE_FIBERS[self.slot_address] = self

    def lane_open(self, kv: int, budget: int, room: int, ticket: int, ns_limit: int, ticks: int) -> None:
        """Let C answer the guest's decode steps on handle `kv` (fiber_native.c's lane): at most
        `budget` host calls and `room` tokens, tickets numbered from `ticket`, until the CPU
        time it charges reaches `ns_limit`; each resumed guest gets a slice of `ticks`. Only
        while it is closed and taken back (`lane_take`)."""
        fields = self._fields
        fields[_LANE_KV], fields[_LANE_BUDGET], fields[_LANE_ROOM] = kv, budget, room
        fields[_LANE_TICKET], fields[_LANE_NS_LIMIT], fields[_LANE_TICKS] = ticket, ns_limit, ticks
        fields[_LANE_OPEN] = 1  # last: C answers from now on

    @property
    def lane_state(self) -> int:
        """0 closed, 1 open, 2 closed by C (or `lane_close`) with counts to take back."""
        return self._fields[_LANE_OPEN]

    def lane_close(self) -> None:
        """Close an open lane from any thread (a kill): the host takes it back at its next look."""
        fields = self._fields
        if fields[_LANE_OPEN] == 1:
            fields[_LANE_OPEN] = 2

    def lane_take(self) -> tuple[int, int, int, int, int, int]:
        """Close the lane and take back what it counted since the last take: (host calls, the
        next ticket, CPU ns, pending, its ticket, its token). `pending` 1 is a `pred_submit`
        C answered and nobody queued: the caller queues it now, the lane forgets it; 2, a
        request the guest waits in (queued already: its answer ends it)."""
        fields = self._fields
        fields[_LANE_OPEN] = 0
        taken = (fields[_LANE_CALLS], fields[_LANE_TICKET], fields[_LANE_NS], fields[_LANE_PENDING],
                 fields[_LANE_PENDING_TICKET], fields[_LANE_TOKEN])
        fields[_LANE_CALLS] = fields[_LANE_NS] = 0
        if taken[3] == 1:
            fields[_LANE_PENDING] = 0
        return taken

    @property
    def lane_cpu_ns(self) -> int:
        """The CPU time the lane charged since it was last taken back."""
        return self._fields[_LANE_NS]

    @property
    def lane_waiting(self) -> bool:
        """Did the last poll leave the guest waiting in a lane call (`lane_request` says which)?"""
        return self._fields[_CALLED] == POLL_LANE

    def lane_request(self) -> tuple[int, int]:
        """The request the guest waits in: (its KV handle, its token)."""
        fields = self._fields
        return fields[_LANE_KV], fields[_LANE_TOKEN]

    def after_lane_round(self, state: int) -> bool:
        """Go on from the poll `LaneRound` made (its answer `state`, never -1) as `poll` goes on
        from its own: a call taken, the guest polled on while its calls are answered at once.
        True once finished."""
        outer, _polling.fiber = _polling.fiber, self
        try:
            state = self._take_calls(state)
        finally:
            _polling.fiber = outer
        return self._after_poll(state)

    def answer_fast_call(self, value: int) -> None:
        """Answer the blocking fast call the guest waits in (`set_fast_calls`) with its i32; the
        guest runs on at the next poll. Any thread; nothing happens to a fiber closed meanwhile."""
        if self._future is None:
            return
        fields = self._fields
        fields[_ANSWER_KIND] = 0
        fields[_ANSWER_VALUE] = value & 0xFFFFFFFF
        fields[_ANSWERED] = 1

    def _take_fast_call(self) -> bool:
        """The blocking fast call the guest just made (fiber_native.c recognised its shape):
        through its handler, else the ordinary way. True if answered at once (the guest runs on)."""
        fields = self._fields
        if fields[_LANE_OPEN] == 2:  # the lane closed for this call: the host takes back its counts first
            self.lane_fold()
        function, handler = self._fast[fields[_FAST_INDEX] - 1]
        try:
            taken = handler(self, function.params.read(self._view, _ARGS_OFFSET), fields[_FAST_VALUE])
        except BaseException as error:  # (a host bug: the guest traps, as in _take_call)
            fields[_TRAP] = _trap_for(function, error)
            fields[_ANSWERED] = 1
            return True
        return self._take_call() if taken is None else taken

    def poll(self, time_slice_ticks: int = 0, prefetch: int | None = None) -> bool:
        """Run the guest until it finishes (True), or waits or yields (False). With
        `time_slice_ticks`, it first gets a fresh time slice (see `set_time_slice`): one that
        waited in a blocking call is past its old deadline. `prefetch`: the `slot_address` of
        the fiber the caller polls next, whose native state the cache fetches meanwhile (a
        scheduler polling many guests finds each one's cold otherwise); that fiber must be alive."""
        if self._future is None:
            return True
        outer, _polling.fiber = _polling.fiber, self
        try:
            waiting = self._wait
            if waiting is not None and waiting.done:
                _deliver(self)  # the guest resumes in this poll
            state = self._take_calls(_fiber_poll(self.slot_address, time_slice_ticks, prefetch))
        finally:
            _polling.fiber = outer
        return self._after_poll(state)

    def _take_calls(self, state: int) -> int:
        """Take the call a poll ended in, and poll on while calls are answered at once (on in
        the same slice): the last poll's answer."""
        address = self.slot_address
        while True:
            if state == _POLL_CALLED:
                if not self._take_call():
                    return state
            elif state != _POLL_FAST_CALL or not self._take_fast_call():
                return state
            state = _fiber_poll(address, 0, None)

    def _after_poll(self, state: int) -> bool:
        finished = state == _POLL_FINISHED or self._future is None  # the call's handler closed it
        if self._future is not None and finished:
            self._finish()
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            raise deferred
        return finished

    def _take_call(self) -> bool:
        """Run the handler of the blocking call the guest just made (recorded in the slot by
        fiber_native.c), here on the polling thread's stack. True if it was answered at once
        (results or trap written): the next poll runs the guest on. Never raises."""
        fields = self._fields
        function, call = _FUNCTIONS.get(fields[_FUNCTION]), None
        try:
            if fields[_LANE_OPEN] == 2:  # (see _take_fast_call)
                self.lane_fold()
            call = HostCall(fields[_CALLER], self)
            outcome = function.handler(call, function.params.read(self._view, _ARGS_OFFSET))
            if self._future is not None:  # else the handler closed this fiber: the call's slots are gone
                if isinstance(outcome, Pending):  # the call stays valid while the guest waits
                    self._wait, self._wait_call = outcome, call
                    call.fiber = None
                    if outcome.done:  # answered already: the guest runs on
                        _deliver(self)
                        return True
                    return False
                if not isinstance(outcome, Ready):
                    raise TypeError(f"handler returned {type(outcome).__name__}, not Ready or Pending")
                call._caller = None
                _answer(self, function, outcome.values)
                return True
        except BaseException as error:
            trap = _trap_for(function, error)
            if self._future is not None:
                fields[_TRAP] = trap
            else:
                ffi.wasm_trap_delete(ctypes.cast(trap, ctypes.POINTER(ffi.wasm_trap_t)))
        if call is not None:
            call._caller = None
        if self._future is None:
            return False
        fields[_ANSWERED] = 1
        return True

    def _finish(self) -> None:
        if self._trap_slot:
            trap = wasmtime.Trap._from_ptr(self._trap_slot)
            self.trap, self.trap_code = trap.message, trap.trap_code
            trap.close()
        elif self._error_slot:
            error = wasmtime.WasmtimeError._from_ptr(self._error_slot)
            if isinstance(error, wasmtime.ExitTrap):
                self.exit_code, self.result = error.code, []
            else:
                self.trap = str(error)
                last_line = self.trap.rstrip().rpartition("\n")[2].strip()
                if last_line.startswith("wasm trap: "):
                    self.trap_code = _TRAP_CODE_OF_MESSAGE.get(last_line[len("wasm trap: "):])
            error.close()
        else:
            self.result = self._collect()
        self.close()

    def close(self) -> None:
        """Free the call. A guest still waiting in a host call is unwound (its Pending becomes
        `abandoned`) and the fiber reports the trap "closed before it finished"."""
        future, self._future = self._future, None
        if future is None:
            return
        self._fields[_FUTURE] = 0
        _LANE_FIBERS.pop(self.slot_address, None)
        # Garbage cycles are finalized in any order (every module's globals at exit): if
        # wasmtime-py already freed something the future points into, deleting the future
        # would touch freed memory, so it is left alone.
        if _all_open((self._store, *self._keep)):
            outer, _polling.fiber = _polling.fiber, self
            try:
                _future_delete(future)
            finally:
                _polling.fiber = outer
        _STORES_IN_CALL.discard(id(self._store))
        self._keep = self._collect = None
        waiting, self._wait = self._wait, None  # a wait this fiber was left in, if any
        if waiting is not None:
            self._wait_call._caller = None
            self._wait_call = None
            waiting.abandoned = not waiting.done  # no answer came: the work can be skipped
        if self.result is None and self.trap is None:
            self.trap = "closed before it finished"

    def __del__(self) -> None:
        if getattr(self, "_future", None) is not None:
            self.close()
