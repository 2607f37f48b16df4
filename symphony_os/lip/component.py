"""The component ABI of the system calls (Python LIPs built with componentize-py): the host side
of guest_sdk/python/wit/symphony.wit over `syscalls.SystemCalls`, and the process that runs a
component.

A component runs exactly like a core module: in its own Store, on a wasmtime fiber polled by a
runtime worker (wasm/component_linker.py), and its blocking calls (`pred-wait`, `recv`, a long
`tokenize`) suspend it until the batch (or the tokenizer thread) that answers them is done, so
its `pred`s share batches with every other process. The calls are those of the typed layer
(same KV tables, tickets, limits and error codes), with component values instead of guest
pointers. A distribution stays on the host: the guest holds a `distribution` resource whose rep
is a key into its own process's `ComponentCalls.distributions` (reps are per process, so one
process's handle can never reach another's distribution).
"""
from __future__ import annotations

import json
import logging
import math
from typing import Any, Callable

import torch
import wasmtime
import wasmtime.component as wc

from ..engine.sampling import Distribution, GreedyEach, Sample, ScoreEach, TopK, Want
from ..errors import BadHandle, InvalidArgument, SymphonyError
from ..wasm.component_linker import ComponentLinker, Failed, call_run, capture_output
from ..wasm.fiber import Fiber, polling_fiber
from .process import Process
from .syscalls import MAX_TEXT_BYTES, MAX_TOKENS_PER_PRED, SystemCalls, Wait

log = logging.getLogger("symphony.component")

DISTRIBUTION_RESOURCE_TYPE = 0x53594D01  # our host resource type id ("SYM" 1)


def _drop_distribution(store, rep: int) -> None:
    """The guest dropped a `distribution`: free it in the process that owns it (the one being
    polled: only its guest code drops its resources). Never raises: wasmtime-py parks
    exceptions in a global."""
    fiber = polling_fiber()
    if fiber is not None and isinstance(fiber.owner, ComponentProcess):
        fiber.owner.abi.distributions.pop(rep, None)


# ---- the system calls, in component values ----

def _want_of(want: Any, vocab_size: int, calls: SystemCalls) -> Want:
    if want.tag == "distribution":
        return Distribution()
    if want.tag == "top-k":
        return TopK(want.payload)
    if want.tag == "greedy-each":
        return GreedyEach()
    if want.tag == "score-each":
        return ScoreEach(want.payload)
    record = want.payload
    allowed = record.allowed
    penalized = record.penalized
    if (allowed is not None and len(allowed) > vocab_size) or len(record.bias) > vocab_size or len(penalized) > vocab_size:
        raise InvalidArgument(f"sampling: allowed ids, biases and penalized ids are at most the vocabulary size "
                              f"{vocab_size}")
    # Record fields keep their WIT (kebab-case) names.
    return Sample(temperature=record.temperature, top_p=getattr(record, "top-p"), top_k=getattr(record, "top-k"),
                  seed=record.seed, logit_bias=dict(record.bias),
                  allowed_tokens=None if allowed is None else tuple(allowed),
                  grammar=calls.grammar_for_pred(record.grammar) if record.grammar else None,
                  min_p=getattr(record, "min-p"), repetition_penalty=getattr(record, "repetition-penalty"),
                  penalized=tuple(penalized), logprobs=record.logprobs, top_logprobs=getattr(record, "top-logprobs"))


def _scored(logprob: float, ids: list[int], logprobs: list[float]) -> wc.Record:
    """The WIT's `scored` record: a token's log-probability and the top ones there."""
    scored = wc.Record()
    scored.logprob, scored.top = logprob, list(zip(ids, logprobs))
    return scored


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

    def chat_template(self, messages: list[tuple[str, str]], add_generation_prompt: bool, tools: str | None) -> str:
        try:
            parsed = None if tools is None else json.loads(tools)
        except (ValueError, RecursionError):
            raise InvalidArgument("chat-template: tools are JSON function definitions") from None
        return self.calls.chat_template(list(messages), add_generation_prompt, parsed)

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
        return self.calls.pred_submit(kv, ids, positions, _want_of(want, self.vocab_size(), self.calls))

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
        if isinstance(want, ScoreEach):
            return wc.Variant("scores", [_scored(logprob, ids, logprobs) for logprob, ids, logprobs
                                         in zip(result.scores, result.score_top_ids, result.score_top_logprobs)])
        if want.logprobs:
            sampled = wc.Record()
            sampled.token, sampled.logprob = result.token, result.logprob
            sampled.top = list(zip(result.top_ids or (), result.top_logprobs or ()))
            return wc.Variant("sampled", sampled)
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
    # grammars
    def grammar_new(self, kind: int, source: str) -> int:
        return self.calls.grammar_new(kind, source)

    def grammar_fork(self, grammar: int) -> int:
        return self.calls.grammar_fork(grammar)

    def grammar_accept(self, grammar: int, ids: list[int]) -> None:
        self.calls.grammar_accept(grammar, list(ids))

    def grammar_rollback(self, grammar: int, n: int) -> None:
        self.calls.grammar_rollback(grammar, n)

    def grammar_state(self, grammar: int) -> int:
        return self.calls.grammar_state(grammar)

    def grammar_close(self, grammar: int) -> None:
        self.calls.grammar_close(grammar)

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
INTERFACES: dict[str, dict[str, tuple[Callable, bool]]] = {
    "errors": {},
    "model": {"vocab-size": (ComponentCalls.vocab_size, False), "eos-ids": (ComponentCalls.eos_ids, False),
              "bos-id": (ComponentCalls.bos_id, False), "model-name": (ComponentCalls.model_name, False)},
    "tokens": {"tokenize": (ComponentCalls.tokenize, True), "detokenize": (ComponentCalls.detokenize, False),
               "chat-template": (ComponentCalls.chat_template, False)},
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
    "grammars": {name.replace("_", "-"): (getattr(ComponentCalls, name), False) for name in (
        "grammar_new", "grammar_fork", "grammar_accept", "grammar_rollback", "grammar_state", "grammar_close")},
    "io": {"send": (ComponentCalls.send, False), "recv": (ComponentCalls.recv, True)},
    "tools": {"tool": (ComponentCalls.tool, False)},
}


def _invoke(process: "ComponentProcess", name: str, method: Callable, arguments: Callable):
    """A component's system call, through the same entry as a core module's
    (SystemCalls.dispatch: rate limit, errors; an error becomes Failed). A call that waits
    suspends the process on its Wait."""
    calls = process.abi
    max_list = max(MAX_TOKENS_PER_PRED, calls.vocab_size())  # ids, or one entry per vocabulary token
    outcome = process.syscalls.dispatch(name, Failed, lambda: method(calls, *arguments(max_list, MAX_TEXT_BYTES)))
    if isinstance(outcome, Wait):
        return process.block_on(outcome, None)
    return outcome


def component_linker(engine: wasmtime.Engine) -> ComponentLinker:
    """The linker of the system calls' component interfaces (and WASI preview 2)."""
    return ComponentLinker(engine, INTERFACES, _invoke,
                           {"inference": [("distribution", DISTRIBUTION_RESOURCE_TYPE, _drop_distribution)]})


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
        # WASI preview 2 has no fd_write of ours to override: its output streams call back.
        capture_output(wasi, self._captured)
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
