"""Grammars for constrained decoding, through llguidance: a JSON schema, a regular expression or
a Lark grammar becomes a `Grammar`, a matcher that says before each token which tokens may come
next. A pred that samples under one (`sampling.Sample.grammar`) draws only among those, and the
token drawn moves the matcher on; a program can also move it itself (`accept`, for tokens it
forces), step it back (`rollback`) and copy it (`fork`, for a branch of a beam or a fork).

llguidance computes a token mask lazily, lexer and parser together, with fuel limits on each
step: a grammar that would never end, a huge schema or a regex with exponential blow-up gets an
error (the matcher's), never a hang of the host (tests/test_grammar.py).
"""
from __future__ import annotations

import enum
import threading

import torch

from ..errors import InvalidArgument, Unsupported

MAX_GRAMMAR_BYTES = 1 << 20  # of a grammar's source: a JSON schema, a regex, a Lark grammar


class GrammarKind(enum.IntEnum):
    """What a grammar's source is (the `kind` of the grammar-new system call)."""

    JSON_SCHEMA = 0
    REGEX = 1
    LARK = 2


class Grammar:
    """A matcher over one grammar. Not thread-safe: its owner (a process) uses it while no pred
    of its is in flight (lip/syscalls.py checks), and the engine while one is."""

    __slots__ = ("_matcher", "vocab_size")

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size

    def _check(self) -> None:
        if self._matcher.is_error():
            raise InvalidArgument(f"the grammar failed: {self._matcher.get_error()}")

    def allowed_bitmask(self, out: torch.Tensor) -> None:
        """Write into `out` (int32, one row of ceil(vocab / 32) words, on the CPU) the tokens that
        may come next: bit j % 32 of word j // 32 for token j. Raises InvalidArgument when the
        grammar has failed (its fuel ran out, say)."""
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
        self._check()

    def next_bitmask(self) -> torch.Tensor:
        """`allowed_bitmask` into a new tensor."""
        out = torch.empty(bitmask_words(self.vocab_size), dtype=torch.int32)
        self.allowed_bitmask(out)
        return out

    def consume(self, token: int) -> None:
        """The token drawn under this grammar's mask."""
        if not self._matcher.consume_token(token):
            self._check()
            raise InvalidArgument(f"token {token} is not allowed by the grammar here")

    def accept(self, tokens: list[int]) -> None:
        """Move on by tokens the program chose itself; all of them or, on a token the grammar
        refuses, none (InvalidArgument)."""
        if any(not 0 <= token < self.vocab_size for token in tokens):
            raise InvalidArgument(f"token ids must be in [0, {self.vocab_size})")
        taken = self._matcher.try_consume_tokens(tokens)
        if taken != len(tokens):
            if taken > 0:
                self._matcher.rollback(taken)
            self._check()
            raise InvalidArgument(f"the grammar refuses token {tokens[taken]} (after {taken} of {len(tokens)})")

    def rollback(self, count: int) -> None:
        if count < 0:
            raise InvalidArgument("rollback takes a count >= 0")
        if count and not self._matcher.rollback(count):
            self._check()
            raise InvalidArgument(f"cannot roll the grammar back {count} tokens")

    def fork(self) -> "Grammar":
        return Grammar(self._matcher.deep_copy(), self.vocab_size)

    @property
    def accepting(self) -> bool:
        """May the text end here (the end-of-sequence token is allowed)?"""
        return self._matcher.is_accepting()

    @property
    def stopped(self) -> bool:
        """Must the text end here (nothing but the end of the sequence may come)?"""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Makes Grammars for one model's tokenizer (llguidance's view of it, built on first use)."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._tokenizer = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    import llguidance.hf

                    if self._hf_tokenizer is None:
                        raise Unsupported("this model was loaded without a tokenizer: no grammars")
                    try:
                        self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
                    except Exception as error:  # a tokenizer llguidance cannot read (a WordPiece decoder, say)
                        self._tokenizer = f"grammars are not supported with this model's tokenizer: {error}"
        if isinstance(self._tokenizer, str):  # why there is none
            raise Unsupported(self._tokenizer)
        return self._tokenizer

    def compile(self, kind: int, source: str) -> Grammar:
        """A Grammar from `source`; InvalidArgument, with llguidance's reason, when it is not one."""
        import llguidance

        if len(source.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
            raise InvalidArgument(f"a grammar's source takes at most {MAX_GRAMMAR_BYTES} bytes")
        try:
            kind = GrammarKind(kind)
        except ValueError:
            raise InvalidArgument("grammar kinds: 0 JSON schema, 1 regex, 2 Lark") from None
        make = {GrammarKind.JSON_SCHEMA: _compact_json_schema,
                GrammarKind.REGEX: llguidance.LLMatcher.grammar_from_regex,
                GrammarKind.LARK: llguidance.LLMatcher.grammar_from_lark}[kind]
        try:
            grammar = make(source)
        except (ValueError, TypeError) as error:  # (a schema that is not JSON, say)
            raise InvalidArgument(f"not a grammar: {error}") from None
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"not a grammar: {matcher.get_error()}")
        return Grammar(matcher, self.vocab_size)


def _compact_json_schema(schema: str) -> str:
    """A JSON schema's grammar without free whitespace between tokens (compact JSON, as
    `json.dumps(separators=(",", ":"))` writes): with any amount allowed, a model's most likely
    next token was often another newline, forever. A schema's own "x-guidance" options still win."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of an allowed-token bitmask."""
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask (int32 [ceil(V / 32)]) as a bool per token [V]: True where it allows the token."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` (one row, [V]) with every token the bitmask (int32 [ceil(V / 32)]) leaves out at
    -inf: a new tensor."""
    allowed = allowed_tokens(bitmask, logits.shape[-1])
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
