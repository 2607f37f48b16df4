"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (any other /v1
route: a 404 in OpenAI's shape), and vLLM's /tokenize and /detokenize.

Each request runs the built-in `complete` LIP (completion.py) through the same schedulers as
every other process, with automatic prefix reuse. Chat prompts are rendered with the model's
chat template (a plain `role: content` template when the model has none). Streaming answers
are server-sent events ending in `data: [DONE]`. Errors have OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import struct
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from ...engine.grammar import GrammarKind
from ...errors import InvalidArgument, SymphonyError
from ..completion import (MAX_BRANCHES, MAX_STOPS, MAX_TOP_LOGPROBS, BranchText, CompletionFailed, CompletionRequest,
                         FinishEvent, PromptInfo, PromptScores, TokenEvent, run_completion)
from ..metrics import OPENAI
from ..tool_calls import ToolError, ToolPlan, parse_call, plan_tools, tools_prompt
from ..state import ServerState, tenant_of
from ..tenants import QuotaExceeded, Tenant

router = APIRouter(prefix="/v1", tags=["openai"])
tokens_router = APIRouter(tags=["openai"])  # vLLM's /tokenize and /detokenize, outside /v1 as there
log = logging.getLogger("symphony.openai")

MAX_COMPLETION_TOKENS = 4096
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request looks whether its client is still there
FALLBACK_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# Parameters of OpenAI's and vLLM's APIs that this server does not act on, taken only at the value
# that asks for nothing, so that none is ever dropped silently: any other value is a 400 naming
# the parameter, as is a parameter that is neither here nor a field of the request's model.
# `user` (an end-user id for the provider's abuse monitoring) is taken as anything: it asks
# nothing of the answer.
NEUTRAL_VALUES: dict[str, tuple] = {
    "best_of": (None, 1), "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),
    "store": (None, False), "modalities": (None, ["text"]), "service_tier": (None, "auto", "default"),
    "metadata": (None, {}), "prediction": (None,), "audio": (None,), "reasoning_effort": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "continue_final_message": (None, False), "add_generation_prompt": (None, True),
}
ANY_VALUE = frozenset({"user"})
MAX_LOGIT_BIAS = 1024
MAX_REPETITION_PENALTY = 100.0  # (vLLM takes any > 0; past this a token is as good as banned already)
MAX_PROMPTS = 16  # of one /v1/completions request (a process each)
# `name` goes to the chat template with the message; `tool_calls` (an assistant's) and
# `tool_call_id` (a tool's answer) too, or, for a template that does not show tools, as text.
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


def _refuse_unsupported(body: BaseModel) -> None:
    """The 400 for the first parameter this server would otherwise ignore (NEUTRAL_VALUES)."""
    for name, value in (body.model_extra or {}).items():
        if name in ANY_VALUE:
            continue
        neutral = NEUTRAL_VALUES.get(name)
        if neutral is None:
            raise OpenAIError(400, f"unrecognized request argument: {name}", param=name)
        if not any(value == taken and type(value) is not bool or value is taken for taken in neutral):
            accepted = " or ".join(json.dumps(v) for v in neutral)
            raise OpenAIError(400, f"{name} is not supported by this server (it takes only {accepted})", param=name)
    for index, message in enumerate(getattr(body, "messages", None) or ()):
        unknown = sorted(set(message.model_extra or {}) - MESSAGE_FIELDS)
        if unknown:
            raise OpenAIError(400, f"messages[{index}].{unknown[0]} is not supported by this server",
                              param=f"messages.{index}.{unknown[0]}")


class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: dict | None = None
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ...,
    # "schema": {...}, "strict": ...}}: the answer then keeps to the schema (a grammar, engine/grammar.py).
    response_format: dict | None = None
    # OpenAI's logit_bias ({token id: -100..100}) and penalties (-2..2, applied by the complete LIP
    # as logit biases from each answer's own tokens), vLLM's top_k (-1 or 0: off), min_p (0: off),
    # repetition_penalty (1: off; on the prompt's and the answer's tokens), ignore_eos and
    # min_tokens (EOS held back until then).
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None


class CompletionBody(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None


class ChatBody(SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Function calling (tool_calls.py): OpenAI's function definitions, and "none", "auto",
    # "required" or {"type": "function", "function": {"name": ...}}. One call an answer.
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class TokenizeBody(BaseModel):
    """vLLM's: a prompt, or messages rendered with the chat template first."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


async def _parse(request: Request, model: type[BaseModel]) -> BaseModel:
    body = await request.body()  # its size bounded already (guard.py)
    try:
        data = json.loads(body)
        _check_encodable(data)
        body = model.model_validate(data)
    except ValueError as error:  # JSON decoding and pydantic's ValidationError
        if isinstance(error, ValidationError):
            first = error.errors()[0]
            param = ".".join(str(p) for p in first["loc"])
            raise OpenAIError(400, f"{param}: {first['msg']}", param=param) from None
        raise OpenAIError(400, "the body is not valid JSON") from None
    except RecursionError:
        raise OpenAIError(400, "the body is not valid JSON: nested too deep") from None
    _refuse_unsupported(body)
    return body


def _check_encodable(data: Any) -> None:
    """Refuse a string that is not text: JSON may escape a lone UTF-16 surrogate ("\\ud800"),
    which neither the tokenizer nor UTF-8 takes."""
    pending = [data]
    while pending:
        item = pending.pop()
        if type(item) is int:  # most of a long token-id prompt
            continue
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                raise OpenAIError(400, "a string in the body holds a lone UTF-16 surrogate, which is not text") from None
        elif isinstance(item, dict):
            pending += item.keys()
            pending += item.values()
        elif isinstance(item, list):
            pending += item


def served_model_names(state: ServerState) -> tuple[str, ...]:
    """The names requests may give as `model`: --served-model-name's, else the model's own."""
    return state.config.served_model_names or (state.engine.loaded.name,)


def _sampling(state: ServerState, body: SamplingBody, prompt_ids: list[int], max_tokens: int | None,
              logprobs: int | None, chat: bool, plan: ToolPlan | None = None) -> CompletionRequest:
    """The request for the `complete` LIP. Without max_tokens a completion gets 16 tokens (as
    OpenAI's legacy endpoint), a chat answer what the context leaves (as OpenAI and vLLM)."""
    _check_model(state, body.model)
    vocab = state.engine.loaded.config.vocab_size
    if not prompt_ids:
        raise OpenAIError(400, "the prompt is empty", param="prompt")
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise OpenAIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    limit = state.engine.max_model_len
    if max_tokens is None:
        max_tokens = max(0, min(limit - len(prompt_ids), MAX_COMPLETION_TOKENS)) if chat else 16
    if not 0 <= max_tokens <= MAX_COMPLETION_TOKENS:
        raise OpenAIError(400, f"max_tokens must be in [0, {MAX_COMPLETION_TOKENS}]", param="max_tokens")
    if len(prompt_ids) + max_tokens > limit:
        raise OpenAIError(400, f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceed the "
                               f"maximum context length of {limit} tokens", param="max_tokens")
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    n = 1 if body.n is None else body.n
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    checks = [(0 <= temperature <= 2, "temperature must be in [0, 2]", "temperature"),
              (0 < top_p <= 1 and _as_float32(top_p) > 0, "top_p must be in (0, 1] (and not round to 0 as a float32)",
               "top_p"),
              (1 <= n <= MAX_BRANCHES, f"n must be in [1, {MAX_BRANCHES}]", "n"),
              (len(stop) <= MAX_STOPS and all(stop), f"stop takes up to {MAX_STOPS} non-empty strings", "stop"),
              (logprobs is None or 0 <= logprobs <= MAX_TOP_LOGPROBS,
               f"the number of log-probabilities must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")]
    for ok, message, param in checks:
        if not ok:
            raise OpenAIError(400, message, param=param)
    extras = _sampling_extras(body, vocab, max_tokens)
    grammar = _response_grammar(state, body.response_format)
    if plan is not None:
        if grammar is not None:
            raise OpenAIError(400, "response_format with tools is not supported by this server", param="response_format")
        if logprobs is not None:
            raise OpenAIError(400, "logprobs with tools is not supported by this server", param="logprobs")
        grammar = _checked_grammar(state, plan.grammar, "tools")
    return CompletionRequest(prompt_ids, max_tokens, n, logprobs, temperature, top_p, body.seed, tuple(stop), grammar,
                             **extras)


def _sampling_extras(body: SamplingBody, vocab: int, max_tokens: int) -> dict:
    """top_k, min_p, logit_bias, the penalties, ignore_eos and min_tokens, checked, as
    CompletionRequest takes them."""
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    presence = body.presence_penalty or 0.0
    frequency = body.frequency_penalty or 0.0
    min_p = body.min_p or 0.0
    repetition = 1.0 if body.repetition_penalty is None else body.repetition_penalty
    min_tokens = body.min_tokens or 0
    bias: list[tuple[int, float]] = []
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise OpenAIError(400, f"logit_bias maps token ids in [0, {vocab}) to values in [-100, 100]",
                              param="logit_bias")
        bias.append((token, float(value)))
    checks = [(0 <= top_k <= vocab, f"top_k must be -1 (off) or in [0, {vocab}]", "top_k"),
              (len(bias) <= MAX_LOGIT_BIAS, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens", "logit_bias"),
              (-2 <= presence <= 2, "presence_penalty must be in [-2, 2]", "presence_penalty"),
              (-2 <= frequency <= 2, "frequency_penalty must be in [-2, 2]", "frequency_penalty"),
              (0 <= min_p <= 1, "min_p must be in [0, 1]", "min_p"),
              (0 < repetition <= MAX_REPETITION_PENALTY and _as_float32(repetition) > 0,
               f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}]", "repetition_penalty"),
              (0 <= min_tokens <= max_tokens, "min_tokens must be in [0, max_tokens]", "min_tokens")]
    for ok, message, param in checks:
        if not ok:
            raise OpenAIError(400, message, param=param)
    return dict(top_k=top_k, logit_bias=tuple(bias), presence_penalty=float(presence),
                frequency_penalty=float(frequency), ignore_eos=bool(body.ignore_eos), min_tokens=min_tokens,
                min_p=float(min_p), repetition_penalty=float(repetition))


def _response_grammar(state: ServerState, response_format: dict | None) -> tuple[int, str] | None:
    """The grammar (kind, source) a response_format asks for: None for text, a JSON schema
    (compact JSON, engine/grammar.py) for json_object (any object) and json_schema (its schema,
    always enforced: `strict` or not). Checked here, so that a bad schema is a 400 naming it."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if response_format is None or kind == "text":
        return None
    if kind == "json_object":
        schema: object = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError(400, "response_format.json_schema takes a `schema` object", param="response_format")
    else:
        raise OpenAIError(400, "response_format.type must be text, json_object or json_schema", param="response_format")
    return _checked_grammar(state, (GrammarKind.JSON_SCHEMA, json.dumps(schema)), "response_format")


def _checked_grammar(state: ServerState, grammar: tuple[int, str], param: str) -> tuple[int, str]:
    """`grammar` (kind, source), once the engine compiled it: a 400 naming `param` when it cannot
    (the complete LIP compiles it again, in its own process)."""
    try:
        state.engine.grammar(*grammar)
    except SymphonyError as error:
        raise OpenAIError(400, f"{param}: {error}", param=param) from None
    return grammar


def _as_float32(value: float) -> float:
    """`value` as the built-in LIP receives it."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _chat_prompt(state: ServerState, body: ChatBody, plan: ToolPlan | None = None) -> list[int]:
    return state.engine.tokenize(_chat_text(state, body.messages, True, plan), add_special_tokens=False)


def _chat_text(state: ServerState, chat: list[ChatMessage], add_generation_prompt: bool,
               plan: ToolPlan | None = None) -> str:
    """The messages in the model's chat template (FALLBACK_CHAT_TEMPLATE when it has none), with
    the tools a plan offers. A template that shows tools gets them, and the messages' tool calls
    and tool answers, as transformers passes them; another gets the tools in a system message
    and a call as the JSON text the model would have written (tool_calls.py)."""
    if not chat:
        raise OpenAIError(400, "messages must not be empty", param="messages")
    with_tools = "tools" in state.engine.chat_template_source(FALLBACK_CHAT_TEMPLATE)
    messages = []
    for index, message in enumerate(chat):
        content = message.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise OpenAIError(400, "only text content parts are supported", param="messages")
            content = "".join(str(part.get("text", "")) for part in content)
        extra = message.model_extra or {}
        entry = {"role": message.role, "content": content or ""} | ({"name": extra["name"]} if extra.get("name") else {})
        if extra.get("tool_call_id") is not None:
            entry["tool_call_id"] = str(extra["tool_call_id"])
        calls = extra.get("tool_calls")
        if calls:
            try:
                calls = [{"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}
                         for call in calls]
            except (KeyError, TypeError, ValueError):
                raise OpenAIError(400, "a tool call is {\"function\": {\"name\": ..., \"arguments\": a JSON string}}",
                                  param=f"messages.{index}.tool_calls") from None
            if with_tools:
                entry["tool_calls"] = [{"type": "function", "function": call} for call in calls]
            else:
                entry["content"] = "\n".join(json.dumps(call) for call in calls)
        messages.append(entry)
    if plan is not None and not with_tools:
        if messages[0]["role"] == "system":
            messages[0] = messages[0] | {"content": messages[0]["content"] + "\n\n" + tools_prompt(plan)}
        else:
            messages.insert(0, {"role": "system", "content": tools_prompt(plan)})
    try:
        return state.engine.chat_template(messages, add_generation_prompt, default_template=FALLBACK_CHAT_TEMPLATE,
                                          tools=plan.tools if plan is not None and with_tools else None)
    except InvalidArgument as error:  # the template's own complaints (roles out of order, ...)
        raise OpenAIError(400, str(error), param="messages") from None


def _usage(info: PromptInfo | None, completion_tokens: int) -> dict:
    prompt = info.prompt_tokens if info else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": info.cached_tokens if info else 0}}


def texts_after(detokenize, before: int | None, tokens: list[int]) -> list[str]:
    """The text each of `tokens` adds after the token `before` (None: at the start): decoded
    with it, as a text is (a sentencepiece token decoded alone loses its leading space)."""
    if before is None:
        return [detokenize([token]) for token in tokens]
    context = detokenize([before])
    return [detokenize([before, token])[len(context):] for token in tokens]


def prompt_pieces(detokenize, ids: list[int]) -> list[str]:
    """The text each prompt token adds, decoded after the token before it: two short decodes a
    token, not the prompt's every prefix."""
    return texts_after(detokenize, None, ids[:1]) + [texts_after(detokenize, before, [token])[0]
                                                     for before, token in zip(ids, ids[1:])]


class Choices:
    """Per-branch text, token log-probabilities and finish reasons of one request."""

    def __init__(self, state: ServerState, request: CompletionRequest, chat: bool, pieces: list[str] | None = None):
        self.state, self.request, self.chat = state, request, chat
        self.texts = [BranchText(state.engine.detokenize, request.stop, request.prompt_ids[-1:])
                      for _ in range(request.n)]
        self.logprobs: list[list[TokenEvent]] = [[] for _ in range(request.n)]
        self.finish_reasons: list[str | None] = [None] * request.n
        self.info: PromptInfo | None = None
        self.completion_tokens = 0
        # Echo with log-probabilities (request.score_prompt): the prompt's tokens' texts (`pieces`,
        # prompt_pieces' made off the event loop), joined the echoed text, and each one's score
        # after the first as the process sends it.
        self.prompt_pieces = pieces or []
        self.prompt_scores: list[tuple[float, list[tuple[int, float]]]] = []

    @property
    def echo(self) -> str:
        """The prompt's text as its tokens decode, one after another (what echo puts first)."""
        return "".join(self.prompt_pieces)

    def prompt_scored(self) -> bool:
        return not self.request.score_prompt or len(self.prompt_scores) >= len(self.request.prompt_ids) - 1

    def prompt_logprobs_json(self, branch: int) -> dict | None:
        """The echoed prompt's part of a completion's log-probabilities: its first token has
        none (OpenAI's null), the others theirs and the top ones there."""
        if not self.request.score_prompt:
            return None
        ids, detokenize = self.request.prompt_ids, self.state.engine.detokenize
        tops: list[dict | None] = [None]
        for at, (_, top) in enumerate(self.prompt_scores, start=1):
            texts = texts_after(detokenize, ids[at - 1], [token for token, _ in top])
            tops.append({text: lp for text, (_, lp) in zip(texts, top)})
        offsets = [0, *itertools.accumulate(len(piece) for piece in self.prompt_pieces)][:len(self.prompt_pieces)]
        return {"tokens": list(self.prompt_pieces), "token_logprobs": [None] + [lp for lp, _ in self.prompt_scores],
                "top_logprobs": tops, "text_offset": offsets}

    async def events(self, tenant: Tenant) -> AsyncIterator[tuple[int, str, list[TokenEvent], str | None]]:
        """(branch, new text, new token log-probs, finish reason) as the process goes. The first,
        (0, "", [], None), comes once the process has read the prompt and looked up its cached
        prefix, before the prompt's forward pass: a stream's response can start then."""
        counters = self.state.completions
        counters.requests += 1
        state = self.state
        metrics = state.metrics
        timer, reason = metrics.request(OPENAI), "error"
        try:
            async for item in run_completion(state.table, state.completion_program, state.completion_entry, tenant,
                                             self.request):
                if isinstance(item, PromptScores):
                    self.prompt_scores += list(zip(item.logprobs, item.tops))
                    yield 0, "", [], None
                elif isinstance(item, PromptInfo):
                    self.info = item
                    counters.prompt_tokens += item.prompt_tokens
                    counters.cached_tokens += item.cached_tokens
                    metrics.prompt(item.prompt_tokens, item.cached_tokens)
                    yield 0, "", [], None
                elif isinstance(item, TokenEvent):
                    self.completion_tokens += 1
                    counters.completion_tokens += 1
                    timer.token(item.branch)
                    metrics.generated()
                    new = [item] if self.request.logprobs is not None else []
                    self.logprobs[item.branch] += new
                    yield item.branch, self.texts[item.branch].add(item.token), new, None
                elif isinstance(item, FinishEvent):
                    self.finish_reasons[item.branch] = item.reason
                    yield item.branch, self.texts[item.branch].finish(item.text_end), [], item.reason
            reason = "length" if "length" in self.finish_reasons else "stop"
        except (GeneratorExit, asyncio.CancelledError):  # the client went away
            reason = "abort"
            raise
        finally:
            timer.finish(reason)

    def _alternative_texts(self, branch: int, index: int, tokens: list[int]) -> list[str]:
        """The text each of `tokens` would add at `index` of the branch: decoded after the token
        before it (the prompt's last before the first), as the branch's text is."""
        ids, at = self.texts[branch].ids, len(self.texts[branch].context) + index
        return texts_after(self.state.engine.detokenize, ids[at - 1] if at else None, tokens)

    def logprobs_json(self, branch: int, start: int = 0, with_prompt: bool = True) -> dict | None:
        """The log-probabilities of the branch's tokens from `start` on (a stream sends each
        token's once). A token's text is what it added to the branch's text: joined, they are
        the text, and text_offset indexes it. An echoed prompt's come first (`with_prompt`), and
        the offsets count its text."""
        if self.request.logprobs is None:
            return None
        answer = self._tokens_logprobs_json(branch, start)
        if not (with_prompt and self.request.score_prompt):
            return answer
        prompt = self.prompt_logprobs_json(branch)
        return {key: prompt[key] + answer[key] for key in prompt}

    def _tokens_logprobs_json(self, branch: int, start: int) -> dict:
        events, pieces = self.logprobs[branch][start:], self.texts[branch].pieces[start:]
        tops = []  # per token: {(id, text): log-prob}
        for j, event in enumerate(events):
            texts = self._alternative_texts(branch, start + j, [i for i, _ in event.top])
            tops.append({(i, text): lp for (i, lp), text in zip(event.top, texts)})
        if self.chat:
            def entry(text: str, logprob: float) -> dict:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [{**entry(text, event.logprob), "top_logprobs": [entry(t, lp) for (_, t), lp in top.items()]}
                                for text, event, top in zip(pieces, events, tops)]}
        offsets, at = [], sum(len(piece) for piece in self.texts[branch].pieces[:start]) + len(self.echo)
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": pieces, "token_logprobs": [event.logprob for event in events],
                "top_logprobs": [{text: lp for (_, text), lp in top.items()} for top in tops], "text_offset": offsets}


class PromptsChoices:
    """The choices of several prompts' completions (each its own process) as one request's: the
    branches of the first prompt, then the second's, ...; their events merged as they come."""

    def __init__(self, parts: list[Choices]):
        self.parts = parts
        self.texts = [text for part in parts for text in part.texts]
        self.logprobs = [events for part in parts for events in part.logprobs]
        self._owners = [(part, branch) for part in parts for branch in range(part.request.n)]

    @property
    def finish_reasons(self) -> list[str | None]:
        return [reason for part in self.parts for reason in part.finish_reasons]

    @property
    def info(self) -> PromptInfo | None:
        infos = [part.info for part in self.parts if part.info is not None]
        return PromptInfo(sum(i.prompt_tokens for i in infos), sum(i.cached_tokens for i in infos)) if infos else None

    @property
    def completion_tokens(self) -> int:
        return sum(part.completion_tokens for part in self.parts)

    def logprobs_json(self, branch: int, start: int = 0, with_prompt: bool = True) -> dict | None:
        part, own = self._owners[branch]
        return part.logprobs_json(own, start, with_prompt)

    def prompt_logprobs_json(self, branch: int) -> dict | None:
        part, own = self._owners[branch]
        return part.prompt_logprobs_json(own)

    def prompt_scored(self) -> bool:
        return all(part.prompt_scored() for part in self.parts)

    async def events(self, tenant: Tenant) -> AsyncIterator[tuple[int, str, list[TokenEvent], str | None]]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(offset: int, part: Choices) -> None:
            try:
                async for branch, text, tokens, reason in part.events(tenant):
                    await queue.put((offset + branch, text, tokens, reason))
            except Exception as error:  # (a quota's refusal, a failed process): the request's
                await queue.put(error)
            finally:
                await queue.put(done)

        offsets = [sum(p.request.n for p in self.parts[:i]) for i in range(len(self.parts))]
        tasks = [asyncio.ensure_future(pump(offset, part)) for offset, part in zip(offsets, self.parts)]
        try:
            finished = 0
            while finished < len(tasks):
                item = await queue.get()
                if item is done:
                    finished += 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


async def _respond(request: Request, body: SamplingBody, completions: list[CompletionRequest], chat: bool,
                   plan: ToolPlan | None = None, echo: list[str] | None = None,
                   pieces: list[list[str]] | None = None):
    """The response to `completions` (several: one a prompt of a /v1/completions request, their
    choices in prompt order, n each, as OpenAI and vLLM number them); `echo`: each prompt's text,
    put before its choices' text."""
    state: ServerState = request.app.state.symphony
    tenant = tenant_of(request)
    pieces = pieces or [None] * len(completions)
    choices = Choices(state, completions[0], chat, pieces[0]) if len(completions) == 1 else \
        PromptsChoices([Choices(state, completion, chat, part) for completion, part in zip(completions, pieces)])
    count = sum(completion.n for completion in completions)
    scoring = completions[0].score_prompt  # echo with log-probabilities (its text: the prompt's pieces)
    echoed = [prefix for prefix, completion in zip(echo, completions) for _ in range(completion.n)] if echo else None
    created, cid, model = int(time.time()), _completion_id(chat), body.model
    kind = "chat.completion" if chat else "text_completion"

    def message(i: int) -> tuple[dict, str]:
        """A chat choice's message and finish reason: a tool call when the answer is one."""
        text, reason = choices.texts[i].text, choices.finish_reasons[i] or "length"
        call = parse_call(text, plan) if plan is not None else None
        if call is not None:
            return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
        return {"role": "assistant", "content": text}, reason

    if not body.stream:
        await _unless_gone(request, choices.events(tenant))
        def choice(i: int) -> dict:
            if chat:
                answer, reason = message(i)
                return {"index": i, "message": answer, "logprobs": choices.logprobs_json(i), "finish_reason": reason}
            return {"index": i, "text": (echoed[i] if echoed else "") + choices.texts[i].text,
                    "logprobs": choices.logprobs_json(i), "finish_reason": choices.finish_reasons[i] or "length"}
        return {"id": cid, "object": kind, "created": created, "model": model,
                "choices": [choice(i) for i in range(count)],
                "usage": _usage(choices.info, choices.completion_tokens)}

    include_usage = bool((body.stream_options or {}).get("include_usage"))
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(payload_choices: list[dict], usage: dict | None = None) -> str:
        data: dict[str, Any] = {"id": cid, "object": chunk_kind, "created": created, "model": model,
                                "choices": payload_choices}
        if include_usage:
            data["usage"] = usage
        return f"data: {json.dumps(data)}\n\n"

    # The process starts before the response does, so a quota refusal is still a 403 (a check
    # here and a start in the stream let concurrent requests pass the check together). The
    # headers go once it has started, not after the prompt's forward pass (events' first item).
    events = choices.events(tenant)
    first = await anext(events, None)
    buffered: list = []  # events taken early: those before an echo's log-probabilities came

    async def started() -> AsyncIterator[tuple[int, str, list[TokenEvent], str | None]]:
        if first is not None:
            yield first
        async for item in events:
            yield item

    stream = started()

    async def rest() -> AsyncIterator[tuple[int, str, list[TokenEvent], str | None]]:
        for item in buffered:
            yield item
        async for item in stream:
            yield item

    async def sse() -> AsyncIterator[str]:
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(count)])
            elif echoed:
                if scoring:  # the echo carries the prompt's log-probabilities: wait for them
                    while not choices.prompt_scored():
                        item = await anext(stream, None)
                        if item is None:
                            break
                        buffered.append(item)
                yield chunk([{"index": i, "text": echoed[i], "finish_reason": None,
                              "logprobs": choices.prompt_logprobs_json(i) if scoring else None} for i in range(count)])
            if plan is not None:  # a tool call is known once whole: each answer in one delta at its end
                async for _ in rest():
                    pass
                for i in range(count):
                    answer, reason = message(i)
                    delta = {"content": answer["content"]} if "tool_calls" not in answer else \
                        {"tool_calls": [{"index": 0, **answer["tool_calls"][0]}]}
                    yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}])
            async for branch, text, tokens, reason in (rest() if plan is None else _nothing()):
                if not text and not tokens and reason is None:
                    continue
                logprobs = choices.logprobs_json(branch, len(choices.logprobs[branch]) - len(tokens),
                                                 with_prompt=False) if tokens else None
                if chat:
                    yield chunk([{"index": branch, "delta": {"content": text} if text else {},
                                  "logprobs": logprobs, "finish_reason": reason}])
                else:
                    yield chunk([{"index": branch, "text": text, "logprobs": logprobs, "finish_reason": reason}])
            if include_usage:
                yield chunk([], _usage(choices.info, choices.completion_tokens))
        except (CompletionFailed, QuotaExceeded) as error:
            kind = "quota_exceeded" if isinstance(error, QuotaExceeded) else "server_error"
            yield f"data: {json.dumps({'error': {'message': str(error), 'type': kind}})}\n\n"
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")


async def _nothing() -> AsyncIterator:
    return
    yield


async def _unless_gone(request: Request, events: AsyncIterator) -> None:
    """Run `events` to the end, or stop it (which kills its process) once the client has gone."""
    async def consume():
        async for _ in events:
            pass

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise OpenAIError(499, "the client closed the request")  # nobody reads it: logged as such
        await task
    finally:  # this handler cancelled (a timeout, the server stopping): the process goes too
        task.cancel()


async def _guarded(handler) -> Any:
    try:
        return await handler()
    except OpenAIError as error:
        return error.response()
    except HTTPException as error:  # the server's own checks (the bearer token)
        kind, code = ("authentication_error", "invalid_api_key") if error.status_code == 401 else \
            ("invalid_request_error", None)
        return OpenAIError(error.status_code, str(error.detail), kind=kind, code=code).response()
    except QuotaExceeded as error:
        return OpenAIError(403, str(error), kind="quota_exceeded").response()
    except CompletionFailed as error:
        return OpenAIError(500, str(error), kind="server_error").response()
    except Exception:  # a bug of ours: logged, and answered in OpenAI's shape
        log.exception("an OpenAI-compatible request failed")
        return OpenAIError(500, "internal error (logged by the server)", kind="server_error").response()


@router.get("/models")
async def models(request: Request):
    async def handle():
        state: ServerState = request.app.state.symphony
        tenant_of(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(state.started_at),
                                            "owned_by": "symphony", "max_model_len": state.engine.max_model_len}
                                           for name in served_model_names(state)]}
    return await _guarded(handle)


@router.post("/completions")
async def completions(request: Request):
    async def handle():
        state: ServerState = request.app.state.symphony
        tenant_of(request)
        body: CompletionBody = await _parse(request, CompletionBody)
        prompts = body.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]  # one prompt: a string, or its token ids
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise OpenAIError(400, f"a request takes 1 to {MAX_PROMPTS} prompts", param="prompt")
        completions, texts, pieces = [], [], []
        scoring = bool(body.echo) and body.logprobs is not None  # the prompt's log-probabilities too
        for prompt in prompts:
            # Tokenizing a long prompt takes a while: off the event loop.
            ids = await asyncio.to_thread(state.engine.tokenize, prompt) if isinstance(prompt, str) else list(prompt)
            completion = _sampling(state, body, ids, body.max_tokens, body.logprobs, chat=False)
            completions.append(dataclasses.replace(completion, score_prompt=True) if scoring else completion)
            if scoring:  # the echo is the prompt's tokens' texts, joined (two short decodes a token: off the loop)
                pieces.append(await asyncio.to_thread(prompt_pieces, state.engine.detokenize, ids))
                texts.append("".join(pieces[-1]))
            elif body.echo:
                texts.append(prompt if isinstance(prompt, str) else await asyncio.to_thread(state.engine.detokenize, ids))
        return await _respond(request, body, completions, chat=False, echo=texts or None, pieces=pieces or None)
    return await _guarded(handle)


@router.post("/chat/completions")
async def chat_completions(request: Request):
    async def handle():
        state: ServerState = request.app.state.symphony
        tenant_of(request)
        body: ChatBody = await _parse(request, ChatBody)
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        try:
            plan = plan_tools(body.tools, body.tool_choice)
        except ToolError as error:
            raise OpenAIError(400, str(error), param=error.param) from None
        prompt_ids = await asyncio.to_thread(_chat_prompt, state, body, plan)  # templating and tokenizing: off the loop
        return await _respond(request, body, [_sampling(state, body, prompt_ids, max_tokens, top, chat=True, plan=plan)],
                              chat=True, plan=plan)
    return await _guarded(handle)


def _check_model(state: ServerState, model: str | None) -> None:
    """The 404 for a `model` this server does not serve (None: the request names none)."""
    names = served_model_names(state)
    if model is not None and model not in names:
        raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                               f"{' or '.join(map(repr, names))}", param="model", code="model_not_found")


@tokens_router.post("/tokenize")
async def tokenize(request: Request):
    """The token ids of a prompt, or of messages in the model's chat template (vLLM's /tokenize)."""
    async def handle():
        state: ServerState = request.app.state.symphony
        tenant_of(request)
        body: TokenizeBody = await _parse(request, TokenizeBody)
        _check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give a prompt or messages, not both", param="prompt")
        if body.messages is not None:
            text = await asyncio.to_thread(_chat_text, state, body.messages, body.add_generation_prompt)
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        ids = await asyncio.to_thread(state.engine.tokenize, text, special)
        return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
    return await _guarded(handle)


@tokens_router.post("/detokenize")
async def detokenize(request: Request):
    """The text of token ids (vLLM's /detokenize)."""
    async def handle():
        state: ServerState = request.app.state.symphony
        tenant_of(request)
        body: DetokenizeBody = await _parse(request, DetokenizeBody)
        _check_model(state, body.model)
        vocab = state.engine.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise OpenAIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(state.engine.detokenize, body.tokens)}
    return await _guarded(handle)


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
async def no_such_route(request: Request, path: str):
    """Any other /v1 route: a 404 in OpenAI's shape, which its clients read (embeddings, say)."""
    return OpenAIError(404, f"this server has no {request.method} /v1/{path}", kind="invalid_request_error",
                       code="not_found").response()
