"""Host functions for components, over wasmtime's async component C API, for guests run as
fibers (fiber.py): wasmtime-py 50's component API has no async host functions, but the C API
does (`wasmtime_component_linker_instance_add_func_async`, `..._func_call_async`,
`..._linker_instantiate_async`); this module reaches them through ctypes and reuses
`fiber.Fiber` for the calls and `fiber.Pending` for the waits. It knows nothing of what the
functions do: the host gives it their handlers and one `invoke` through which every call runs
(lip/component.py gives it the system calls).

Values cross this boundary one element at a time in Python (a `list<f32>` of 151,936 took
96 ms), so lengths are checked before any conversion, and each function's types are learned
once. Every callback catches everything: a failure becomes `err(error-code)` or a guest trap,
never an exception in wasmtime-py's global slot (`LAST_EXCEPTION`, shared by every thread).
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import wasmtime
import wasmtime.component as wc
from wasmtime import _ffi as ffi

from ..errors import ErrorCode, InvalidArgument, SymphonyError
from .component import PACKAGE, PACKAGE_VERSION, RUN_EXPORT
from .fiber import Fiber, Pending, polling_fiber

log = logging.getLogger("symphony.component")

# The version wasmtime 50's WASI defines; imports of any 0.2.x version link to it.
WASI_MONOTONIC_CLOCK = "wasi:clocks/monotonic-clock@0.2.12"
TIMER_REFUSED = (b"a LIP cannot sleep or wait on a timer (wasi:clocks/monotonic-clock subscribe): "
                 b"it would hold up the host's worker; wait on pred or recv instead")


# A component's stdout and stderr, keyed by their target (see capture_output). wasmtime writes them
# on its tokio threads, and drops the writer there too: with a finalizer (wasmtime-py's
# stdout_custom registers one, in Python) a process dropped while the interpreter exited called
# into Python from that thread, which Python 3.11 ends with pthread_exit, and Rust aborted the
# host. So no finalizer: an entry leaves when its target is freed, and a write with none is dropped.
_output_targets: dict[int, weakref.ref] = {}
_output_keys = itertools.count(1)
_NO_FINALIZER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)()  # a null function pointer


@ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.POINTER(ctypes.c_ubyte), ctypes.c_size_t)
def _write_output(key, data, size):
    target = _output_targets.get(key or 0)
    receiver = target() if target is not None else None
    if receiver is not None:
        receiver(ctypes.string_at(data, size))
    return size


def capture_output(wasi: wasmtime.WasiConfig, receiver) -> None:
    """Send what a component writes to stdout and stderr to `receiver(data)`, a bound method
    (held weakly: a store's writer must not keep its process alive; 7 MB each). WASI preview 2
    writes from wasmtime's tokio threads: `receiver` must never raise."""
    key = next(_output_keys)
    _output_targets[key] = weakref.WeakMethod(receiver, lambda _, key=key: _output_targets.pop(key, None))
    for set_custom in (ffi.wasi_config_set_stdout_custom, ffi.wasi_config_set_stderr_custom):
        set_custom(wasi.ptr(), _write_output, key, _NO_FINALIZER)


# ---- values across the boundary ----

@dataclass
class Failed:
    """A call's `err(error-code)`."""

    code: ErrorCode


def _error_name(code: ErrorCode) -> str:
    return code.name.lower().replace("_", "-")


class _HostFunction:
    """One imported function: its Python handler and, after the first call, its types."""

    __slots__ = ("qualified_name", "handler", "invoke", "params", "length_checks", "result", "ok_type", "err_type",
                 "typed")

    def __init__(self, qualified_name: str, handler: Callable, invoke: Callable):
        self.qualified_name = qualified_name
        self.handler = handler
        self.invoke = invoke  # its linker's (not the linker: wasmtime's linker holds this entry)
        self.typed = False

    def learn_types(self, ty_raw) -> None:
        """Types come with the call (wasmtime passes them); build the converters once."""
        if self.typed:
            return
        func_type = wc.FuncType._from_ptr(ty_raw, owner=self)  # owner: wasmtime frees it
        self.params = [ty for _, ty in func_type.params]
        self.length_checks = [_length_check(ty) for ty in self.params]
        self.result = func_type.result
        if isinstance(self.result, wc.ResultType):
            self.ok_type, self.err_type = self.result.ok, self.result.err
        self.typed = True

    def check_arity(self, nargs: int, nresults: int) -> None:
        """A guard behind check_component's: values are read and written only as many as the
        types say (a result written into an empty results array corrupted the host's memory)."""
        if nargs != len(self.params) or nresults != (self.result is not None):
            raise RuntimeError(f"called with {nargs} arguments and {nresults} results, not as the WIT declares")

    def arguments(self, store, args, max_list: int, max_text: int) -> list:
        """The arguments as Python values. Converting goes element by element (2M ids took
        1.6 s and 120 MB), so lengths are read from the raw values first: a list over `max_list`
        elements or a string over `max_text` bytes is refused before any conversion (wasmtime
        frees the raw values after the call either way)."""
        for i, check in enumerate(self.length_checks):
            if check is not None:
                check(args[i], max_list, max_text)
        values = []
        for i, ty in enumerate(self.params):
            value = ty.convert_from_c(args[i])
            if isinstance(value, wc.ResourceAny):  # a borrowed `distribution`: its host key
                value = value.to_host(store).rep
            values.append(value)
        return values

    def lower(self, store, outcome, results) -> None:
        """Write `outcome` (a value, or Failed) as the function's result."""
        if self.result is None:
            return
        target = ctypes.pointer(results[0])
        if not isinstance(self.result, wc.ResultType):
            if isinstance(outcome, Failed):
                raise RuntimeError(f"error {outcome.code.name} from a call that has no error result")
            self.result.convert_to_c(store, outcome, target)
            return
        # A result by hand: wasmtime-py's generic lowering tests the payload against every
        # case's Python classes on each call (kv-len took 25 us a call that way).
        failed = isinstance(outcome, Failed)
        payload_type = self.err_type if failed else self.ok_type
        payload = None
        if payload_type is not None:
            value = ffi.wasmtime_component_val_t()
            payload_type.convert_to_c(store, _error_name(outcome.code) if failed else outcome, ctypes.pointer(value))
            payload = ffi.wasmtime_component_val_new(ctypes.byref(value))  # moves `value`
        target.contents.kind = ffi.WASMTIME_COMPONENT_RESULT
        target.contents.of.result.is_ok = not failed
        target.contents.of.result.val = payload


def _length_check(ty) -> Callable[[Any, int, int], None] | None:
    """For a type that may hold lists or strings: a function that raises InvalidArgument if a
    raw value of it holds a list over `max_list` elements or a string over `max_text` bytes,
    reading lengths only. None for types that hold neither (built once per function)."""
    if isinstance(ty, wc.String):
        def check(raw, max_list: int, max_text: int) -> None:
            if raw.of.string.size > max_text:
                raise InvalidArgument(f"a string of {raw.of.string.size} bytes; the limit is {max_text}")
        return check
    if isinstance(ty, wc.ListType):
        element = _length_check(ty.element)

        def check(raw, max_list: int, max_text: int) -> None:
            size = raw.of.list.size
            if size > max_list:
                raise InvalidArgument(f"a list of {size} elements; the limit is {max_list}")
            if element is not None:
                for i in range(size):
                    element(raw.of.list.data[i], max_list, max_text)
        return check
    if isinstance(ty, wc.OptionType):
        payload = _length_check(ty.payload)
        if payload is None:
            return None
        return lambda raw, max_list, max_text: payload(raw.of.option.contents, max_list, max_text) \
            if raw.of.option else None
    if isinstance(ty, (wc.RecordType, wc.TupleType)):
        is_record = isinstance(ty, wc.RecordType)
        parts = [_length_check(t) for t in ([t for _, t in ty.fields] if is_record else ty.elements)]
        if not any(parts):
            return None

        def check(raw, max_list: int, max_text: int) -> None:
            for i, part in enumerate(parts):
                if part is not None:
                    part(raw.of.record.data[i].val if is_record else raw.of.tuple.data[i], max_list, max_text)
        return check
    if isinstance(ty, wc.VariantType):
        cases = {name: _length_check(t) for name, t in ty.cases if t is not None}
        cases = {name: check for name, check in cases.items() if check is not None}
        if not cases:
            return None

        def check(raw, max_list: int, max_text: int) -> None:
            case = cases.get(ffi.to_str(raw.of.variant.discriminant))
            if case is not None and raw.of.variant.val:
                case(raw.of.variant.val.contents, max_list, max_text)
        return check
    return None


class _Waiting:
    __slots__ = ("pending", "function", "context", "results", "error_ret")

    def __init__(self, pending, function, context, results, error_ret):
        self.pending, self.function, self.context = pending, function, context
        self.results, self.error_ret = results, error_ret


# Callback data crosses C as integer keys (never Python object pointers), as in fiber.py.
_FUNCTIONS: dict[int, _HostFunction] = {}
_WAITING: dict[int, _Waiting] = {}
_next_key = itertools.count(1)


def _error_pointer(function: _HostFunction | None, error: BaseException):
    name = function.qualified_name if function is not None else "a host function"
    try:
        detail = f"{type(error).__name__}: {error}"
    except BaseException:
        detail = type(error).__name__
    if not isinstance(error, SymphonyError):
        log.error("%s failed: %s", name, detail)
    message = f"{name} failed: {detail}".encode("utf-8", "replace")
    return ffi.wasmtime_error_new(message)


def _invoke(function: _HostFunction, store, args):
    """The linker's `invoke` for the fiber being polled (see ComponentLinker)."""
    return function.invoke(polling_fiber().owner, function.qualified_name, function.handler,
                           lambda max_list, max_text: function.arguments(store, args, max_list, max_text))


@ffi.wasmtime_component_func_callback_t
def _call_sync(key, context, ty_raw, args, nargs, results, nresults):
    """A call that answers at once; returns 0 or an error (the guest traps). Never raises."""
    function = _FUNCTIONS.get(key)
    store = wasmtime.StoreContext(context)
    try:
        function.learn_types(ty_raw)
        function.check_arity(nargs, nresults)
        function.lower(store, _invoke(function, store, args), results)
        return 0
    except BaseException as error:
        return ctypes.cast(_error_pointer(function, error), ctypes.c_void_p).value
    finally:
        store._invalidate()


@ffi.wasmtime_func_async_continuation_callback_t
def _continue_ready(env) -> bool:
    return True


@ffi.wasmtime_component_func_async_callback_t
def _call_async(key, context, ty_raw, args, nargs, results, nresults, error_ret, continuation):
    """A call that may block: an answer that is a Pending suspends the guest until it is done.
    Never raises; always hands wasmtime a continuation."""
    slot = continuation.contents
    slot.callback = _continue_ready
    function = _FUNCTIONS.get(key)
    store = wasmtime.StoreContext(context)
    try:
        function.learn_types(ty_raw)
        function.check_arity(nargs, nresults)
        outcome = _invoke(function, store, args)
        if isinstance(outcome, Pending):
            waiting_key = next(_next_key)
            _WAITING[waiting_key] = _Waiting(outcome, function, context, results, error_ret)
            slot.env = waiting_key
            slot.finalizer = _forget_waiting
            slot.callback = _continue_waiting
        else:
            function.lower(store, outcome, results)
    except BaseException as error:
        error_ret[0] = _error_pointer(function, error)
    finally:
        store._invalidate()


@ffi.wasmtime_func_async_continuation_callback_t
def _continue_waiting(waiting_key) -> bool:
    """True once the Pending is done, after writing its outcome. The store context of the
    suspended call stays valid while wasmtime polls its continuation (the call's future holds
    it), and results that carry a resource need it."""
    waiting = _WAITING[waiting_key]
    if not waiting.pending.done:
        return False
    store = wasmtime.StoreContext(waiting.context)
    try:
        if waiting.pending.failure is not None:
            raise RuntimeError(waiting.pending.failure)
        waiting.function.lower(store, waiting.pending.values[0], waiting.results)
    except BaseException as error:
        waiting.error_ret[0] = _error_pointer(waiting.function, error)
    finally:
        store._invalidate()
    return True


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _forget_waiting(waiting_key, waiting_calls: dict = _WAITING) -> None:
    """wasmtime dropped a waiting call's continuation. (The maps are bound here, in this and the
    next: at interpreter exit a store may be freed after this module's globals are.)"""
    waiting = waiting_calls.pop(waiting_key, None)
    if waiting is not None:
        waiting.pending.abandoned = not waiting.pending.done


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _forget_function(key, functions: dict = _FUNCTIONS) -> None:
    functions.pop(key, None)


@ffi.wasmtime_component_func_callback_t
def _refuse_timer(key, context, ty_raw, args, nargs, results, nresults):
    """wasi:clocks/monotonic-clock's subscribe-duration and subscribe-instant: the guest traps."""
    return ctypes.cast(ffi.wasmtime_error_new(TIMER_REFUSED), ctypes.c_void_p).value


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _forget_nothing(_key) -> None:
    """The finalizer of a host function that keeps no data."""


class ComponentLinker:
    """WASI preview 2 and the host's interfaces, for any number of component stores.

    `interfaces`: interface name -> {function name, as the WIT spells it: (handler, blocking)}.
    A call runs `invoke(owner, qualified_name, handler, arguments)` for the polled fiber's
    owner, where `arguments(max_list, max_text)` converts the call's arguments, refusing lists
    and strings past those lengths; what it returns is the call's answer: a value, a `Failed`
    (the WIT's `err`), or for a blocking function a `Pending` the guest waits on.
    `resources`: interface name -> [(resource name, host type id, drop(store, rep))]."""

    def __init__(self, engine: wasmtime.Engine, interfaces: dict[str, dict[str, tuple[Callable, bool]]],
                 invoke: Callable, resources: dict[str, list[tuple[str, int, Callable]]] | None = None):
        self.engine = engine
        self.invoke = invoke
        self.linker = wc.Linker(engine)
        error = ffi.wasmtime_component_linker_add_wasip2_async(self.linker.ptr())
        if error:
            raise wasmtime.WasmtimeError._from_ptr(error)
        # Timers: wasmtime's WASI waits on a pollable with a tokio timer, and our fibers are
        # polled outside any tokio runtime, so waiting on one (Python's time.sleep) panicked in
        # Rust and aborted the host. A LIP cannot create one: it waits on pred or recv instead.
        self.linker.allow_shadowing = True
        with self.linker.root() as root, root.add_instance(WASI_MONOTONIC_CLOCK) as clock:
            for name in ("subscribe-duration", "subscribe-instant"):
                _add_func(ffi.wasmtime_component_linker_instance_add_func, clock, name, _refuse_timer, 0,
                          _forget_nothing)
        self.linker.allow_shadowing = False
        with self.linker.root() as root:
            for interface, calls in interfaces.items():
                with root.add_instance(f"{PACKAGE}/{interface}@{PACKAGE_VERSION}") as instance:
                    for name, type_id, drop in (resources or {}).get(interface, ()):
                        instance.add_resource(name, wc.ResourceType.host(type_id), drop)
                    for name, (handler, blocking) in calls.items():
                        self._define(instance, f"{interface}.{name}", name, handler, blocking)

    def _define(self, instance: wc.LinkerInstance, qualified_name: str, name: str, handler, blocking: bool) -> None:
        key = next(_next_key)
        _FUNCTIONS[key] = _HostFunction(qualified_name, handler, self.invoke)
        define, trampoline = ((ffi.wasmtime_component_linker_instance_add_func_async, _call_async) if blocking
                              else (ffi.wasmtime_component_linker_instance_add_func, _call_sync))
        try:
            _add_func(define, instance, name, trampoline, key, _forget_function)
        except wasmtime.WasmtimeError:
            _FUNCTIONS.pop(key, None)
            raise

    def start_instantiate(self, store: wasmtime.Store, component: wc.Component, owner: object = None) -> Fiber:
        """Instantiation as a fiber; `result` is [component Instance]."""
        instance = ffi.wasmtime_component_instance_t()

        def start(trap_slot, error_slot):
            return ffi.wasmtime_component_linker_instantiate_async(self.linker.ptr(), store._context(),
                                                                   component.ptr(), ctypes.byref(instance), error_slot)

        return Fiber.of_call(store, start, lambda: [wc.Instance._from_raw(instance)],
                             keep=(self.linker, component, instance), owner=owner)


def _add_func(define, instance: wc.LinkerInstance, name: str, trampoline, key: int, finalizer) -> None:
    """Define host function `name` in `instance` through wasmtime's C API (`define`: the sync
    or async add_func), its callback data the integer `key`."""
    name_bytes = name.encode()
    error = define(instance.ptr(), ctypes.create_string_buffer(name_bytes), len(name_bytes), trampoline, key, finalizer)
    if error:
        raise wasmtime.WasmtimeError._from_ptr(error)


def call_run(store: wasmtime.Store, instance: wc.Instance, owner: object = None) -> Fiber:
    """The guest's `run() -> s32` as a fiber; `result` is [exit code]."""
    func = instance.get_func(store, RUN_EXPORT)
    result = ffi.wasmtime_component_val_t()

    def start(trap_slot, error_slot):
        return ffi.wasmtime_component_func_call_async(ctypes.byref(func._func), store._context(), None, 0,
                                                      ctypes.byref(result), 1, error_slot)

    return Fiber.of_call(store, start, lambda: [int(result.of.s32)], keep=(func, result), owner=owner)
