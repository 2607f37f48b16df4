"""The core-module ABI (C, Rust, AssemblyScript LIPs): the `symphony` import module, one
function per system call of wit/symphony.wit, over the typed calls of `syscalls.py`, and the
WASI preview 1 functions Symphony serves itself.

Each function reads the guest's pointers once, here, through `GuestMemory`, calls the typed
call, and returns an i32: the result, or a negative `ErrorCode`; outputs go into the guest's
buffers. A call that waits returns its `syscalls.Wait`, whose `encode` writes the answer once it
is there. Nothing here raises into wasmtime: every error becomes a code (runtime.py enters each
call through `SystemCalls.dispatch`).
"""
from __future__ import annotations

import json
import os
import struct
import time

from ..engine.sampling import GREEDY, Distribution, GreedyEach, PredResult, Sample, ScoreEach, TopK, Want
from ..errors import ErrorCode, InvalidArgument, LimitExceeded, SymphonyError
from ..wasm.fiber import FastCall
from ..wasm.guest_memory import GuestMemory
from ..wasm.wit import core_signatures
from .syscalls import MAX_PATH_BYTES, MAX_TEXT_BYTES, MAX_TOKENS_PER_PRED, SystemCalls, Wait

KIND_DISTRIBUTION, KIND_TOPK, KIND_SAMPLE, KIND_GREEDY_EACH, KIND_SCORE_EACH = 0, 1, 2, 3, 4
SAMPLING_RECORD = struct.Struct("<ffiiQiiiiii")  # sym_sampling: 48 bytes
# Its `has_seed` field's bits: 1 the seed is used; 2 a SAMPLING_MORE record follows it (min-p,
# the repetition penalty and the ids it applies to, log-probabilities). Any other bit is refused.
SAMPLING_SEED, SAMPLING_MORE_FOLLOWS = 1, 2
SAMPLING_MORE = struct.Struct("<ffiiii")  # sym_sampling_more: 24 bytes
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
# WASI preview 1 functions of ours, shadowing wasmtime's (each method says why). They answer a
# WASI errno; a call refused by the host-call rate limit (or failing inside) answers EIO.
WASI_CALLS = ("fd_write", "poll_oneoff", "random_get")


def pred_fast_shape(vocab_size: int) -> FastCall:
    """The decode step most programs make on every token, in the shape fiber_native.c recognises
    (fiber.FastCall): `pred(kv, ids, NULL, 1, sample, 0, out, cap)`, the one token id inside
    memory and the vocabulary, `cap` >= 0 and the output buffer inside memory. Such a call
    passes every check `CoreCalls.pred` makes on its arguments, so lip/process.py takes it
    without decoding them again."""
    return FastCall("symphony", "pred", fixed={2: 0, 3: 1, 4: KIND_SAMPLE, 5: 0}, nonnegative=(7,), read_arg=1,
                    read_bound=vocab_size, span_arg=6, span_scale=4)


def pred_submit_fast_shape(vocab_size: int) -> FastCall:
    """`pred_submit(kv, ids, NULL, 1, sample, 0)` with the token inside memory and the vocabulary
    (see pred_fast_shape)."""
    return FastCall("symphony", "pred_submit", fixed={2: 0, 3: 1, 4: KIND_SAMPLE, 5: 0}, read_arg=1,
                    read_bound=vocab_size)


def pred_wait_fast_shape() -> FastCall:
    """`pred_wait(ticket, out, cap)` with `cap` >= 0 and the buffer inside memory: the checks
    `CoreCalls.pred_wait` makes on its arguments before it looks at the ticket."""
    return FastCall("symphony", "pred_wait", fixed={}, nonnegative=(2,), span_arg=1, span_scale=4)


def _signature_of(func) -> int:
    return func.__code__.co_argcount - 2  # minus self and memory


# What a blocking pred of kind distribution asks the engine for: its answer is taken at once,
# straight into the guest's buffer (sampling.Distribution).
_DISTRIBUTION_TAKEN_AT_ONCE = Distribution(taken_at_once=True)


def _sampled_token(_memory: GuestMemory, result: PredResult) -> int:
    return result.token


class CoreCalls:
    """The `symphony` imports of one core-module process, over its `SystemCalls`."""

    __slots__ = ("calls", "process", "_distribution_buffer")

    def __init__(self, calls: SystemCalls):
        self.calls = calls
        self.process = calls.process
        # The last distribution buffer written: (guest address, a float32 tensor over it). A
        # guest decodes into one buffer token after token: its tensor is made once (a memory
        # never moves or shrinks). Measured at batch 1, after each forward pass: 13 us a token
        # for the tensor alone.
        self._distribution_buffer: tuple[int, object] | None = None

    @classmethod
    def table(cls) -> dict[str, int]:
        """The import table: the WIT's calls, each with its number of i32 parameters."""
        return core_signatures()

    @classmethod
    def wasi_table(cls) -> dict[str, int]:
        """The WASI preview 1 functions served here instead of by wasmtime -> their arity."""
        return {name: _signature_of(getattr(cls, name)) for name in WASI_CALLS}

    # ---- model ----

    def vocab_size(self, mem: GuestMemory) -> int:
        return self.calls.vocab_size()

    def eos_ids(self, mem: GuestMemory, out_ptr: int, cap: int) -> int:
        if cap < 0:
            raise InvalidArgument("cap must be >= 0")
        mem.check(out_ptr, 4 * cap)
        ids = self.calls.eos_ids()
        mem.write_i32s(out_ptr, ids[:cap])
        return len(ids)

    def bos_id(self, mem: GuestMemory) -> int:
        return self.calls.bos_id()

    def model_name(self, mem: GuestMemory, out_ptr: int, cap: int) -> int:
        return _write_text(mem, self.calls.model_name().encode(), out_ptr, cap)

    # ---- tokens ----

    def tokenize(self, mem: GuestMemory, text_ptr: int, text_len: int, flags: int, out_ptr: int,
                 cap: int) -> int | Wait:
        if not 0 <= text_len <= MAX_TEXT_BYTES or flags not in (0, 1) or cap < 0:
            raise InvalidArgument("tokenize: text length, flags or cap out of range")
        text = mem.read_str(text_ptr, text_len)
        mem.check(out_ptr, 4 * cap)

        def write(mem: GuestMemory, ids: list[int]) -> int:
            mem.write_i32s(out_ptr, ids[:cap])
            return len(ids)

        outcome = self.calls.tokenize(text, bool(flags & 1))
        if isinstance(outcome, Wait):
            outcome.encode = write
            return outcome
        return write(mem, outcome)

    def chat_template(self, mem: GuestMemory, messages_ptr: int, messages_len: int, flags: int, out_ptr: int,
                      cap: int) -> int:
        if not 0 <= messages_len <= MAX_TEXT_BYTES or flags not in (0, 1) or cap < 0:
            raise InvalidArgument("chat-template: messages length, flags or cap out of range")
        mem.check(out_ptr, cap)
        try:
            data = json.loads(mem.read_str(messages_ptr, messages_len))
        except (ValueError, RecursionError):
            data = None
        tools = None
        if isinstance(data, dict) and set(data) <= {"messages", "tools"}:  # {"messages": [...], "tools": [...]}
            data, tools = data.get("messages"), data.get("tools")
        if not isinstance(data, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in data):
            raise InvalidArgument('chat-template: messages are JSON, a list of {"role": ..., "content": ...} strings '
                                  '(or {"messages": that list, "tools": [...]})')
        text = self.calls.chat_template([(m["role"], m["content"]) for m in data], bool(flags & 1), tools)
        return _write_text(mem, text.encode(), out_ptr, cap)

    def detokenize(self, mem: GuestMemory, ids_ptr: int, n: int, out_ptr: int, cap: int) -> int:
        if not 0 <= n <= MAX_TOKENS_PER_PRED or cap < 0:
            raise InvalidArgument("detokenize: count or cap out of range")
        ids = mem.read_i32s(ids_ptr, n)
        return _write_text(mem, self.calls.detokenize(ids).encode(), out_ptr, cap)

    # ---- KV files ----

    def kv_create(self, mem: GuestMemory) -> int:
        return self.calls.kv_create()

    def kv_open(self, mem: GuestMemory, path_ptr: int, path_len: int, flags: int) -> int:
        return self.calls.kv_open(_read_path(mem, path_ptr, path_len), flags)

    def kv_fork(self, mem: GuestMemory, kv: int) -> int:
        return self.calls.kv_fork(kv)

    def kv_extract(self, mem: GuestMemory, kv: int, start: int, end: int) -> int:
        return self.calls.kv_extract(kv, start, end)

    def kv_merge(self, mem: GuestMemory, first: int, second: int) -> int:
        return self.calls.kv_merge(first, second)

    def kv_len(self, mem: GuestMemory, kv: int) -> int:
        return self.calls.kv_len(kv)

    def kv_truncate(self, mem: GuestMemory, kv: int, length: int) -> int:
        self.calls.kv_truncate(kv, length)
        return 0

    def kv_close(self, mem: GuestMemory, kv: int) -> int:
        self.calls.kv_close(kv)
        return 0

    def kv_remove(self, mem: GuestMemory, path_ptr: int, path_len: int) -> int:
        self.calls.kv_remove(_read_path(mem, path_ptr, path_len))
        return 0

    def kv_open_prefix(self, mem: GuestMemory, ids_ptr: int, n: int) -> int:
        if not 0 < n <= MAX_TOKENS_PER_PRED:
            raise InvalidArgument(f"kv_open_prefix takes 1 to {MAX_TOKENS_PER_PRED} token ids, got {n}")
        return self.calls.kv_open_prefix(mem.read_i32s(ids_ptr, n))

    def kv_cache_prefix(self, mem: GuestMemory, kv: int) -> int:
        return self.calls.kv_cache_prefix(kv)

    def kv_hint(self, mem: GuestMemory, kv: int, flags: int, keep_for_ms: int, priority: int) -> int:
        self.calls.kv_hint(kv, flags, keep_for_ms, priority)
        return 0

    # ---- inference ----

    def pred_submit(self, mem: GuestMemory, kv: int, ids_ptr: int, pos_ptr: int, n: int, kind: int, arg: int) -> int:
        return self.calls.pred_submit(kv, *self._pred_request(mem, ids_ptr, pos_ptr, n, kind, arg))

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
        elif kind == KIND_SCORE_EACH:
            want = ScoreEach(arg)
        else:
            raise InvalidArgument(f"pred kind must be 0 (distribution), 1 (top-k), 2 (sample), 3 (greedy each) "
                                  f"or 4 (score each), got {kind}")
        return tokens, positions, want

    def _read_sampling(self, mem: GuestMemory, ptr: int) -> Sample:
        (temperature, top_p, top_k, flags, seed, allowed_ptr, n_allowed, bias_ids_ptr, bias_values_ptr,
         n_bias, grammar) = SAMPLING_RECORD.unpack(mem.read(ptr, SAMPLING_RECORD.size))
        vocab = self.calls.vocab_size()
        if flags & ~(SAMPLING_SEED | SAMPLING_MORE_FOLLOWS):
            raise InvalidArgument(f"sampling: has_seed takes bits 1 (seeded) and 2 (a sym_sampling_more follows), "
                                  f"got {flags}")
        more = {}
        if flags & SAMPLING_MORE_FOLLOWS:
            min_p, penalty, penalized_ptr, n_penalized, logprobs, top_logprobs = SAMPLING_MORE.unpack(
                mem.read(ptr + SAMPLING_RECORD.size, SAMPLING_MORE.size))
            if not 0 <= n_penalized <= vocab:
                raise InvalidArgument(f"sampling: n_penalized is at most the vocabulary size {vocab}")
            if logprobs not in (0, 1):
                raise InvalidArgument(f"sampling: logprobs is 0 or 1, got {logprobs}")
            more = dict(min_p=min_p, repetition_penalty=penalty,
                        penalized=tuple(mem.read_i32s(penalized_ptr, n_penalized)) if n_penalized else (),
                        logprobs=bool(logprobs), top_logprobs=top_logprobs)
        if not 0 <= n_allowed <= vocab or not 0 <= n_bias <= vocab:
            raise InvalidArgument(f"sampling: n_allowed and n_bias are at most the vocabulary size {vocab}")
        allowed = tuple(mem.read_i32s(allowed_ptr, n_allowed)) if allowed_ptr else None
        bias = {}
        if n_bias:
            ids = mem.read_i32s(bias_ids_ptr, n_bias)
            values = struct.unpack(f"<{n_bias}f", mem.read(bias_values_ptr, 4 * n_bias))
            bias = dict(zip(ids, values))
        return Sample(temperature=temperature, top_p=top_p, top_k=top_k,
                      seed=seed if flags & SAMPLING_SEED else None, logit_bias=bias, allowed_tokens=allowed,
                      grammar=self.calls.grammar_for_pred(grammar) if grammar else None, **more)

    def pred_wait(self, mem: GuestMemory, ticket: int, out_ptr: int, cap: int) -> int | Wait:
        request = self.calls.tickets.get(ticket)
        if request is not None and cap >= 0:
            mem.check(out_ptr, 4 * cap)
        outcome = self.calls.pred_wait(ticket, cap)
        want = request.want
        if isinstance(outcome, Wait):
            outcome.encode = _sampled_token if isinstance(want, Sample) and not want.logprobs else \
                lambda mem, result: self._write_answer(mem, result, want, out_ptr)
            return outcome
        return self._write_answer(mem, outcome, want, out_ptr)

    def pred(self, mem: GuestMemory, kv: int, ids_ptr: int, pos_ptr: int, n: int, kind: int, arg: int,
             out_ptr: int, cap: int) -> int | Wait:
        """pred_submit and pred_wait in one blocking call: one host call per token instead of
        two. A memory never shrinks, so the room checked now is still there when the answer
        comes."""
        if cap < 0:
            raise InvalidArgument("cap must be >= 0")
        mem.check(out_ptr, 4 * cap)
        tokens, positions, want = self._pred_request(mem, ids_ptr, pos_ptr, n, kind, arg)
        if kind == KIND_DISTRIBUTION:  # its softmax goes straight into the guest's buffer
            want = _DISTRIBUTION_TAKEN_AT_ONCE
        outcome = self.calls.pred(kv, tokens, positions, want, cap)
        if isinstance(outcome, Wait):
            outcome.encode = _sampled_token if kind == KIND_SAMPLE and not want.logprobs else \
                lambda mem, result: self._write_answer(mem, result, want, out_ptr)
            return outcome
        return self._write_answer(mem, outcome, want, out_ptr)

    def _write_answer(self, mem: GuestMemory, result: PredResult, want: Want, out_ptr: int) -> int:
        """Write a pred's answer at out_ptr (its room was checked); returns the call's value:
        the sampled token, or the count of values written."""
        if isinstance(want, Sample):
            if want.logprobs:  # its log-probability, then the top ones' ids and log-probabilities
                k = want.top_logprobs
                top_ids, top_logprobs = (result.top_ids, result.top_logprobs) if k else ((), ())
                mem.write(out_ptr, struct.pack(f"<f{k}i{k}f", result.logprob, *top_ids, *top_logprobs))
            return result.token
        if isinstance(want, Distribution):
            vocab = result.vocab_size
            cached = self._distribution_buffer
            if cached is not None and cached[0] == out_ptr and cached[1].numel() == vocab:
                out = cached[1]
            else:
                out = mem.f32_tensor(out_ptr, vocab)
                self._distribution_buffer = None if out is None else (out_ptr, out)
            if out is None:  # not aligned for float32s: through a tensor of its own
                mem.write_tensor(out_ptr, result.probs)
            else:
                result.write_probs(out)
            return vocab
        if isinstance(want, TopK):
            k = len(result.top_ids)
            mem.write(out_ptr, struct.pack(f"<{k}i{k}f", *result.top_ids, *result.top_logprobs))
            return k
        if isinstance(want, ScoreEach):  # the scores, then each one's top ids, then their log-probabilities
            n, k = len(result.scores), want.k
            ids = [i for top in result.score_top_ids for i in top]
            logprobs = [lp for top in result.score_top_logprobs for lp in top]
            mem.write(out_ptr, struct.pack(f"<{n}f{n * k}i{n * k}f", *result.scores, *ids, *logprobs))
            return n
        mem.write_i32s(out_ptr, result.tokens)  # GreedyEach
        return len(result.tokens)

    # ---- grammars ----

    def grammar_new(self, mem: GuestMemory, kind: int, source_ptr: int, source_len: int) -> int:
        if not 0 <= source_len <= MAX_TEXT_BYTES:
            raise InvalidArgument(f"grammar-new takes at most {MAX_TEXT_BYTES} bytes of source")
        return self.calls.grammar_new(kind, mem.read_str(source_ptr, source_len))

    def grammar_fork(self, mem: GuestMemory, grammar: int) -> int:
        return self.calls.grammar_fork(grammar)

    def grammar_accept(self, mem: GuestMemory, grammar: int, ids_ptr: int, n: int) -> int:
        if not 0 <= n <= MAX_TOKENS_PER_PRED:
            raise InvalidArgument(f"grammar-accept takes 0 to {MAX_TOKENS_PER_PRED} tokens")
        self.calls.grammar_accept(grammar, mem.read_i32s(ids_ptr, n))
        return 0

    def grammar_rollback(self, mem: GuestMemory, grammar: int, n: int) -> int:
        self.calls.grammar_rollback(grammar, n)
        return 0

    def grammar_state(self, mem: GuestMemory, grammar: int) -> int:
        return self.calls.grammar_state(grammar)

    def grammar_close(self, mem: GuestMemory, grammar: int) -> int:
        self.calls.grammar_close(grammar)
        return 0

    # ---- I/O ----

    def send(self, mem: GuestMemory, ptr: int, length: int) -> int:
        if not 0 <= length <= MAX_TEXT_BYTES:
            raise InvalidArgument(f"send takes at most {MAX_TEXT_BYTES} bytes")
        self.calls.send(mem.read(ptr, length))
        return 0

    def recv(self, mem: GuestMemory, out_ptr: int, cap: int) -> int | Wait:
        if cap >= 0:
            mem.check(out_ptr, cap)
        outcome = self.calls.recv(cap)

        def write(mem: GuestMemory, message: bytes) -> int:
            mem.write(out_ptr, message)
            return len(message)

        if isinstance(outcome, Wait):
            outcome.encode = write
            return outcome
        return write(mem, outcome)

    # ---- tools ----

    def tool(self, mem: GuestMemory, name_ptr: int, name_len: int, input_ptr: int, input_len: int,
             out_ptr: int, cap: int) -> int:
        """Calls an operator-registered tool (tools.py) inside the server."""
        if not 0 < name_len <= 64 or not 0 <= input_len <= MAX_TEXT_BYTES or cap < 0:
            raise InvalidArgument("tool: the name is 1 to 64 bytes, the input at most 1 MiB, cap >= 0")
        name, text = mem.read_str(name_ptr, name_len), mem.read_str(input_ptr, input_len)
        mem.check(out_ptr, cap)
        return _write_text(mem, self.calls.tool(name, text).encode(), out_ptr, cap)

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
                    nevents_ptr: int) -> int | Wait:
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
        return Wait("blocked-on-sleep", future, lambda: due(time.monotonic()), cancel=lambda: timers.cancel(future),
                    encode=events, failed=wasi_failure)

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


def _write_text(mem: GuestMemory, data: bytes, out_ptr: int, cap: int) -> int:
    if cap < 0:
        raise InvalidArgument("cap must be >= 0")
    mem.check(out_ptr, cap)
    mem.write(out_ptr, data[:cap])
    return len(data)


def _read_path(mem: GuestMemory, ptr: int, length: int) -> str:
    if not 0 < length <= MAX_PATH_BYTES:  # before reading: a huge length is no pointer to check
        raise InvalidArgument(f"a KV path is 1 to {MAX_PATH_BYTES} bytes (a name: at most 255)")
    return mem.read_str(ptr, length)


def wasi_failure(_code: ErrorCode) -> int:
    """What a WASI function of ours answers when the host refuses or fails it (the rate limit,
    a host bug): EIO, a WASI errno, where our own calls answer a negative code."""
    return WASI_EIO
