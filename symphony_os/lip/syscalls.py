"""The system calls of a LIP process, once, in typed form: what each call of wit/symphony.wit
does, checks and answers, for both ABIs.

A call takes plain values (token ids as lists, paths as `str`, what a pred returns as a
`sampling.Want`) and returns a plain value, raises a `SymphonyError` (its code is the guest's
answer), or returns a `Wait` when it must wait (for a batch, the inbox, the tokenizer thread).
The ABIs are thin adapters over this: `core_abi.py` reads a core module's pointers and writes
its buffers, `component_abi.py` converts a component's values. Every call is entered through
`dispatch`, which charges the host-call rate limit and turns errors into the ABI's failure.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

from ..engine.grammar import Grammar
from ..engine.pred_future import PredFuture
from ..engine.sampling import Distribution, GreedyEach, PredResult, Sample, ScoreEach, TopK, Want
from ..engine.scheduler import PredRequest
from ..errors import (BadHandle, BufferTooSmall, ErrorCode, InputClosed, InvalidArgument, LimitExceeded,
                      SymphonyError, Unsupported)
from ..kv.prefix_cache import PrefixCache, TrackedFile
from ..wasm.fiber import Pending

log = logging.getLogger("symphony.syscalls")

MAX_TOKENS_PER_PRED = 1 << 16
MAX_TEXT_BYTES = 1 << 20
MAX_CHAT_MESSAGES = 4096  # of one chat-template call
MAX_GRAMMARS = 64  # open in one process (each holds a matcher's state)
MAX_PATH_BYTES = 1024  # KVFS names are at most 255 bytes: longer ones are refused there, with the reason
# Longer texts are tokenized on the engine's tokenizer thread while their process waits: a MiB
# held the worker, and every process it runs, for 0.5-1.7 s. Shorter ones (~10 ms) are done inline.
INLINE_TOKENIZE_CHARS = 16 * 1024
T = TypeVar("T")


class Wait(Pending):
    """A call that must wait: for `future` (None: for the process's inbox), then `then(*args)`
    gives its value or raises its error. `cancel` runs if the process ends while it waits. The
    ABI that hands it to the process (Process.block_on) says how the value reaches the guest:
    `encode(memory, value)` (None: as it is), and what an error code becomes, `failed(code)`
    (a core module's int, a component's Failed). The process finishes the call on its own
    thread (Process.finish_block), so no exception reaches wasmtime. It is also what the
    guest's fiber waits on (a `fiber.Pending`): one object per waiting call."""

    __slots__ = ("state", "future", "then", "args", "cancel", "encode", "failed")

    def __init__(self, state: str, future: PredFuture | None, then: Callable[..., Any], args: tuple = (),
                 cancel: Callable[[], None] | None = None, encode: Callable[[Any, Any], Any] | None = None,
                 failed: Callable[[ErrorCode], Any] = int):
        Pending.__init__(self)
        self.state, self.future, self.then, self.args = state, future, then, args
        self.cancel, self.encode, self.failed = cancel, encode, failed


def values_in(want: Want, result: PredResult) -> int:
    """How many 32-bit values a pred's answer takes in a guest's buffer: the distribution, the
    top-k ids and log-probs, the greedy tokens, a sampled token's log-probability and top ones,
    or none (a sampled token is the return value)."""
    if isinstance(want, Distribution):
        return result.vocab_size
    if isinstance(want, TopK):
        return 2 * len(result.top_ids)
    if isinstance(want, GreedyEach):
        return len(result.tokens)
    if isinstance(want, ScoreEach):
        return len(result.scores) * (1 + 2 * want.k)
    return sampled_values(want)


def sampled_values(want: Sample) -> int:
    """The values a sampled token's log-probabilities take: its own, then the top ones' ids and
    log-probabilities (none without `logprobs`)."""
    return 1 + 2 * want.top_logprobs if want.logprobs else 0


class SystemCalls:
    """The system calls of one process (`process`: its process.Process)."""

    __slots__ = ("process", "usage", "engine", "kv", "tickets", "_next_ticket", "prefix_cache", "prefix_files",
                 "last_limit", "_failures_logged", "host_distribution_bytes", "grammars", "_next_grammar")

    def __init__(self, process):
        self.process = process
        self.usage = process.usage  # what the process has used of its limits
        self.engine = process.engine
        self.kv = process.kv
        self.tickets: dict[int, PredRequest] = {}  # pred_submit tickets not yet waited for
        self._next_ticket = 1
        self.prefix_cache = PrefixCache(self.kv.fs)
        self.prefix_files: dict[int, TrackedFile] = {}  # handles from kv_open_prefix
        self.last_limit: str | None = None  # the message of the last LIMIT_EXCEEDED, for the server
        self._failures_logged: set[str] = set()  # calls whose unexpected failure was logged
        # What the host holds for the process outside its preds: a component's distributions.
        self.host_distribution_bytes: Callable[[], int] = lambda: 0
        self.grammars: dict[int, Grammar] = {}  # grammar handles (grammar-new)
        self._next_grammar = 1

    def dispatch(self, name: str, failed: Callable[[ErrorCode], T], run: Callable[..., T], *args) -> T:
        """The one way into a system call, from either ABI: charges the host-call rate limit,
        then `run(*args)`; an error becomes `failed(code)`. An unexpected exception (a host bug,
        a broken tool) becomes INTERNAL, its traceback logged once per process and call: a guest
        calling it in a loop must not flood the server's log."""
        try:
            self.usage.charge_hostcall()
            return run(*args)
        except SymphonyError as error:
            return failed(self.error_code(error))
        except Exception:  # a host bug must not become a host crash
            if name not in self._failures_logged:
                self._failures_logged.add(name)
                log.exception("pid %s: host call %s failed (logged once per process)", self.process.pid, name)
            return failed(ErrorCode.INTERNAL)

    def error_code(self, error: SymphonyError) -> ErrorCode:
        """The code a guest gets for `error` (a limit's message is kept for the server)."""
        if isinstance(error, LimitExceeded):
            self.last_limit = str(error)
        return error.code

    # ---- model ----

    def vocab_size(self) -> int:
        return self.engine.loaded.config.vocab_size

    def eos_ids(self) -> list[int]:
        return list(self.engine.loaded.eos_token_ids)

    def bos_id(self) -> int:
        bos = self.engine.loaded.bos_token_id
        if bos is None:
            raise Unsupported("the model has no beginning-of-sequence token")
        return bos

    def model_name(self) -> str:
        return self.engine.loaded.name

    # ---- tokens ----

    def tokenize(self, text: str, add_special: bool) -> list[int] | Wait:
        """The token ids of `text`: at once for a short text, else a Wait while the engine's
        tokenizer thread works (INLINE_TOKENIZE_CHARS), its CPU time charged to this process."""
        if len(text) > MAX_TEXT_BYTES:  # (characters: each is a byte at least)
            raise InvalidArgument(f"tokenize takes at most {MAX_TEXT_BYTES} bytes")
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.engine.tokenize(text, add_special_tokens=add_special)
        future = self.engine.tokenize_later(text, add_special)
        return Wait("blocked-on-tokenize", future, self._tokenized, (future,))

    def _tokenized(self, future: PredFuture) -> list[int]:
        ids, cpu_time_s = future.result()
        self.process.cpu_time_s += cpu_time_s
        return ids

    def chat_template(self, messages: list[tuple[str, str]], add_generation_prompt: bool,
                      tools: list[dict] | None = None) -> str:
        """The conversation, (role, content) pairs, in the model's chat template, with `tools`
        (OpenAI-style function definitions) for a template that shows them."""
        if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
            raise InvalidArgument("chat-template: tools are a list of function definitions (objects)")
        if len(messages) > MAX_CHAT_MESSAGES:
            raise InvalidArgument(f"chat-template takes at most {MAX_CHAT_MESSAGES} messages")
        if sum(len(role) + len(content) for role, content in messages) > MAX_TEXT_BYTES:
            raise InvalidArgument(f"chat-template takes at most {MAX_TEXT_BYTES} bytes of messages")
        if any(not role for role, _ in messages):
            raise InvalidArgument("a message's role must not be empty")
        return self.engine.chat_template([{"role": role, "content": content} for role, content in messages],
                                         add_generation_prompt, tools=tools or None)

    def detokenize(self, ids: list[int]) -> str:
        vocab = self.engine.loaded.config.vocab_size
        if len(ids) > MAX_TOKENS_PER_PRED:
            raise InvalidArgument(f"detokenize takes at most {MAX_TOKENS_PER_PRED} ids")
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise InvalidArgument(f"token ids must be in [0, {vocab})")
        return self.engine.detokenize(ids)

    # ---- KV files ----

    def kv_create(self) -> int:
        return self.kv.create()

    def kv_open(self, path: str, flags: int) -> int:
        return self.kv.open(_checked_path(path), flags)

    def kv_fork(self, kv: int) -> int:
        return self._within_kv_pages(self.kv.fork(kv))

    def kv_extract(self, kv: int, start: int, end: int) -> int:
        return self._within_kv_pages(self.kv.extract(kv, start, end))

    def kv_merge(self, first: int, second: int) -> int:
        return self._within_kv_pages(self.kv.merge(first, second))

    def _within_kv_pages(self, new_handle: int) -> int:
        """A file just made by fork/extract/merge, unless it took the process past its page limit."""
        try:
            check_kv_pages(self.process)
        except LimitExceeded:
            self.kv.close(new_handle)
            raise
        return new_handle

    def kv_len(self, kv: int) -> int:
        return self.kv.len(kv)

    def kv_truncate(self, kv: int, length: int) -> None:
        self.kv.truncate(kv, length)
        if kv in self.prefix_files:
            del self.prefix_files[kv].ids[length:]

    def kv_close(self, kv: int) -> None:
        self.kv.close(kv)
        self.prefix_files.pop(kv, None)

    def kv_remove(self, path: str) -> None:
        self.kv.remove(_checked_path(path))

    def kv_hint(self, kv: int, flags: int, keep_for_ms: int, priority: int) -> None:
        if flags & ~3:
            raise InvalidArgument("kv_hint flags: 1 pinned, 2 drop on close")
        self.kv.set_hints(kv, pinned=bool(flags & 1), drop_on_close=bool(flags & 2),
                          keep_for_s=None if keep_for_ms < 0 else keep_for_ms / 1000, priority=priority)

    def kv_open_prefix(self, ids: list[int]) -> int:
        """A new file holding the longest cached prefix of the ids (prefix_cache.py)."""
        if not 0 < len(ids) <= MAX_TOKENS_PER_PRED:
            raise InvalidArgument(f"kv_open_prefix takes 1 to {MAX_TOKENS_PER_PRED} token ids, got {len(ids)}")
        handle, tracked = self.prefix_cache.open_longest(self.kv, ids)
        self.prefix_files[handle] = tracked
        return handle

    def kv_cache_prefix(self, kv: int) -> int:
        tracked = self.prefix_files.get(kv)
        if tracked is None:
            raise BadHandle(f"KV handle {kv} was not opened by kv_open_prefix")
        return self.prefix_cache.offer(self.kv, kv, tracked)

    # ---- inference ----

    def pred_submit(self, kv: int, tokens: list[int], positions: list[int] | None, want: Want) -> int:
        """Queue a pred for the engine and return its ticket."""
        request = self._queue(kv, tokens, positions, want)
        ticket = self._next_ticket
        self._next_ticket += 1
        self.tickets[ticket] = request
        return ticket

    def _queue(self, kv: int, tokens: list[int], positions: list[int] | None, want: Want) -> PredRequest:
        """The checks every pred passes, then the engine's queue. (A blocking `pred` takes no
        ticket, so it is not among the tickets counted here; it needs no room there either: its
        guest is suspended until it is answered, and the checks ran before it was queued.)"""
        if not 0 < len(tokens) <= MAX_TOKENS_PER_PRED:
            raise InvalidArgument(f"pred takes 1 to {MAX_TOKENS_PER_PRED} tokens, got {len(tokens)}")
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

    def pred_wait(self, ticket: int, room: int | None) -> PredResult | Wait:
        """The answer of a pred in flight, once its batch ran. `room`: the 32-bit values the
        caller can take (values_in; None: any): with too little, BufferTooSmall and the ticket
        stays, to be waited for again with more."""
        request = self.tickets.get(ticket)
        if request is None:
            raise BadHandle(f"pred ticket {ticket} is not in flight in this process")
        if room is not None and room < 0:
            raise InvalidArgument("cap must be >= 0")
        if request.future.done():
            return self._ticket_answer(ticket, request, room)
        return Wait("blocked-on-pred", request.future, self._ticket_answer, (ticket, request, room))

    def _ticket_answer(self, ticket: int, request: PredRequest, room: int | None) -> PredResult:
        try:
            result = request.future.result()
        except SymphonyError:
            del self.tickets[ticket]
            raise
        if room is not None and room < values_in(request.want, result):
            raise BufferTooSmall(f"the answer takes {values_in(request.want, result)} values, cap is {room}")
        del self.tickets[ticket]
        return result

    def pred(self, kv: int, tokens: list[int], positions: list[int] | None, want: Want,
             room: int | None) -> PredResult | Wait:
        """pred_submit and pred_wait in one blocking call (the paper's `pred`), with no ticket.
        The answer's room is checked before anything is queued, so an error leaves nothing in
        flight (there is no ticket to wait with again)."""
        if room is not None and (room < 0 or want.__class__ is not Sample or want.logprobs):  # (a token alone needs none)
            if room < 0:
                raise InvalidArgument("cap must be >= 0")
            needed = (self.engine.loaded.config.vocab_size if isinstance(want, Distribution) else
                      2 * want.k if isinstance(want, TopK) else len(tokens) if isinstance(want, GreedyEach) else
                      (len(tokens) - 1) * (1 + 2 * want.k) if isinstance(want, ScoreEach) else sampled_values(want))
            if room < needed:
                raise BufferTooSmall(f"this pred's answer takes {needed} values, cap is {room}")
        future = self._queue(kv, tokens, positions, want).future
        if future.done():
            return future.result()
        return Wait("blocked-on-pred", future, future.result)

    # ---- grammars ----

    def grammar_new(self, kind: int, source: str) -> int:
        """A grammar for constrained decoding (engine/grammar.py); its handle."""
        if len(self.grammars) >= MAX_GRAMMARS:
            raise LimitExceeded(f"at most {MAX_GRAMMARS} grammars per process; close those you no longer need")
        return self._add_grammar(self.engine.grammar(kind, source))

    def _add_grammar(self, grammar: Grammar) -> int:
        handle = self._next_grammar
        self._next_grammar += 1
        self.grammars[handle] = grammar
        return handle

    def grammar_fork(self, handle: int) -> int:
        if len(self.grammars) >= MAX_GRAMMARS:
            raise LimitExceeded(f"at most {MAX_GRAMMARS} grammars per process; close those you no longer need")
        return self._add_grammar(self._idle_grammar(handle).fork())

    def grammar_accept(self, handle: int, tokens: list[int]) -> None:
        if len(tokens) > MAX_TOKENS_PER_PRED:
            raise InvalidArgument(f"grammar-accept takes at most {MAX_TOKENS_PER_PRED} tokens")
        self._idle_grammar(handle).accept(tokens)

    def grammar_rollback(self, handle: int, count: int) -> None:
        self._idle_grammar(handle).rollback(count)

    def grammar_state(self, handle: int) -> int:
        grammar = self._idle_grammar(handle)
        return int(grammar.accepting) | int(grammar.stopped) << 1

    def grammar_close(self, handle: int) -> None:
        self._idle_grammar(handle)
        del self.grammars[handle]

    def grammar_for_pred(self, handle: int) -> Grammar:
        """The grammar a pred samples under, read from its arguments by either ABI just before
        the pred is queued: open in this process and used by no pred in flight."""
        return self._idle_grammar(handle)

    def _idle_grammar(self, handle: int) -> Grammar:
        """The grammar behind `handle`, unless a pred in flight uses it (the engine moves it on)."""
        grammar = self.grammars.get(handle)
        if grammar is None:
            raise BadHandle(f"grammar {handle} is not open in this process")
        if any(request.want.__class__ is Sample and request.want.grammar is grammar and not request.future.done()
               for request in self.tickets.values()):
            raise InvalidArgument(f"grammar {handle} is in use by a pred in flight: wait for it first")
        return grammar

    # ---- I/O ----

    def send(self, data: bytes) -> None:
        if len(data) > MAX_TEXT_BYTES:
            raise InvalidArgument(f"send takes at most {MAX_TEXT_BYTES} bytes")
        self.process.emit_output(data)

    def recv(self, room: int | None) -> bytes | Wait:
        """The user's next message (InputClosed once there is none and no more will come).
        `room`: the most bytes the caller can take (None: any); a longer message stays, and
        the call answers BufferTooSmall."""
        if room is not None and room < 0:
            raise InvalidArgument("cap must be >= 0")
        if self.process.input_ready():
            return self._message(room)
        return Wait("blocked-on-recv", None, self._message, (room,))

    def _message(self, room: int | None) -> bytes:
        message = self.process.peek_input()
        if message is None:
            raise InputClosed("the user closed the input")
        if room is not None and len(message) > room:
            raise BufferTooSmall(f"message of {len(message)} bytes")
        self.process.pop_input()
        return message

    # ---- tools ----

    def tool(self, name: str, text: str) -> str:
        """Call an operator-registered tool (tools.py) inside the server."""
        if not 0 < len(name.encode("utf-8", "surrogatepass")) <= 64 or len(text) > MAX_TEXT_BYTES:
            raise InvalidArgument("tool: the name is 1 to 64 bytes, the input at most 1 MiB")
        return self.process.tools.call(name, text)


def _checked_path(path: str) -> str:
    if not 0 < len(path.encode("utf-8", "surrogatepass")) <= MAX_PATH_BYTES:
        raise InvalidArgument(f"a KV path is 1 to {MAX_PATH_BYTES} bytes (a name: at most 255)")
    return path


def check_kv_pages(process, handle: int | None = None, tokens: int = 0) -> None:
    """Raise LimitExceeded if the process's KV files hold more than its page limit, or would
    once its preds in flight and `tokens` more on the file behind `handle` are appended. Its
    files are those it holds open and those its preds in flight write (a handle closed after
    its pred was queued). Costs a walk over its pages: done only when the limit is set."""
    limit = process.limits.kv_pages
    if limit is None:
        return
    kv = process.kv
    with kv.fs.lock:  # the engine reserves slots (and sets length_before) under it
        final: dict = {}  # file -> its length once its preds in flight and `tokens` are appended
        for request in process.syscalls.tickets.values():  # in the order they were submitted
            if not request.future.done():
                file = request.file
                if file not in final:  # the earliest not done on its file: the one that may have started
                    final[file] = file.length if request.length_before is None else request.length_before
                final[file] += len(request.tokens)
        if handle is not None:
            file = kv.file_of(handle)
            final[file] = final.get(file, file.length) + tokens
        page_size = process.engine.pool.page_size
        more = sum(max(0, -(-length // page_size) - len(file.pages)) for file, length in final.items())
        held = kv.pages_held(also=final)
    if held + more > limit:
        raise LimitExceeded(f"KV page limit per process: its files hold {held} of {limit} pages, "
                            f"{more} more needed by its preds")

