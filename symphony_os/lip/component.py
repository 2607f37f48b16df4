"""Component guests (Python LIPs built with componentize-py): loading, the host side of
guest_sdk/python/wit/symphony.wit, and the process that runs one.

A component runs exactly like a core module: in its own Store, on a wasmtime fiber polled by a
runtime worker, and its blocking calls (`pred-wait`, `recv`, a long `tokenize`) suspend it until
the batch (or the tokenizer thread) that answers them is done, so its `pred`s share batches with
every other process. wasmtime-py 50's component API has no async host functions, but wasmtime's
C API does
(`wasmtime_component_linker_instance_add_func_async`, `..._func_call_async`,
`..._linker_instantiate_async`): this module reaches them through ctypes, and reuses
`fiber.Fiber` for the calls and `fiber.Pending` for the waits.

The calls are those of `syscalls.SystemCalls` (same KV tables, tickets, limits and error
codes), with component values instead of guest pointers. Every callback catches everything: a host
failure becomes `err(error-code)` or a guest trap, never an exception in wasmtime-py's global
slot (`LAST_EXCEPTION`, shared by every thread). A distribution stays on the host: the guest holds a
`distribution` resource whose rep is a key into its own process's `ComponentCalls.distributions`
(reps are per process, so one process's handle can never reach another's distribution).
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import wasmtime
import wasmtime.component as wc
from wasmtime import _ffi as ffi

from ..engine.sampling import Distribution, GreedyEach, Sample, TopK, Want
from ..errors import BadHandle, ErrorCode, InputClosed, InvalidArgument, SymphonyError
from ..wasm.component import PACKAGE, PACKAGE_VERSION, RUN_EXPORT
from ..wasm.fiber import Fiber, polling_fiber
from .process import Process
from .syscalls import MAX_TEXT_BYTES, MAX_TOKENS_PER_PRED, SystemCalls, Wait

log = logging.getLogger("symphony.component")

DISTRIBUTION_RESOURCE_TYPE = 0x53594D01  # our host resource type id ("SYM" 1)
# The version wasmtime 50's WASI defines; imports of any 0.2.x version link to it.
WASI_MONOTONIC_CLOCK = "wasi:clocks/monotonic-clock@0.2.12"
TIMER_REFUSED = (b"a LIP cannot sleep or wait on a timer (wasi:clocks/monotonic-clock subscribe): "
                 b"it would hold up the host's worker; wait on pred or recv instead")


# A component's stdout and stderr, keyed by process (see ComponentProcess._wasi_config). wasmtime
# writes them on its tokio threads, and drops the writer there too: with a finalizer (wasmtime-py's
# stdout_custom registers one, in Python) a process dropped while the interpreter exited called
# into Python from that thread, which Python 3.11 ends with pthread_exit, and Rust aborted the
# host. So no finalizer: an entry leaves when its process is freed, and a write with none is dropped.
_output_targets: dict[int, weakref.ref] = {}
_output_keys = itertools.count(1)
_NO_FINALIZER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)()  # a null function pointer


@ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.POINTER(ctypes.c_ubyte), ctypes.c_size_t)
def _write_output(key, data, size):
    target = _output_targets.get(key or 0)
    process = target() if target is not None else None
    if process is not None:
        process._captured(ctypes.string_at(data, size))
    return size


# ---- values across the boundary ----

@dataclass
class Failed:
    """A call's `err(error-code)`."""

    code: ErrorCode


def _error_name(code: ErrorCode) -> str:
    return code.name.lower().replace("_", "-")


class _HostFunction:
    """One imported function: its Python handler and, after the first call, its types."""

    __slots__ = ("qualified_name", "handler", "params", "length_checks", "result", "ok_type", "err_type", "typed")

    def __init__(self, qualified_name: str, handler: Callable):
        self.qualified_name = qualified_name
        self.handler = handler
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

    def arguments(self, store, args, max_list: int) -> list:
        """The arguments as Python values. Converting goes element by element (2M ids took
        1.6 s and 120 MB), so lengths are read from the raw values first: a list over `max_list`
        elements or a string over MAX_TEXT_BYTES is refused before any conversion (wasmtime
        frees the raw values after the call either way)."""
        for i, check in enumerate(self.length_checks):
            if check is not None:
                check(args[i], max_list)
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


def _length_check(ty) -> Callable[[Any, int], None] | None:
    """For a type that may hold lists or strings: a function that raises InvalidArgument if a
    raw value of it holds a list over `max_list` elements or a string over MAX_TEXT_BYTES,
    reading lengths only. None for types that hold neither (built once per function)."""
    if isinstance(ty, wc.String):
        def check(raw, max_list: int) -> None:
            if raw.of.string.size > MAX_TEXT_BYTES:
                raise InvalidArgument(f"a string of {raw.of.string.size} bytes; the limit is {MAX_TEXT_BYTES}")
        return check
    if isinstance(ty, wc.ListType):
        element = _length_check(ty.element)

        def check(raw, max_list: int) -> None:
            size = raw.of.list.size
            if size > max_list:
                raise InvalidArgument(f"a list of {size} elements; the limit is {max_list}")
            if element is not None:
                for i in range(size):
                    element(raw.of.list.data[i], max_list)
        return check
    if isinstance(ty, wc.OptionType):
        payload = _length_check(ty.payload)
        if payload is None:
            return None
        return lambda raw, max_list: payload(raw.of.option.contents, max_list) if raw.of.option else None
    if isinstance(ty, (wc.RecordType, wc.TupleType)):
        is_record = isinstance(ty, wc.RecordType)
        parts = [_length_check(t) for t in ([t for _, t in ty.fields] if is_record else ty.elements)]
        if not any(parts):
            return None

        def check(raw, max_list: int) -> None:
            for i, part in enumerate(parts):
                if part is not None:
                    part(raw.of.record.data[i].val if is_record else raw.of.tuple.data[i], max_list)
        return check
    if isinstance(ty, wc.VariantType):
        cases = {name: _length_check(t) for name, t in ty.cases if t is not None}
        cases = {name: check for name, check in cases.items() if check is not None}
        if not cases:
            return None

        def check(raw, max_list: int) -> None:
            case = cases.get(ffi.to_str(raw.of.variant.discriminant))
            if case is not None and raw.of.variant.val:
                case(raw.of.variant.val.contents, max_list)
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
    """Run the handler for the process being polled, through the same entry as a core
    module's calls (SystemCalls.dispatch: rate limit, errors); an error becomes Failed."""
    process = polling_fiber().owner
    calls = process.abi
    max_list = max(MAX_TOKENS_PER_PRED, calls.vocab_size())  # ids, or one entry per vocabulary token
    return process.syscalls.dispatch(
        function.qualified_name, Failed, lambda: function.handler(calls, *function.arguments(store, args, max_list)))


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
    """A call that may block: a handler's `Wait` suspends the guest on a Pending the process
    completes later (Process.block_on). Never raises; always hands wasmtime a continuation."""
    slot = continuation.contents
    slot.callback = _continue_ready
    function = _FUNCTIONS.get(key)
    store = wasmtime.StoreContext(context)
    try:
        function.learn_types(ty_raw)
        function.check_arity(nargs, nresults)
        outcome = _invoke(function, store, args)
        if isinstance(outcome, Wait):
            pending = polling_fiber().owner.block_on(outcome, None)
            waiting_key = next(_next_key)
            _WAITING[waiting_key] = _Waiting(pending, function, context, results, error_ret)
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
def _forget_waiting(waiting_key) -> None:
    waiting = _WAITING.pop(waiting_key, None)
    if waiting is not None:
        waiting.pending.abandoned = not waiting.pending.done


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _forget_function(key) -> None:
    _FUNCTIONS.pop(key, None)


@ffi.wasmtime_component_func_callback_t
def _refuse_timer(key, context, ty_raw, args, nargs, results, nresults):
    """wasi:clocks/monotonic-clock's subscribe-duration and subscribe-instant: the guest traps."""
    return ctypes.cast(ffi.wasmtime_error_new(TIMER_REFUSED), ctypes.c_void_p).value


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _forget_nothing(_key) -> None:
    """The finalizer of a host function that keeps no data."""


def _drop_distribution(store, rep: int) -> None:
    """The guest dropped a `distribution`: free it in the process that owns it (the one being
    polled: only its guest code drops its resources). Never raises: wasmtime-py parks
    exceptions in a global."""
    fiber = polling_fiber()
    if fiber is not None and isinstance(fiber.owner, ComponentProcess):
        fiber.owner.abi.distributions.pop(rep, None)


# ---- the system calls, in component values ----

def _want_of(want: Any, vocab_size: int) -> Want:
    if want.tag == "distribution":
        return Distribution()
    if want.tag == "top-k":
        return TopK(want.payload)
    if want.tag == "greedy-each":
        return GreedyEach()
    record = want.payload
    allowed = record.allowed
    if (allowed is not None and len(allowed) > vocab_size) or len(record.bias) > vocab_size:
        raise InvalidArgument(f"sampling: allowed ids and biases are at most the vocabulary size {vocab_size}")
    # Record fields keep their WIT (kebab-case) names.
    return Sample(temperature=record.temperature, top_p=getattr(record, "top-p"), top_k=getattr(record, "top-k"),
                  seed=record.seed, logit_bias=dict(record.bias),
                  allowed_tokens=None if allowed is None else tuple(allowed))


class ComponentCalls:
    """The component ABI of one process's system calls: component values in and out, over its
    `SystemCalls` (raising SymphonyError for `err`). What only this ABI has: a pred's
    distribution stays on the host behind a `distribution` resource, with methods."""

    def __init__(self, calls: SystemCalls):
        self.calls = calls
        self.process = calls.process
        # rep -> probabilities (float32, on the host) of this process's live `distribution`s;
        # reps are this process's own, so no handle reaches another process's distribution.
        self.distributions: dict[int, torch.Tensor] = {}
        self._last_rep = 0
        calls.host_distribution_bytes = self._distribution_bytes

    # model
    def vocab_size(self) -> int:
        return self.calls.vocab_size()

    def eos_ids(self) -> list[int]:
        return self.calls.eos_ids()

    def bos_id(self) -> int:
        return self.calls.bos_id()

    def model_name(self) -> str:
        return self.calls.model_name()

    # tokens
    def tokenize(self, text: str, add_special: bool):
        outcome = self.calls.tokenize(text, add_special)
        if isinstance(outcome, Wait):
            outcome.encode, outcome.failed = _listed_ids, Failed
            return outcome
        return _listed_ids(None, outcome)

    def detokenize(self, ids: list[int]) -> str:
        return self.calls.detokenize(ids)

    # KV files
    def kv_create(self) -> int:
        return self.calls.kv_create()

    def kv_open(self, path: str, flags: int) -> int:
        return self.calls.kv_open(path, flags)

    def kv_fork(self, kv: int) -> int:
        return self.calls.kv_fork(kv)

    def kv_extract(self, kv: int, start: int, end: int) -> int:
        return self.calls.kv_extract(kv, start, end)

    def kv_merge(self, first: int, second: int) -> int:
        return self.calls.kv_merge(first, second)

    def kv_len(self, kv: int) -> int:
        return self.calls.kv_len(kv)

    def kv_truncate(self, kv: int, length: int) -> None:
        self.calls.kv_truncate(kv, length)

    def kv_close(self, kv: int) -> None:
        self.calls.kv_close(kv)

    def kv_remove(self, path: str) -> None:
        self.calls.kv_remove(path)

    def kv_hint(self, kv: int, flags: int, keep_for_ms: int, priority: int) -> None:
        self.calls.kv_hint(kv, flags, keep_for_ms, priority)

    def kv_open_prefix(self, ids: list[int]) -> int:
        return self.calls.kv_open_prefix(ids)

    def kv_cache_prefix(self, kv: int) -> int:
        return self.calls.kv_cache_prefix(kv)

    # inference
    def pred_submit(self, kv: int, ids: list[int], positions: list[int] | None, want) -> int:
        return self.calls.pred_submit(kv, ids, positions, _want_of(want, self.vocab_size()))

    def pred(self, kv: int, ids: list[int], positions: list[int] | None, want):
        return self.pred_wait(self.pred_submit(kv, ids, positions, want))

    def pred_wait(self, ticket: int):
        request = self.calls.tickets.get(ticket)
        outcome = self.calls.pred_wait(ticket, None)
        if isinstance(outcome, Wait):
            outcome.encode = lambda _memory, result: self._answer(result, request.want)
            outcome.failed = Failed
            return outcome
        return self._answer(outcome, request.want)

    def _answer(self, result, want: Want):
        """A pred's answer as the WIT's variant: a distribution as a host resource."""
        if isinstance(want, Distribution):
            rep = self._new_rep()
            self.distributions[rep] = result.probs.float().cpu()
            return wc.Variant("distribution", wc.ResourceHost.own(rep, DISTRIBUTION_RESOURCE_TYPE))
        if isinstance(want, TopK):
            return wc.Variant("top-k", list(zip(result.top_ids, result.top_logprobs)))
        if isinstance(want, GreedyEach):
            return wc.Variant("tokens", list(result.tokens))
        return wc.Variant("token", result.token)

    # the distribution resource
    def _new_rep(self) -> int:
        """A rep no live distribution of this process has: a u32 (what the C API carries),
        never 0, wrapping around past 2**32 - 1 (the live ones are few: distribution_bytes)."""
        rep = self._last_rep
        while True:
            rep = rep % 0xFFFFFFFF + 1
            if rep not in self.distributions:
                self._last_rep = rep
                return rep

    def _distribution_bytes(self) -> int:
        return sum(probs.numel() * probs.element_size() for probs in self.distributions.values())

    def _probs(self, rep: int) -> torch.Tensor:
        probs = self.distributions.get(rep)  # this process's own: ownership is checked by looking here
        if probs is None:
            raise BadHandle("this distribution was dropped")
        return probs

    def distribution_argmax(self, rep: int) -> int:
        return int(self._probs(rep).argmax())

    def distribution_top_k(self, rep: int, k: int) -> list[tuple[int, float]]:
        probs = self._probs(rep)
        if not 0 < k <= probs.numel():
            raise InvalidArgument(f"k must be in [1, {probs.numel()}]")
        values, ids = probs.topk(k)
        return [(int(i), math.log(v) if v > 0 else -math.inf) for i, v in zip(ids.tolist(), values.tolist())]

    def distribution_logprob(self, rep: int, token: int) -> float:
        probs = self._probs(rep)
        if not 0 <= token < probs.numel():
            raise InvalidArgument(f"token must be in [0, {probs.numel()})")
        p = float(probs[token])
        return math.log(p) if p > 0 else -math.inf

    def distribution_sample(self, rep: int, temperature: float, top_p: float, seed: int) -> int:
        probs = self._probs(rep)
        if not (0 <= temperature < math.inf and 0 < top_p <= 1):  # (NaN fails both)
            raise InvalidArgument("temperature must be finite and >= 0, and top-p in (0, 1]")
        if temperature == 0:
            return int(probs.argmax())
        weights = probs.double().clamp_min(1e-30).log().div(temperature).softmax(0)
        if top_p < 1:
            ordered, order = weights.sort(descending=True)
            drop = ordered.cumsum(0) - ordered >= top_p
            weights = weights.scatter(0, order, ordered.masked_fill(drop, 0.0))
        generator = torch.Generator().manual_seed(seed)
        return int(torch.multinomial(weights, 1, generator=generator))

    # I/O
    def send(self, text: str) -> None:
        self.calls.send(text.encode("utf-8", "replace"))

    def recv(self):
        outcome = self.calls.recv(None)
        if isinstance(outcome, Wait):
            outcome.encode, outcome.failed = _text_of, Failed
            return outcome
        return _text_of(None, outcome)

    def tool(self, name: str, text: str) -> str:
        return self.calls.tool(name, text)

    def close(self) -> None:
        self.distributions.clear()


def _listed_ids(_memory, ids: list[int]) -> list[int]:
    """Token ids for a component: a list crosses element by element, so at most a pred's worth."""
    if len(ids) > MAX_TOKENS_PER_PRED:
        raise InvalidArgument(f"tokenize gives at most {MAX_TOKENS_PER_PRED} ids; split the text")
    return ids


def _text_of(_memory, message: bytes) -> str:
    return message.decode("utf-8", "replace")


# interface -> {WIT function name: (ComponentCalls method, blocking)}
_INTERFACES: dict[str, dict[str, tuple[Callable, bool]]] = {
    "errors": {},
    "model": {"vocab-size": (ComponentCalls.vocab_size, False), "eos-ids": (ComponentCalls.eos_ids, False),
              "bos-id": (ComponentCalls.bos_id, False), "model-name": (ComponentCalls.model_name, False)},
    "tokens": {"tokenize": (ComponentCalls.tokenize, True), "detokenize": (ComponentCalls.detokenize, False)},
    "kv": {name.replace("_", "-"): (getattr(ComponentCalls, name), False) for name in (
        "kv_create", "kv_open", "kv_fork", "kv_extract", "kv_merge", "kv_len", "kv_truncate", "kv_close",
        "kv_remove", "kv_hint", "kv_open_prefix", "kv_cache_prefix")},
    "inference": {
        "pred-submit": (ComponentCalls.pred_submit, False), "pred-wait": (ComponentCalls.pred_wait, True),
        "pred": (ComponentCalls.pred, True),
        "[method]distribution.argmax": (ComponentCalls.distribution_argmax, False),
        "[method]distribution.top-k": (ComponentCalls.distribution_top_k, False),
        "[method]distribution.logprob": (ComponentCalls.distribution_logprob, False),
        "[method]distribution.sample": (ComponentCalls.distribution_sample, False),
    },
    "io": {"send": (ComponentCalls.send, False), "recv": (ComponentCalls.recv, True)},
    "tools": {"tool": (ComponentCalls.tool, False)},
}


class ComponentLinker:
    """WASI preview 2 and our interfaces, for any number of component stores."""

    def __init__(self, engine: wasmtime.Engine):
        self.engine = engine
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
            for interface, calls in _INTERFACES.items():
                with root.add_instance(f"{PACKAGE}/{interface}@{PACKAGE_VERSION}") as instance:
                    if interface == "inference":
                        instance.add_resource("distribution", wc.ResourceType.host(DISTRIBUTION_RESOURCE_TYPE),
                                              _drop_distribution)
                    for name, (method, blocking) in calls.items():
                        self._define(instance, f"{interface}.{name}", name, method, blocking)

    @staticmethod
    def _define(instance: wc.LinkerInstance, qualified_name: str, name: str, method, blocking: bool) -> None:
        key = next(_next_key)
        _FUNCTIONS[key] = _HostFunction(qualified_name, method)
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


class ComponentProcess(Process):
    """A process whose program is a component: `print()` goes to its log, `run()`'s return value
    is its exit code."""

    __slots__ = ("_log_failure_logged",)
    POLLS_TO_RESUME = 2  # the first only finishes the blocking call (Process._advance)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._log_failure_logged = False

    def _wasi_config(self, program, args, env) -> wasmtime.WasiConfig:
        wasi = super()._wasi_config(program, args, env)
        # WASI preview 2 has no fd_write of ours to override: output streams call back, from
        # wasmtime's tokio threads (see _write_output). The table holds the process weakly, so an
        # ended process is freed (a strong reference kept both alive forever: 7 MB each).
        key = next(_output_keys)
        _output_targets[key] = weakref.ref(self, lambda _, key=key: _output_targets.pop(key, None))
        for set_custom in (ffi.wasi_config_set_stdout_custom, ffi.wasi_config_set_stderr_custom):
            set_custom(wasi.ptr(), _write_output, key, _NO_FINALIZER)
        return wasi

    def _captured(self, data: bytes) -> None:
        try:
            self.capture_log(data)
        except SymphonyError:
            pass  # past its output limit: the process is being killed, and the bytes refused
        except Exception:  # a failing on_log must not fail the guest's write
            # Once per process: a guest writing in a loop would otherwise log a traceback per write.
            if not self._log_failure_logged:
                self._log_failure_logged = True
                log.exception("pid %s: log callback failed (logged once per process)", self.pid)

    def _abi(self) -> ComponentCalls:
        return ComponentCalls(self.syscalls)

    def memory_for(self, call):
        return None  # component calls take values, never guest addresses

    def _main_fiber(self, instance) -> Fiber:
        return call_run(self.store, instance, owner=self)

    def _end(self, state, code, reason) -> None:
        self.abi.close()
        super()._end(state, code, reason)
