"""The Python SDK for Symphony LLM Inference Programs (LIPs), over the bindings componentize-py
generates from guest_sdk/python/wit/symphony.wit (world `lip-python`).

A LIP is a module whose `main(args) -> int` drives generation; it ends with
`WitWorld = symphony.program(main)`, and is built with
    componentize-py -d guest_sdk/python/wit -w lip-python componentize -p guest_sdk/python \\
        -p lips hello -o lips/hello_py.wasm
(`make lips` does this). `print()` goes to the process's log; `send()` to its user.

Failures raise `SymphonyError` subclasses, one per code of the error table (wit/symphony.wit).
A `Distribution` stays on the host: ask it for `argmax()`, `top_k(k)`, `logprob(t)` or
`sample(...)`; only the answer crosses.
"""
from __future__ import annotations

import json
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator

from componentize_py_types import Err
from wit_world import WitWorld as _World
from wit_world.imports import grammars, inference, io, kv as _kv, model, tokens, tools
from wit_world.imports.errors import ErrorCode
from wit_world.imports.inference import Prediction_Distribution, Sampled, Sampling, Scored

__all__ = ["SymphonyError", "Distribution", "Kv", "Ticket", "Greedy", "Sampler", "Sampled", "Scored", "TopK", "Grammar", "program",
           "vocab_size", "eos_ids", "bos_id", "model_name", "tokenize", "detokenize", "send", "recv",
           "tool", "generate", "TextStream"]

# ---- errors ----


class SymphonyError(Exception):
    """A system call failed; `code` is its negative ABI value, `name` its WIT name."""

    code = -14

    @property
    def name(self) -> str:
        return type(self).__name__


def _error_class(name: str, code: int) -> type:
    return type(name, (SymphonyError,), {"code": code, "__doc__": f"error-code {code}"})


# One class per case of `error-code`, in table order: case i is code -(i + 1).
ERRORS: dict[ErrorCode, type] = {
    case: _error_class("".join(part.capitalize() for part in case.name.split("_")), -(i + 1))
    for i, case in enumerate(ErrorCode)
}
globals().update({cls.__name__: cls for cls in ERRORS.values()})  # InvalidArgument, BadHandle, ...


def _check(call: Callable, *args):
    """Call a binding; its `err(error-code)` becomes the matching SymphonyError."""
    try:
        return call(*args)
    except Err as error:
        code = error.value
        raise ERRORS[code](f"{getattr(call, '__name__', 'call')} failed: {code.name.lower()}") from None


# ---- model and tokens ----

def vocab_size() -> int:
    return model.vocab_size()


def eos_ids() -> list[int]:
    return model.eos_ids()


def bos_id() -> int | None:
    try:
        return _check(model.bos_id)
    except ERRORS[ErrorCode.UNSUPPORTED]:
        return None


def model_name() -> str:
    return model.model_name()


def tokenize(text: str, prompt: bool = False) -> list[int]:
    """Token ids of `text`; with `prompt`, the model's special tokens (BOS) are added."""
    return _check(tokens.tokenize, text, prompt)


def detokenize(ids: list[int]) -> str:
    return _check(tokens.detokenize, list(ids))


def chat_template(messages: list[tuple[str, str]], add_generation_prompt: bool = True,
                  tools: list[dict] | None = None) -> str:
    """The conversation, (role, content) pairs, rendered with the model's own chat template
    (ending with the start of the assistant's turn), with `tools` (OpenAI-style function
    definitions) for a template that shows them. Tokenize it with `tokenize(text, False)`: the
    template writes its own special tokens."""
    return _check(tokens.chat_template, [(role, content) for role, content in messages], add_generation_prompt,
                  None if tools is None else json.dumps(tools))


# ---- grammars (constrained decoding) ----

class Grammar:
    """A grammar the host keeps (llguidance): from a JSON schema, a regular expression or a Lark
    grammar. Give it to a `Sampler` and each token drawn is one it allows next, and moves it on
    (the end of the sequence comes once it may end). `fork()` copies it (a branch of a beam);
    `accept(ids)` and `rollback(n)` move it by tokens the program chose or took back."""

    JSON_SCHEMA, REGEX, LARK = 0, 1, 2

    def __init__(self, handle: int):
        self.handle = handle

    @classmethod
    def json_schema(cls, schema: str) -> "Grammar":
        return cls(_check(grammars.grammar_new, cls.JSON_SCHEMA, schema))

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls(_check(grammars.grammar_new, cls.REGEX, pattern))

    @classmethod
    def lark(cls, grammar: str) -> "Grammar":
        return cls(_check(grammars.grammar_new, cls.LARK, grammar))

    def fork(self) -> "Grammar":
        return Grammar(_check(grammars.grammar_fork, self.handle))

    def accept(self, ids: list[int]) -> None:
        _check(grammars.grammar_accept, self.handle, list(ids))

    def rollback(self, n: int) -> None:
        _check(grammars.grammar_rollback, self.handle, n)

    @property
    def may_end(self) -> bool:
        return bool(_check(grammars.grammar_state, self.handle) & 1)

    @property
    def must_end(self) -> bool:
        return bool(_check(grammars.grammar_state, self.handle) & 2)

    def close(self) -> None:
        _check(grammars.grammar_close, self.handle)


# ---- what a pred answers ----

@dataclass(frozen=True)
class Greedy:
    """The most likely token, chosen on the host."""

    def want(self) -> inference.Want:
        return inference.Want_Sample(Sampling(0.0, 1.0, 0, None, None, [], 0, 0.0, 1.0, [], False, 0))


@dataclass(frozen=True)
class Sampler:
    """A token sampled on the host: temperature (0: greedy), top-p, top-k (0: off), seed,
    an allowed-token list and a `Grammar` (constrained decoding), logit biases {id: value},
    min-p (0: off) and a repetition penalty (1: off) on the `penalized` ids (vLLM's: list the
    prompt's and the output's tokens). With `logprobs`, the answer is a Sampled: the token, its
    log-probability and the `top_logprobs` most likely (id, log-probability), the model's own."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    allowed: list[int] | None = None
    bias: dict[int, float] = field(default_factory=dict)
    grammar: "Grammar | None" = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    penalized: list[int] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0

    def want(self) -> inference.Want:
        return inference.Want_Sample(Sampling(self.temperature, self.top_p, self.top_k, self.seed, self.allowed,
                                              list(self.bias.items()),
                                              0 if self.grammar is None else self.grammar.handle,
                                              self.min_p, self.repetition_penalty, list(self.penalized),
                                              self.logprobs, self.top_logprobs))


@dataclass(frozen=True)
class TopK:
    """The k most likely tokens with their log-probabilities."""

    k: int

    def want(self) -> inference.Want:
        return inference.Want_TopK(self.k)


class Distribution:
    """A next-token distribution kept on the host; only what you ask of it crosses. Freed when
    garbage (or at the end of a `with` block)."""

    def __init__(self, resource: inference.Distribution):
        self._resource = resource

    def argmax(self) -> int:
        """The most likely token (the lowest id among ties)."""
        return self._resource.argmax()

    def top_k(self, k: int) -> list[tuple[int, float]]:
        """The k most likely (id, log-probability), most likely first."""
        return _check(self._resource.top_k, k)

    def logprob(self, token: int) -> float:
        return _check(self._resource.logprob, token)

    def sample(self, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> int:
        return _check(self._resource.sample, temperature, top_p, seed)

    def __enter__(self) -> "Distribution":
        return self

    def __exit__(self, *exc) -> None:
        self._resource.__exit__(*exc)


class Ticket:
    """A pred in flight; `wait()` blocks for its answer. Submit several before waiting on any
    and they share one batch."""

    def __init__(self, ticket: int):
        self.ticket = ticket

    def wait(self):
        """A Distribution, a token, a list of (id, logprob) or a list of tokens, by what was
        submitted."""
        prediction = _check(inference.pred_wait, self.ticket)
        if isinstance(prediction, Prediction_Distribution):
            return Distribution(prediction.value)
        return prediction.value


# ---- KV files ----

class Kv:
    """A KV file handle; closes when its `with` block ends (or on `close()`). Anonymous files
    die with their last handle; named ones stay."""

    CREATE, EXCLUSIVE, READ_ONLY = 1, 2, 4
    PINNED, DROP_ON_CLOSE = 1, 2

    def __init__(self, handle: int):
        self.handle = handle

    @classmethod
    def create(cls) -> "Kv":
        return cls(_check(_kv.kv_create))

    @classmethod
    def open(cls, path: str, create: bool = False, exclusive: bool = False, read_only: bool = False) -> "Kv":
        flags = cls.CREATE * create | cls.EXCLUSIVE * exclusive | cls.READ_ONLY * read_only
        return cls(_check(_kv.kv_open, path, flags))

    @classmethod
    def open_prefix(cls, ids: list[int]) -> "Kv":
        """The longest prefix of `ids` this tenant's prefix cache holds (len() says how long)."""
        return cls(_check(_kv.kv_open_prefix, list(ids)))

    @staticmethod
    def remove(path: str) -> None:
        _check(_kv.kv_remove, path)

    def fork(self) -> "Kv":
        """A new file with the same tokens; pages are shared copy-on-write."""
        return Kv(_check(_kv.kv_fork, self.handle))

    def extract(self, start: int, end: int) -> "Kv":
        return Kv(_check(_kv.kv_extract, self.handle, start, end))

    def merge(self, other: "Kv") -> "Kv":
        return Kv(_check(_kv.kv_merge, self.handle, other.handle))

    def __len__(self) -> int:
        return _check(_kv.kv_len, self.handle)

    def truncate(self, length: int) -> None:
        _check(_kv.kv_truncate, self.handle, length)

    def hint(self, pinned: bool = False, drop_on_close: bool = False, keep_for_ms: int = -1,
             priority: int = 0) -> None:
        flags = self.PINNED * pinned | self.DROP_ON_CLOSE * drop_on_close
        _check(_kv.kv_hint, self.handle, flags, keep_for_ms, priority)

    def cache_prefix(self) -> int:
        return _check(_kv.kv_cache_prefix, self.handle)

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            _check(_kv.kv_close, handle)

    def __enter__(self) -> "Kv":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # prediction: append tokens, get what `want` asks for
    def submit(self, ids: list[int], want=None, positions: list[int] | None = None) -> Ticket:
        """Queue a pred; `want` is Greedy(), Sampler(...), TopK(k), or None for the full
        distribution."""
        wanted = inference.Want_Distribution() if want is None else want.want()
        return Ticket(_check(inference.pred_submit, self.handle, list(ids), positions, wanted))

    def pred(self, ids: list[int], positions: list[int] | None = None) -> Distribution:
        """Append `ids`; the next-token distribution (kept on the host)."""
        return Distribution(_check(inference.pred, self.handle, list(ids), positions,
                                   inference.Want_Distribution()).value)

    def next_token(self, ids: list[int], sampler=Greedy()) -> int:
        """Append `ids`; one token chosen on the host by `sampler` (one host call). With a
        Sampler(logprobs=True): a Sampled (`token`, `logprob`, `top`: [(id, logprob)])."""
        return _check(inference.pred, self.handle, list(ids), None, sampler.want()).value

    def top_k(self, ids: list[int], k: int) -> list[tuple[int, float]]:
        return self.submit(ids, TopK(k)).wait()

    def score(self, ids: list[int], k: int = 0) -> list:
        """Append `ids` (at least 2); each after the first scored: a Scored (`logprob` given those
        before it, `top`: the k most likely [(id, logprob)] there), the model's own."""
        return Ticket(_check(inference.pred_submit, self.handle, list(ids), None, inference.Want_ScoreEach(k))).wait()

    def greedy_each(self, ids: list[int]) -> list[int]:
        """Append `ids`; the greedy next token after each of them (verifies a draft)."""
        wanted = inference.Want_GreedyEach()
        return Ticket(_check(inference.pred_submit, self.handle, list(ids), None, wanted)).wait()


# ---- generation ----

def generate(kv: Kv, ids: list[int], max_tokens: int, sampler=Greedy(), stop: set[int] | None = None) -> Iterator[int]:
    """Append `ids` to `kv`, then yield up to `max_tokens` tokens, each fed back; ends before
    a token in `stop` (default: the model's end-of-sequence ids)."""
    stop = set(eos_ids()) if stop is None else stop
    feed = list(ids)
    for _ in range(max_tokens):
        token = kv.next_token(feed, sampler)
        if token in stop:
            return
        yield token
        feed = [token]


def _settled(text: str) -> str:
    """`text` without a character whose tokens have not all come yet: it decodes as U+FFFD, one
    per byte so far, and becomes itself once complete."""
    return text.rstrip("\ufffd")


class TextStream:
    """Turns a growing token list into text pieces: decodes the whole list each time (a
    character may span tokens) and returns what is new and settled."""

    def __init__(self, ids: list[int] = ()):
        self.ids = list(ids)
        self.sent = _settled(detokenize(self.ids)) if self.ids else ""

    def text(self) -> str:
        return self.sent

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._beyond_sent(_settled(detokenize(self.ids)))

    def finish(self) -> str:
        """What push held back at the end: a character whose tokens never all came."""
        return self._beyond_sent(detokenize(self.ids))

    def _beyond_sent(self, text: str) -> str:
        # Past what was sent (even where a later token changed earlier text: sent is sent).
        if len(text) <= len(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


# ---- I/O ----

def send(text: str) -> None:
    _check(io.send, text)


def recv() -> str | None:
    """The next message from the user, or None once they closed the input."""
    try:
        return _check(io.recv)
    except ERRORS[ErrorCode.CLOSED]:
        return None


def tool(name: str, text: str) -> str:
    """Run the tool the operator registered as `name` (inside the server)."""
    return _check(tools.tool, name, text)


# ---- the entry point ----

def program(main: Callable[[list[str]], int | None]) -> type:
    """The class componentize-py exports: its `run()` calls `main(sys.argv[1:])` and returns
    the exit code (0 for None; 1, with the traceback in the log, for an uncaught exception)."""

    class WitWorld(_World):
        def run(self) -> int:
            try:
                return int(main(sys.argv[1:]) or 0)
            except SystemExit as exit:  # as Python's own: None is 0, a message goes to the log with 1
                if exit.code is None or isinstance(exit.code, int):
                    return exit.code or 0
                print(exit.code, file=sys.stderr)
                return 1
            except BaseException:
                traceback.print_exc()
                return 1

    return WitWorld
