"""Text completion as a process of the built-in LIP `complete` (builtin/complete.c): the
request encoded for it, its frames decoded, and the text of each branch assembled on the
host, with stop strings held back while streaming."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from ..lip.limits import ended_by_limit
from ..wasm.program import Program
from .process_table import ProcessTable
from .program_store import StoredProgram
from .tenants import QuotaExceeded, Tenant

HEADER = struct.Struct("<iiiiffiiQ")
FRAME_PROMPT, FRAME_TOKEN, FRAME_FINISH, FRAME_PROMPT_SCORES = 1, 2, 3, 4
EXIT_LIMIT = 3  # the program's exit code when a host call was refused by a limit or quota
MAX_BRANCHES, MAX_TOP_LOGPROBS, MAX_STOPS = 16, 20, 8


class CompletionFailed(Exception):
    """The completion process did not finish; the message says why."""


@dataclass(frozen=True)
class CompletionRequest:
    prompt_ids: list[int]
    max_tokens: int = 16
    n: int = 1
    logprobs: int | None = None  # top log-probabilities per token (0: just the chosen token's)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # (kind, source) of a grammar every token keeps to (engine/grammar.py's kinds), or None.
    grammar: tuple[int, str] | None = None
    top_k: int = 0  # 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    score_prompt: bool = False  # echo with logprobs: the prompt's tokens scored (PromptScores), no cached prefix
    min_tokens: int = 0
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off; on the prompt's and the output's tokens (vLLM's)

    def encode(self) -> bytes:
        head = HEADER.pack(len(self.prompt_ids), self.max_tokens, self.n,
                           -1 if self.logprobs is None else self.logprobs, self.temperature, self.top_p,
                           self.seed is not None, len(self.stop), (self.seed or 0) % 2**64)
        stops = b"".join(struct.pack("<i", len(s.encode())) + s.encode() for s in self.stop)
        kind, source = self.grammar if self.grammar is not None else (-1, "")
        grammar = struct.pack("<ii", kind, len(source.encode())) + source.encode()
        flags = int(self.ignore_eos) | int(self.score_prompt) << 1
        extras = struct.pack("<iiiffffi", self.top_k, flags, self.min_tokens, self.presence_penalty,
                             self.frequency_penalty, self.min_p, self.repetition_penalty, len(self.logit_bias))
        bias = b"".join(struct.pack("<if", token, value) for token, value in self.logit_bias)
        return head + struct.pack(f"<{len(self.prompt_ids)}i", *self.prompt_ids) + stops + grammar + extras + bias


@dataclass(frozen=True)
class PromptInfo:
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class TokenEvent:
    branch: int
    token: int
    logprob: float | None
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class PromptScores:
    """Prompt tokens `first`.. scored: each one's log-probability given those before it, and
    the top ones there [(id, logprob)]."""
    first: int
    logprobs: list[float]
    tops: list[list[tuple[int, float]]]


@dataclass(frozen=True)
class FinishEvent:
    branch: int
    reason: str  # "stop" or "length"
    text_end: int | None  # bytes of the branch's text to keep (a stop string starts there)


Event = PromptInfo | TokenEvent | FinishEvent | PromptScores


def decode_frame(data: bytes, wants_logprobs: bool) -> Event:
    tag = struct.unpack_from("<i", data)[0]
    if tag == FRAME_PROMPT:
        _, n_prompt, cached = struct.unpack("<3i", data)
        return PromptInfo(n_prompt, cached)
    if tag == FRAME_TOKEN:
        _, branch, token, logprob, k = struct.unpack_from("<iiifi", data)
        ids = struct.unpack_from(f"<{k}i", data, 20)
        logprobs = struct.unpack_from(f"<{k}f", data, 20 + 4 * k)
        return TokenEvent(branch, token, logprob if wants_logprobs else None, list(zip(ids, logprobs)))
    if tag == FRAME_PROMPT_SCORES:
        _, first, count, k = struct.unpack_from("<4i", data)
        per = 1 + 2 * k
        logprobs, tops = [], []
        for i in range(count):
            at = 16 + 4 * per * i
            logprobs.append(struct.unpack_from("<f", data, at)[0])
            ids = struct.unpack_from(f"<{k}i", data, at + 4)
            tops.append(list(zip(ids, struct.unpack_from(f"<{k}f", data, at + 4 + 4 * k))))
        return PromptScores(first, logprobs, tops)
    if tag == FRAME_FINISH:
        _, branch, reason, text_end = struct.unpack("<4i", data)
        return FinishEvent(branch, "stop" if reason == 0 else "length", None if text_end < 0 else text_end)
    raise CompletionFailed(f"unknown frame {tag} from the completion program")


@dataclass
class BranchText:
    """The text of one branch as tokens arrive. `add` returns what may be streamed now: all of
    the text but a possibly incomplete last character and, with stop strings, nothing from a
    stop string on (the program's finish frame follows) nor the last (longest stop - 1)
    characters, which might begin one.

    Decoding is incremental, as vLLM's: each token decodes only the few ids since the last
    complete character (`prefix_at`..), so a branch of T tokens costs O(T), not O(T^2)."""

    detokenize: Callable[[list[int]], str]
    stops: tuple[str, ...] = ()
    # The prompt's last token: the text is decoded after it and without it, so a first token
    # keeps its leading space (decoded alone, a sentencepiece token loses it). builtin/complete.c
    # finds stop strings in the same text.
    context: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the context, then the branch's tokens
    sent: str = ""
    decoded: str = ""  # the text of ids[:read_at]
    prefix_at: int = 0  # ids[prefix_at:read_at] are decoded again as context for the next ones
    read_at: int = 0
    searched: int = 0  # decoded[:searched] holds no stop string (none that ends there, at least)
    stop_at: int | None = None
    pieces: list[str] = field(default_factory=list)  # what each token added to `decoded` ("" mid-character)

    def __post_init__(self):
        self.ids = list(self.context)
        self.read_at = len(self.context)

    def add(self, token: int) -> str:
        self.ids.append(token)
        # Decode with a little context, as one decode of the whole would (spaces, byte pieces).
        context = self.detokenize(self.ids[self.prefix_at:self.read_at])
        text = self.detokenize(self.ids[self.prefix_at:])
        if len(text) > len(context) and not text.endswith("\ufffd"):
            self.pieces.append(text[len(context):])
            self.decoded += self.pieces[-1]
            self.prefix_at, self.read_at = self.read_at, len(self.ids)
        else:
            self.pieces.append("")
        ready = len(self.decoded)
        if self.stops:
            longest = max(len(stop) for stop in self.stops)
            if self.stop_at is None:
                start = max(0, self.searched - longest + 1)
                found = [at for at in (self.decoded.find(stop, start) for stop in self.stops) if at >= 0]
                self.stop_at = min(found) if found else None
                self.searched = len(self.decoded)
            ready = self.stop_at if self.stop_at is not None else ready - longest + 1
        if ready <= len(self.sent):
            return ""
        delta = self.decoded[len(self.sent):ready]
        self.sent += delta
        return delta

    def finish(self, text_end: int | None) -> str:
        whole, context = self.detokenize(self.ids), self.detokenize(self.context)
        # As complete.c does: without the context where it merged with what follows.
        text = whole[len(context):] if whole.startswith(context) else self.detokenize(self.ids[len(self.context):])
        if text_end is not None:
            text = text.encode()[:text_end].decode("utf-8", "ignore")
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text
        return delta

    @property
    def text(self) -> str:
        return self.sent


async def run_completion(table: ProcessTable, program: Program, entry: StoredProgram, tenant: Tenant,
                         request: CompletionRequest) -> AsyncIterator[Event]:
    """Run the built-in `complete` LIP for `tenant` (a process like any other: it counts against
    the tenant's quotas and is killed if the caller goes away) and yield its events."""
    payload = request.encode()  # before the process starts: nothing to clean up if it fails
    # Its frames are bounded by the request (n * max_tokens tokens), and none may be dropped.
    record = table.launch(tenant, program, entry, [], {}, buffer_bytes=None, measured=False)  # measured as a request
    frames = table.attach(record)
    wants_logprobs = request.logprobs is not None
    try:
        record.process.deliver(payload)
        record.process.close_input()
        while True:
            frame = await frames.get()
            if frame["type"] == "output":
                yield decode_frame(frame["data"], wants_logprobs)
            elif frame["type"] == "exit":
                table.delivered_exit(record)
                if frame["code"] == EXIT_LIMIT:
                    raise QuotaExceeded(record.process.syscalls.last_limit or record.log_tail.strip())
                if ended_by_limit(frame["reason"]):
                    raise QuotaExceeded(f"the completion process was stopped by a limit: {frame['reason']}")
                if frame["code"] != 0:
                    raise CompletionFailed(f"the completion process ended: {frame['reason']}: "
                                           f"{record.log_tail.strip()}")
                return
    finally:
        if record.running:
            table.kill(record, "the request went away")
        table.detach(record, on_purpose=False)
