"""The `symphony` import module: one function per system call of wit/symphony.wit.

Each call turns guest bytes into typed arguments once, here, through `GuestMemory`, calls
KVFS / the engine / the process's I/O, and returns an i32: the result, or a negative
`ErrorCode`. A blocking call (`pred_wait`, `recv`, a long `tokenize`) returns a `Block`
instead: what to wait for and how to produce the result once it is there. Nothing here raises into wasmtime: every
exception becomes an error code (unexpected ones `INTERNAL`, and are logged).
"""
from __future__ import annotations

import logging
import os
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from .errors import (BadHandle, BufferTooSmall, ErrorCode, InputClosed, InvalidArgument, LimitExceeded,
                     SymphonyError)
from .guest_memory import GuestMemory
from .limits import check_kv_pages
from .pred_future import PredFuture
from .prefix_cache import PrefixCache, TrackedFile
from .sampling import GREEDY, Distribution, GreedyEach, Sample, TopK, Want
from .scheduler import PredRequest

if TYPE_CHECKING:
    from .process import Process

log = logging.getLogger("symphony.hostcalls")

KIND_DISTRIBUTION, KIND_TOPK, KIND_SAMPLE, KIND_GREEDY_EACH = 0, 1, 2, 3
SAMPLING_RECORD = struct.Struct("<ffiiQiiiii4x")  # sym_sampling: 48 bytes
MAX_TOKENS_PER_PRED = 1 << 16
MAX_TEXT_BYTES = 1 << 20
# Longer texts are tokenized on the engine's tokenizer thread while their process waits: a MiB
# held the worker, and every process it runs, for 0.5-1.7 s. Shorter ones (~10 ms) are done inline.
INLINE_TOKENIZE_CHARS = 16 * 1024
WASI_EBADF, WASI_EFAULT, WASI_EINVAL, WASI_EIO, WASI_ENOTSUP = 8, 21, 28, 29, 58
# poll_oneoff's records: a subscription (userdata, tag, then a clock's id, timeout, precision and
# flags, or an fd's number in the id's place) and an event (userdata, error, type, nbytes, flags).
SUBSCRIPTION = struct.Struct("<QB7xIxxxxQQH6x")
EVENT = struct.Struct("<QHB5xQH6x")
WASI_EVENT_CLOCK, WASI_EVENT_FD_READ, WASI_EVENT_FD_WRITE = 0, 1, 2
WASI_CLOCK_REALTIME, WASI_CLOCK_MONOTONIC = 0, 1
WASI_SUBSCRIPTION_CLOCK_ABSTIME = 1
WASI_EVENT_FD_READWRITE_HANGUP = 1
MAX_POLL_SUBSCRIPTIONS = 4096
MIN_SLEEP_S = 0.001  # a sleep that waits at all waits this long at least (Linux's timer slack is 50 us)
T = TypeVar("T")


@dataclass(slots=True)
class Block:
    """A blocking call: wait for `future` (None: for the process's inbox), then
    `finish(memory, *args)` gives the call's result, writing outputs into guest memory on the
    process's own thread. If `finish` raises, `failed(code)` is the result (a core module's
    int, a component's Failed): the process (Process.finish_block) applies it, so no exception
    reaches wasmtime. (`args` rather than a closure: the blocking pred builds one per token.)"""

    state: str
    future: PredFuture | None
    finish: Callable[..., Any]
    failed: Callable[[ErrorCode], Any] = int
    args: tuple = ()
    cancel: Callable[[], None] | None = None  # called if the process ends while it waits


def _signature_of(func) -> int:
    return func.__code__.co_argcount - 2  # minus self and memory


class HostCalls:
    """The system calls of one process, each entered through `dispatch`."""

    __slots__ = ("process", "engine", "kv", "tickets", "_next_ticket", "prefix_cache", "prefix_files", "last_limit",
                 "_failures_logged", "host_distribution_bytes", "_distribution_into")

    def __init__(self, process: "Process"):
        self.process = process
        self.engine = process.engine
        self.kv = process.kv
        self.tickets: dict[int, PredRequest] = {}  # pred_submit tickets not yet waited for
        self._next_ticket = 1
        self.prefix_cache = PrefixCache(self.kv.fs)
        self.prefix_files: dict[int, TrackedFile] = {}  # handles from kv_open_prefix
        self.last_limit: str | None = None  # the message of the last LIMIT_EXCEEDED, for the server
        self._failures_logged: set[str] = set()  # calls whose unexpected failure was logged
        # What `distribution` resources of a component hold on the host (component.py).
        self.host_distribution_bytes: Callable[[], int] = lambda: 0
        # The last blocking pred's distribution buffer: (guest address, the want writing there).
        self._distribution_into: tuple[int, Distribution] | None = None

    # The import table: name -> number of i32 parameters (checked against the WIT by a test).
    @classmethod
    def table(cls) -> dict[str, int]:
        return {name: _signature_of(getattr(cls, name)) for name in CALLS}

    @classmethod
    def wasi_table(cls) -> dict[str, int]:
        """The WASI preview 1 functions served here instead of by wasmtime -> their arity."""
        return {name: _signature_of(getattr(cls, name)) for name in WASI_CALLS}

    def dispatch(self, name: str, failed: Callable[[ErrorCode], T], run: Callable[..., T], *args) -> T:
        """The one way into a system call, from a core module or a component: charges the
        host-call rate limit, then `run(*args)`; an error becomes `failed(code)`. An unexpected
        exception (a host bug, a broken tool) becomes INTERNAL, its traceback logged once per
        process and call: a guest calling it in a loop must not flood the server's log."""
        try:
            usage = self.process.usage  # usage.charge_hostcall(), inline: on every host call
            usage.hostcalls += 1
            if usage.hostcalls >= usage.check_at:
                usage.check_rate()
            return run(*args)
        except SymphonyError as error:
            self._error_code(error)
            return failed(error.code)
        except Exception:  # a host bug must not become a host crash
            if name not in self._failures_logged:
                self._failures_logged.add(name)
                log.exception("pid %s: host call %s failed (logged once per process)", self.process.pid, name)
            return failed(ErrorCode.INTERNAL)

    def _error_code(self, error: SymphonyError) -> int:
        if isinstance(error, LimitExceeded):
            self.last_limit = str(error)
        return int(error.code)

    # ---- model ----

    def vocab_size(self, mem: GuestMemory) -> int:
        return self.engine.loaded.config.vocab_size

    def eos_ids(self, mem: GuestMemory, out_ptr: int, cap: int) -> int:
        ids = list(self.engine.loaded.eos_token_ids)
        if cap < 0:
            raise InvalidArgument("cap must be >= 0")
        mem.check(out_ptr, 4 * cap)
        mem.write_i32s(out_ptr, ids[:cap])
        return len(ids)

    def bos_id(self, mem: GuestMemory) -> int:
        bos = self.engine.loaded.bos_token_id
        return int(ErrorCode.UNSUPPORTED) if bos is None else bos

    def model_name(self, mem: GuestMemory, out_ptr: int, cap: int) -> int:
        return self._write_text(mem, self.engine.loaded.name.encode(), out_ptr, cap)

    # ---- tokens ----

    def tokenize(self, mem: GuestMemory, text_ptr: int, text_len: int, flags: int, out_ptr: int,
                 cap: int) -> int | Block:
        if not 0 <= text_len <= MAX_TEXT_BYTES or flags not in (0, 1) or cap < 0:
            raise InvalidArgument("tokenize: text length, flags or cap out of range")
        text = mem.read_str(text_ptr, text_len)
        mem.check(out_ptr, 4 * cap)

        def finish(mem: GuestMemory, ids: list[int]) -> int:
            mem.write_i32s(out_ptr, ids[:cap])
            return len(ids)

        return self.tokenized(mem, text, bool(flags & 1), finish, int)

    def tokenized(self, mem: GuestMemory | None, text: str, add_special: bool, finish: Callable[..., T],
                  failed: Callable[[ErrorCode], T]) -> T | Block:
        """`finish(mem, ids)` for the token ids of `text` (component.py calls this too): at once
        for a short text, else a Block while the engine's tokenizer thread works (INLINE_TOKENIZE_CHARS),
        its CPU time charged to this process."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return finish(mem, self.engine.tokenize(text, add_special_tokens=add_special))
        future = self.engine.tokenize_later(text, add_special)

        def tokenized(mem: GuestMemory) -> T:
            ids, cpu_time_s = future.result()
            self.process.cpu_time_s += cpu_time_s
            return finish(mem, ids)

        return Block("blocked-on-tokenize", future, tokenized, failed)

    def detokenize(self, mem: GuestMemory, ids_ptr: int, n: int, out_ptr: int, cap: int) -> int:
        if not 0 <= n <= MAX_TOKENS_PER_PRED or cap < 0:
            raise InvalidArgument("detokenize: count or cap out of range")
        ids = mem.read_i32s(ids_ptr, n)
        vocab = self.engine.loaded.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise InvalidArgument(f"token ids must be in [0, {vocab})")
        return self._write_text(mem, self.engine.detokenize(ids).encode(), out_ptr, cap)

    @staticmethod
    def _write_text(mem: GuestMemory, data: bytes, out_ptr: int, cap: int) -> int:
        if cap < 0:
            raise InvalidArgument("cap must be >= 0")
        mem.check(out_ptr, cap)
        mem.write(out_ptr, data[:cap])
        return len(data)

    # ---- KV files ----

    def kv_create(self, mem: GuestMemory) -> int:
        return self.kv.create()

    def kv_open(self, mem: GuestMemory, path_ptr: int, path_len: int, flags: int) -> int:
        return self.kv.open(self._path(mem, path_ptr, path_len), flags)

    def kv_fork(self, mem: GuestMemory, kv: int) -> int:
        return self._within_kv_pages(self.kv.fork(kv))

    def kv_extract(self, mem: GuestMemory, kv: int, start: int, end: int) -> int:
        return self._within_kv_pages(self.kv.extract(kv, start, end))

    def kv_merge(self, mem: GuestMemory, first: int, second: int) -> int:
        return self._within_kv_pages(self.kv.merge(first, second))

    def _within_kv_pages(self, new_handle: int) -> int:
        """A file just made by fork/extract/merge, unless it took the process past its page limit."""
        try:
            check_kv_pages(self.process)
        except LimitExceeded:
            self.kv.close(new_handle)
            raise
        return new_handle

    def kv_len(self, mem: GuestMemory, kv: int) -> int:
        return self.kv.len(kv)

    def kv_truncate(self, mem: GuestMemory, kv: int, length: int) -> int:
        self.kv.truncate(kv, length)
        if kv in self.prefix_files:
            del self.prefix_files[kv].ids[length:]
        return 0

    def kv_close(self, mem: GuestMemory, kv: int) -> int:
        self.kv.close(kv)
        self.prefix_files.pop(kv, None)
        return 0

    def kv_remove(self, mem: GuestMemory, path_ptr: int, path_len: int) -> int:
        self.kv.remove(self._path(mem, path_ptr, path_len))
        return 0

    def kv_open_prefix(self, mem: GuestMemory, ids_ptr: int, n: int) -> int:
        """A new file holding the longest cached prefix of the ids (prefix_cache.py)."""
        if not 0 < n <= MAX_TOKENS_PER_PRED:
            raise InvalidArgument(f"kv_open_prefix takes 1 to {MAX_TOKENS_PER_PRED} token ids, got {n}")
        handle, tracked = self.prefix_cache.open_longest(self.kv, mem.read_i32s(ids_ptr, n))
        self.prefix_files[handle] = tracked
        return handle

    def kv_cache_prefix(self, mem: GuestMemory, kv: int) -> int:
        tracked = self.prefix_files.get(kv)
        if tracked is None:
            raise BadHandle(f"KV handle {kv} was not opened by kv_open_prefix")
        return self.prefix_cache.offer(self.kv, kv, tracked)

    def kv_hint(self, mem: GuestMemory, kv: int, flags: int, keep_for_ms: int, priority: int) -> int:
        if flags & ~3:
            raise InvalidArgument("kv_hint flags: 1 pinned, 2 drop on close")
        self.kv.set_hints(kv, pinned=bool(flags & 1), drop_on_close=bool(flags & 2),
                          keep_for_s=None if keep_for_ms < 0 else keep_for_ms / 1000, priority=priority)
        return 0

    @staticmethod
    def _path(mem: GuestMemory, ptr: int, length: int) -> str:
        if not 0 < length <= 1024:
            raise InvalidArgument("a KV path is 1 to 255 bytes")
        return mem.read_str(ptr, length)

    # ---- inference ----

    def pred_submit(self, mem: GuestMemory, kv: int, ids_ptr: int, pos_ptr: int, n: int, kind: int, arg: int) -> int:
        return self.submit(kv, *self._pred_request(mem, ids_ptr, pos_ptr, n, kind, arg))

    def _pred_request(self, mem: GuestMemory, ids_ptr: int, pos_ptr: int, n: int, kind: int,
                      arg: int) -> tuple[list[int], list[int] | None, Want]:
        """The tokens, positions and wanted output of a pred, read from the guest's arguments."""
        if not 0 < n <= MAX_TOKENS_PER_PRED:
            raise InvalidArgument(f"pred takes 1 to {MAX_TOKENS_PER_PRED} tokens, got {n}")
        tokens = mem.read_i32s(ids_ptr, n)
        positions = mem.read_i32s(pos_ptr, n) if pos_ptr else None
        if kind == KIND_SAMPLE:
            want: Want = self._read_sampling(mem, arg) if arg else GREEDY
        elif kind == KIND_DISTRIBUTION:
            want = Distribution()
        elif kind == KIND_TOPK:
            want = TopK(arg)
        elif kind == KIND_GREEDY_EACH:
            want = GreedyEach()
        else:
            raise InvalidArgument(f"pred kind must be 0 (distribution), 1 (top-k), 2 (sample) or 3 (greedy each), "
                                  f"got {kind}")
        return tokens, positions, want

    def submit(self, kv: int, tokens: list[int], positions: list[int] | None, want: Want) -> int:
        """Queue a pred for the engine and return its ticket (component.py calls this too)."""
        request = self._queue(kv, tokens, positions, want)
        ticket = self._next_ticket
        self._next_ticket += 1
        self.tickets[ticket] = request
        return ticket

    def _queue(self, kv: int, tokens: list[int], positions: list[int] | None, want: Want) -> PredRequest:
        """The checks every pred passes, then the engine's queue. (A blocking `pred` takes no
        ticket, so it is not among the tickets counted here; it needs no room there either: its
        guest is suspended until it is answered, and the checks ran before it was queued.)"""
        limits = self.process.limits
        if len(self.tickets) >= limits.preds_in_flight:
            raise LimitExceeded(f"at most {limits.preds_in_flight} preds in flight per process")
        if limits.kv_pages is not None:  # (no call without the limit: once per pred)
            check_kv_pages(self.process, kv, len(tokens))
        if isinstance(want, Distribution):
            self._check_distribution_bytes()
        request = self.engine.submit_request(self.kv, kv, tokens, positions, want)
        if kv in self.prefix_files:
            self.prefix_files[kv].ids.extend(tokens)
        return request

    def _check_distribution_bytes(self) -> None:
        """Refuse one more distribution past the process's `distribution_bytes`: those of the
        preds in flight (their results wait on the host) and a component's live resources."""
        limit = self.process.limits.distribution_bytes
        one = 4 * self.engine.loaded.config.vocab_size  # float32 per token
        tickets = self.tickets  # (none, for a blocking pred: no generator to run)
        in_flight = sum(isinstance(ticket.want, Distribution) for ticket in tickets.values()) if tickets else 0
        held = in_flight * one + self.host_distribution_bytes()
        if held + one > limit:
            raise LimitExceeded(f"distribution memory limit per process: {held} of {limit} bytes held, "
                                f"one more takes {one}; drop distributions you no longer need")

    def _read_sampling(self, mem: GuestMemory, ptr: int) -> Sample:
        (temperature, top_p, top_k, has_seed, seed, allowed_ptr, n_allowed, bias_ids_ptr, bias_values_ptr,
         n_bias) = SAMPLING_RECORD.unpack(mem.read(ptr, SAMPLING_RECORD.size))
        vocab = self.engine.loaded.config.vocab_size
        if not 0 <= n_allowed <= vocab or not 0 <= n_bias <= vocab:
            raise InvalidArgument(f"sampling: n_allowed and n_bias are at most the vocabulary size {vocab}")
        allowed = tuple(mem.read_i32s(allowed_ptr, n_allowed)) if allowed_ptr else None
        bias = {}
        if n_bias:
            ids = mem.read_i32s(bias_ids_ptr, n_bias)
            values = struct.unpack(f"<{n_bias}f", mem.read(bias_values_ptr, 4 * n_bias))
            bias = dict(zip(ids, values))
        return Sample(temperature=temperature, top_p=top_p, top_k=top_k,
                      seed=seed if has_seed else None, logit_bias=bias, allowed_tokens=allowed)

    def pred_wait(self, mem: GuestMemory, ticket: int, out_ptr: int, cap: int) -> int | Block:
        entry = self.tickets.get(ticket)
        if entry is None:
            raise BadHandle(f"pred ticket {ticket} is not in flight in this process")
        if cap < 0:
            raise InvalidArgument("cap must be >= 0")

        def finish(mem: GuestMemory) -> int:
            mem.check(out_ptr, 4 * cap)
            answer = self._answer(mem, entry.future, entry.want, out_ptr, cap)
            if answer is None:
                return int(ErrorCode.BUFFER_TOO_SMALL)  # the ticket stays: call again
            del self.tickets[ticket]
            return answer

        if entry.future.done():
            return finish(mem)
        return Block("blocked-on-pred", entry.future, finish)

    def _answer(self, mem: GuestMemory, future: PredFuture, want: Want, out_ptr: int, cap: int) -> int | None:
        """Write a completed pred's output at out_ptr (room for `cap` values); its return value
        (the token, or the count written), an error code, or None if `cap` is too small."""
        try:
            result = future.result()
        except SymphonyError as error:
            return self._error_code(error)
        if isinstance(want, Sample):
            return result.token
        if isinstance(want, Distribution):
            vocab = result.vocab_size
            if cap < vocab:
                return None
            into = want.into  # the buffer at out_ptr, when the pred was queued with it
            out = into if into is not None and into.numel() == vocab else mem.f32_tensor(out_ptr, vocab)
            if out is None:  # not aligned for float32s: through a tensor of its own
                mem.write_tensor(out_ptr, result.probs)
            else:
                result.write_probs(out)
            return vocab
        if isinstance(want, TopK):
            k = len(result.top_ids)
            if cap < 2 * k:
                return None
            mem.write(out_ptr, struct.pack(f"<{k}i{k}f", *result.top_ids, *result.top_logprobs))
            return k
        n = len(result.tokens)  # GreedyEach
        if cap < n:
            return None
        mem.write_i32s(out_ptr, result.tokens)
        return n

    def pred(self, mem: GuestMemory, kv: int, ids_ptr: int, pos_ptr: int, n: int, kind: int, arg: int,
             out_ptr: int, cap: int) -> int | Block:
        """pred_submit and pred_wait in one blocking call (the paper's `pred`): one host call per
        token instead of two, and no ticket. The output's room is checked before anything is
        queued, so an error leaves nothing in flight (there is no ticket to call again with);
        a memory never shrinks, so the room is still there when the answer comes."""
        if cap < 0:
            raise InvalidArgument("cap must be >= 0")
        if kind != KIND_SAMPLE:
            needed = {KIND_DISTRIBUTION: self.engine.loaded.config.vocab_size, KIND_TOPK: 2 * arg,
                      KIND_GREEDY_EACH: n}.get(kind, 0)
            if cap < needed:
                raise BufferTooSmall(f"pred of kind {kind} writes {needed} values, cap is {cap}")
        mem.check(out_ptr, 4 * cap)
        tokens, positions, want = self._pred_request(mem, ids_ptr, pos_ptr, n, kind, arg)
        if kind == KIND_DISTRIBUTION:
            # The host's softmax goes straight into the guest's buffer as the batch is answered
            # (the guest is suspended until then, and its memory never moves; the request holds
            # the Store that owns that memory, so it outlives a kill meanwhile). A guest decodes
            # into one buffer token after token: its tensor is made once (a memory never moves
            # or shrinks, and one blocking pred at a time writes it). Measured at batch 1, after
            # each forward pass: 13 us a token for the tensor alone.
            cached = self._distribution_into
            if cached is not None and cached[0] == out_ptr:
                want = cached[1]
            else:
                into = mem.f32_tensor(out_ptr, self.engine.loaded.config.vocab_size)
                if into is not None:
                    want = Distribution(into=into, keep=self.process.store)
                    self._distribution_into = (out_ptr, want)
        # The room for the answer was checked above: `_answer` writes it whole (never None).
        future = self._queue(kv, tokens, positions, want).future
        if future.done():
            return self._answer(mem, future, want, out_ptr, cap)
        return Block("blocked-on-pred", future, self._answer, int, (future, want, out_ptr, cap))

    # ---- I/O ----

    def send(self, mem: GuestMemory, ptr: int, length: int) -> int:
        if not 0 <= length <= MAX_TEXT_BYTES:
            raise InvalidArgument(f"send takes at most {MAX_TEXT_BYTES} bytes")
        self.process.emit_output(mem.read(ptr, length))
        return 0

    def recv(self, mem: GuestMemory, out_ptr: int, cap: int) -> int | Block:
        if cap < 0:
            raise InvalidArgument("cap must be >= 0")
        mem.check(out_ptr, cap)

        def finish(mem: GuestMemory) -> int:
            message = self.process.peek_input()
            if message is None:
                raise InputClosed("the user closed the input")
            if len(message) > cap:
                raise BufferTooSmall(f"message of {len(message)} bytes")
            mem.write(out_ptr, message)
            self.process.pop_input()
            return len(message)

        if self.process.input_ready():
            return finish(mem)
        return Block("blocked-on-recv", None, finish)

    # ---- tools ----

    def tool(self, mem: GuestMemory, name_ptr: int, name_len: int, input_ptr: int, input_len: int,
             out_ptr: int, cap: int) -> int:
        """Calls an operator-registered tool (symphony_os/tools.py) inside the server."""
        if not 0 < name_len <= 64 or not 0 <= input_len <= MAX_TEXT_BYTES or cap < 0:
            raise InvalidArgument("tool: the name is 1 to 64 bytes, the input at most 1 MiB, cap >= 0")
        name, text = mem.read_str(name_ptr, name_len), mem.read_str(input_ptr, input_len)
        mem.check(out_ptr, cap)
        return self._write_text(mem, self.process.tools.call(name, text).encode(), out_ptr, cap)

    # ---- WASI ----

    def fd_write(self, mem: GuestMemory, fd: int, iovs_ptr: int, iovs_len: int, nwritten_ptr: int) -> int:
        """WASI preview 1 fd_write, for stdout (1) and stderr (2) only: both go to the process's
        log. Returns a WASI errno (0 ok, 8 badf, 21 fault, 28 inval, 29 io: past the output
        limit). Serving it here keeps guest output on the process's own thread (wasmtime's WASI
        would write from runtime threads of its own, which called back into Python from foreign
        threads). One call takes at most MAX_TEXT_BYTES, a partial write as POSIX allows
        (wasi-libc writes the rest in the calls after): 1,024 iovecs over the whole memory each
        were copied whole, 64 of them over 16 MiB took 2 GB of the host's memory before the
        output limit applied."""
        if fd not in (1, 2):
            return WASI_EBADF
        if not 0 <= iovs_len <= 1024:
            return WASI_EINVAL
        try:
            iovecs = mem.read_i32s(iovs_ptr, 2 * iovs_len)
            parts, room = [], MAX_TEXT_BYTES
            for i in range(iovs_len):
                ptr, length = iovecs[2 * i] & 0xFFFFFFFF, iovecs[2 * i + 1] & 0xFFFFFFFF
                mem.check(ptr, length)  # every buffer is valid, or none is written
                if room and length:
                    parts.append(mem.read(ptr, min(length, room)))
                    room -= len(parts[-1])
            data = b"".join(parts)
            mem.check(nwritten_ptr, 4)
        except SymphonyError:
            return WASI_EFAULT
        if data:
            try:
                self.process.capture_log(data)
            except LimitExceeded:
                return WASI_EIO  # past its output limit: it is being killed
        mem.write_i32s(nwritten_ptr, [len(data)])
        return 0

    def poll_oneoff(self, mem: GuestMemory, in_ptr: int, out_ptr: int, nsubscriptions: int,
                    nevents_ptr: int) -> int | Block:
        """WASI preview 1 poll_oneoff: sleep (C's sleep and nanosleep, Rust's thread::sleep)
        as a blocking call. wasmtime's own slept inside the host call, on the worker thread
        that runs every other guest: no time slice ended it, it used no CPU time, and a
        timeout of 2^64 ns held the runtime for good. Here the process waits on a timer
        (timers.py) like one waiting for a pred; the wall-time limit still ends it.
        Clock subscriptions (realtime or monotonic, relative or absolute) wait; stdout and
        stderr are always ready to write, stdin always at its end (a LIP's input is `recv`),
        any other descriptor is EBADF in its event, a CPU-time clock ENOTSUP: those answer at
        once. Returns a WASI errno (the call's own; each event carries its own error)."""
        if not 0 < nsubscriptions <= MAX_POLL_SUBSCRIPTIONS:
            return WASI_EINVAL
        try:
            data = mem.read(in_ptr, SUBSCRIPTION.size * nsubscriptions)
            mem.check(out_ptr, EVENT.size * nsubscriptions)
            mem.check(nevents_ptr, 4)
        except SymphonyError:
            return WASI_EFAULT
        now, wall = time.monotonic(), time.time()
        at_once, clocks = [], []  # events ready now; (deadline, userdata) of the clocks
        for i in range(nsubscriptions):
            userdata, tag, which, timeout, _precision, flags = SUBSCRIPTION.unpack_from(data, i * SUBSCRIPTION.size)
            if tag == WASI_EVENT_CLOCK:
                if which not in (WASI_CLOCK_REALTIME, WASI_CLOCK_MONOTONIC):
                    at_once.append((userdata, WASI_ENOTSUP, tag, 0, 0))
                elif flags & WASI_SUBSCRIPTION_CLOCK_ABSTIME:  # a time on that clock
                    # (the guest's monotonic clock counts from its WASI context's creation)
                    origin = now - wall if which == WASI_CLOCK_REALTIME else self.process.monotonic_origin
                    clocks.append((origin + timeout / 1e9, userdata))
                else:
                    clocks.append((now + timeout / 1e9, userdata))
            elif tag in (WASI_EVENT_FD_READ, WASI_EVENT_FD_WRITE):  # `which` is the descriptor
                if tag == WASI_EVENT_FD_WRITE and which in (1, 2):
                    at_once.append((userdata, 0, tag, MAX_TEXT_BYTES, 0))
                elif tag == WASI_EVENT_FD_READ and which == 0:
                    at_once.append((userdata, 0, tag, 0, WASI_EVENT_FD_READWRITE_HANGUP))
                else:
                    at_once.append((userdata, WASI_EBADF, tag, 0, 0))
            else:
                return WASI_EINVAL

        def events(mem: GuestMemory, ready: list) -> int:
            out = bytearray()
            for userdata, error, tag, nbytes, event_flags in ready:
                out += EVENT.pack(userdata, error, tag, nbytes, event_flags)
            mem.write(out_ptr, bytes(out))
            mem.write_i32s(nevents_ptr, [len(ready)])
            return 0

        def due(at: float) -> list:
            return [(userdata, 0, WASI_EVENT_CLOCK, 0, 0) for deadline, userdata in clocks if deadline <= at]

        earliest = min(deadline for deadline, _ in clocks) if clocks else now
        if at_once or earliest <= now:
            return events(mem, at_once + due(now))
        # At least MIN_SLEEP_S: each wait costs host work (the timer thread, a wake, a round)
        # that no guest is charged for, so a loop of 1 ns sleeps took twice the CPU it paid.
        timers = self.process.timers
        future = timers.at(max(earliest, now + MIN_SLEEP_S))
        return Block("blocked-on-sleep", future, lambda mem: events(mem, due(time.monotonic())), wasi_failure,
                     cancel=lambda: timers.cancel(future))

    def random_get(self, mem: GuestMemory, buf_ptr: int, length: int) -> int:
        """WASI preview 1 random_get, at most MAX_TEXT_BYTES a call (EINVAL beyond: the call
        has no partial fill, and a guest must not take unrandom bytes for random ones).
        wasmtime's took up to 64 MiB a call, 0.2 s of the worker thread's time in one call."""
        length &= 0xFFFFFFFF
        if length > MAX_TEXT_BYTES:
            return WASI_EINVAL
        try:
            mem.write(buf_ptr & 0xFFFFFFFF, os.urandom(length))
        except SymphonyError:
            return WASI_EFAULT
        return 0


def wasi_failure(_code: ErrorCode) -> int:
    """What a WASI function of ours answers when the host refuses or fails it (the rate limit,
    a host bug): EIO, a WASI errno, where our own calls answer a negative code."""
    return WASI_EIO


CALLS = ("vocab_size", "eos_ids", "bos_id", "model_name", "tokenize", "detokenize", "kv_create", "kv_open",
         "kv_fork", "kv_extract", "kv_merge", "kv_len", "kv_truncate", "kv_close", "kv_remove", "kv_hint",
         "kv_open_prefix", "kv_cache_prefix",
         "pred_submit", "pred_wait", "pred", "send", "recv", "tool")
# WASI preview 1 functions of ours, shadowing wasmtime's (each method says why). They answer a
# WASI errno; a call refused by the host-call rate limit (or failing inside) answers EIO.
WASI_CALLS = ("fd_write", "poll_oneoff", "random_get")
