"""What a `pred` call returns, and the host-side logits processing that produces it.

A request asks for one of three things (the `want` of a `PredRequest`):
- `Distribution()`: the full next-token probability distribution (the paper's semantics);
- `TopK(k)`: the k most likely ids with their log-probabilities;
- `Sample(...)`: one token chosen on the host (greedy when temperature is 0), after logit bias,
  an allowed-token mask, temperature, top-k and top-p.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidArgument


@dataclass(frozen=True)
class Distribution:
    """Return the softmax of the logits (float32, length vocab_size)."""


@dataclass(frozen=True)
class TopK:
    """Return the `k` most likely token ids and their log-probabilities, most likely first."""

    k: int


@dataclass(frozen=True)
class Sample:
    """Choose one token on the host.

    temperature 0 is greedy (argmax). `seed` makes this one draw reproducible (a LIP that wants
    a reproducible sequence passes seed + step). `logit_bias` maps token id -> value added to
    its logit; `allowed_tokens` restricts the choice to those ids (constrained decoding).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)
    allowed_tokens: tuple[int, ...] | None = None


Want = Distribution | TopK | Sample


@dataclass
class PredResult:
    """The answer to one `pred` request; only the fields its `want` asked for are set."""

    token: int | None = None
    probs: torch.Tensor | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


def validate_want(want: Want, vocab_size: int) -> None:
    """Raise InvalidArgument for a request that cannot be served."""
    if isinstance(want, Distribution):
        return
    if isinstance(want, TopK):
        if not 1 <= want.k <= vocab_size:
            raise InvalidArgument(f"top-k needs 1 <= k <= {vocab_size}, got {want.k}")
        return
    if not isinstance(want, Sample):
        raise InvalidArgument(f"unknown pred output {want!r}")
    if not want.temperature >= 0:
        raise InvalidArgument(f"temperature must be >= 0, got {want.temperature}")
    if not 0 < want.top_p <= 1:
        raise InvalidArgument(f"top_p must be in (0, 1], got {want.top_p}")
    if want.top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0, got {want.top_k}")
    ids = list(want.logit_bias) + list(want.allowed_tokens or ())
    if any(not isinstance(i, int) or not 0 <= i < vocab_size for i in ids):
        raise InvalidArgument(f"token ids in logit_bias / allowed_tokens must be in [0, {vocab_size})")
    if want.allowed_tokens is not None and not want.allowed_tokens:
        raise InvalidArgument("allowed_tokens must not be empty")


def _sample_row(logits: torch.Tensor, want: Sample, generator: torch.Generator) -> int:
    if want.logit_bias:
        ids = torch.tensor(list(want.logit_bias), device=logits.device)
        logits = logits.index_add(0, ids, torch.tensor(list(want.logit_bias.values()), device=logits.device))
    if want.allowed_tokens is not None:
        masked = torch.full_like(logits, float("-inf"))
        ids = torch.tensor(want.allowed_tokens, device=logits.device)
        masked[ids] = logits[ids]
        logits = masked
    if want.temperature == 0:
        return int(logits.argmax())
    logits = logits / want.temperature
    if want.top_k and want.top_k < logits.numel():
        threshold = torch.topk(logits, want.top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if want.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = sorted_probs.cumsum(0) - sorted_probs >= want.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def process_logits(logits: torch.Tensor, wants: list[Want], default_generator: torch.Generator) -> list[PredResult]:
    """logits [N, V] float32 (one row per request) -> one PredResult per request."""
    results: list[PredResult] = []
    log_probs = greedy = None
    for row, want in enumerate(wants):
        if isinstance(want, Distribution):
            results.append(PredResult(probs=torch.softmax(logits[row], dim=-1).cpu()))
        elif isinstance(want, TopK):
            if log_probs is None:
                log_probs = torch.log_softmax(logits, dim=-1)
            values, ids = torch.topk(log_probs[row], want.k)
            results.append(PredResult(top_ids=ids.tolist(), top_logprobs=values.tolist()))
        elif want.temperature == 0 and not want.logit_bias and want.allowed_tokens is None:
            if greedy is None:  # one argmax over the batch, one transfer
                greedy = logits.argmax(dim=-1).tolist()
            results.append(PredResult(token=greedy[row]))
        else:
            generator = default_generator
            if want.seed is not None:
                generator = torch.Generator().manual_seed(want.seed)
            results.append(PredResult(token=_sample_row(logits[row], want, generator)))
    return results
