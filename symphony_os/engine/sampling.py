"""What a `pred` call returns, and the logits processing that produces it.

A request asks for one of four things (the `want` of a `PredRequest`):
- `Distribution()`: the full next-token probability distribution (the paper's semantics);
- `TopK(k)`: the k most likely ids with their log-probabilities;
- `Sample(...)`: one token (greedy when temperature is 0), after a repetition penalty, logit
  bias, an allowed-token mask, temperature, min-p, top-k and top-p;
- `GreedyEach()`: the argmax after every appended token (speculative decoding's verification;
  the engine answers it itself, from the logits of every row of the request);
- `ScoreEach(k)`: each appended token's log-probability given those before it, with the top k
  there (an echoed prompt's log-probabilities; the engine answers it from every row too).

`process_logits` answers a batch: on CUDA with batched kernels on the device
(`process_logits_batched`), elsewhere row by row on the host (`process_logits_reference`, the
definition the device path is tested against).
"""
from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidArgument
from .grammar import apply_bitmask

# TopK rows up to this k take the sampling kernel's top log-probs (one pass over the row per
# rank); beyond it, torch.topk's radix select costs less.
KERNEL_MAX_TOP_K = 32
MAX_TOP_LOGPROBS = 32  # of a sampled token (Sample.top_logprobs): one kernel pass each

FLOAT32_MAX = torch.finfo(torch.float32).max  # a logit bias beyond it is inf in the batch's float32 logits
# The smallest temperature used: a smaller positive one is 0 in float32 (the device path ran it
# greedy, the host divided by 0 and raised); at this one the tokens tied at the largest logit
# are drawn among, the rest are at -inf.
FLOAT32_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Distribution:
    """Return the softmax of the logits (float32, length vocab_size).

    `taken_at_once`: the caller takes the answer as soon as it comes (a blocking pred): on the
    host, the row's logits are kept until then, and `PredResult.write_probs` takes the softmax
    straight into where the caller wants it (a LIP's buffer: no tensor of its own, no copy). A
    row kept holds its whole batch's logits: a request that may wait longer is answered with a
    softmax of its own (a batch of one row is always kept)."""

    taken_at_once: bool = False


@dataclass(frozen=True)
class TopK:
    """Return the `k` most likely token ids and their log-probabilities, most likely first."""

    k: int


@dataclass(frozen=True)
class Sample:
    """Choose one token.

    temperature 0 is greedy (argmax); any finite positive one, however small, samples (the
    logits are scaled relative to the largest, so none overflows: a vanishing one draws among
    the tokens tied at the largest logit). top_k keeps the k most likely tokens and every
    token tied with the k-th; top_p, of those, the fewest most likely whose probability
    reaches top_p and every token tied with the last of them (on the host and the device
    alike). `seed` makes this one draw reproducible (a LIP that
    wants a reproducible sequence passes seed + step); the draw for a seed differs between the
    host and the device path, each is deterministic. `logit_bias` maps token id -> value added
    to its logit; `allowed_tokens` restricts the choice to those ids (constrained decoding);
    `grammar` to the tokens a grammar allows next (engine/grammar.py), which the token drawn
    then moves on. `repetition_penalty` (vLLM's and transformers') divides the positive logits
    of the `penalized` ids by it and multiplies their negative ones (a caller lists the tokens
    of its prompt and output there); `min_p` keeps, after the temperature, only the tokens at
    least min_p times as likely as the most likely one. `logprobs` also answers the token's
    log-probability, and `top_logprobs` the most likely tokens' (ids and log-probabilities, most
    likely first, ties to the lower id): the model's own, its log-softmax at temperature 1
    before any of the above (vLLM's default).

    The order: repetition penalty, logit bias, the allowed tokens and the grammar, then greedy
    (argmax), or temperature, min-p, top-k and top-p among those left, and the draw.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)
    allowed_tokens: tuple[int, ...] | None = None
    # A grammar.Grammar: the token is drawn among those it allows next (and with allowed_tokens,
    # among both), and moves it on.
    grammar: object | None = field(default=None, hash=False, compare=False)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    penalized: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True)
class GreedyEach:
    """Return the greedy (argmax) next token after every appended token: n tokens for n inputs.
    One such pred verifies a whole speculative draft."""


@dataclass(frozen=True)
class ScoreEach:
    """Score the appended tokens: for each one but the first, its log-probability given those
    before it, and the `k` most likely tokens in its place (ids and log-probabilities, most
    likely first, ties in id order): the model's own, its log-softmax. n - 1 answers for n >= 2
    tokens, and no next token: what an echoed prompt's log-probabilities are made of."""

    k: int = 0


Want = Distribution | TopK | Sample | GreedyEach | ScoreEach
GREEDY = Sample()  # the default: shared, since building a Sample costs more than using one


@dataclass(slots=True)
class PredResult:
    """The answer to one `pred` request; only the fields its `want` asked for are set.

    A distribution computed on a GPU stays there (`distribution`) until `probs` is read; the
    host's for a batch of one row is not computed until asked for (`logits` holds the row):
    `write_probs` then takes the softmax straight into its destination, a LIP's memory.
    """

    token: int | None = None
    logprob: float | None = None  # a Sample's with logprobs: its token's
    tokens: list[int] | None = None  # GreedyEach: one per appended token
    # ScoreEach: per appended token but the first, its log-probability and the top k's ids and theirs
    scores: list[float] | None = None
    score_top_ids: list[list[int]] | None = None
    score_top_logprobs: list[list[float]] | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    distribution: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # a host Distribution's logits row, until its softmax is taken
    error: BaseException | None = None  # this row failed (the engine fails its request alone)

    @property
    def probs(self) -> torch.Tensor | None:
        """The distribution as a float32 CPU tensor (taken or copied from the device on first
        read). Safe to read from more than one thread: `distribution` is set before `logits` is
        cleared."""
        if self.distribution is None:
            logits = self.logits
            if logits is not None:
                self.distribution = torch.softmax(logits, dim=-1).cpu()
                self.logits = None
        elif self.distribution.device.type != "cpu":
            self.distribution = self.distribution.cpu()
        return self.distribution

    @property
    def vocab_size(self) -> int:
        """The length of the distribution, without taking it (a Distribution's result only)."""
        logits = self.logits
        source = logits if logits is not None else self.distribution
        if source is None:
            raise ValueError("this result holds no distribution: its pred did not ask for one")
        return source.numel()

    def write_probs(self, out: torch.Tensor) -> None:
        """Write the distribution into `out`, a float32 host tensor of `vocab_size`: the host's
        softmax straight into it, or one copy from the device (measured on the CPU, 24,576
        floats, caches cold as after a forward pass: 139 us against 151 for a softmax into a
        tensor of its own and a copy of that)."""
        if out.shape != (self.vocab_size,):
            raise ValueError(f"write_probs needs room for exactly {self.vocab_size} floats, got {tuple(out.shape)}")
        logits = self.logits
        if logits is not None and logits.device == out.device:
            torch.softmax(logits, dim=-1, out=out)
        else:
            out.copy_(self.distribution if self.distribution is not None else self.probs)


def validate_want(want: Want, vocab_size: int) -> None:
    """Raise InvalidArgument for a request that cannot be served."""
    if want is GREEDY or isinstance(want, GreedyEach):
        return
    if want.__class__ is Sample:
        _validate_sample(want, vocab_size)
        return
    if isinstance(want, Distribution):
        return
    if isinstance(want, TopK):
        if not 1 <= want.k <= vocab_size:
            raise InvalidArgument(f"top-k needs 1 <= k <= {vocab_size}, got {want.k}")
        return
    if isinstance(want, ScoreEach):
        if not 0 <= want.k <= min(vocab_size, MAX_TOP_LOGPROBS):
            raise InvalidArgument(f"score-each takes 0 <= k <= {min(vocab_size, MAX_TOP_LOGPROBS)}, got {want.k}")
        return
    if not isinstance(want, Sample):
        raise InvalidArgument(f"unknown pred output {want!r}")
    _validate_sample(want, vocab_size)


def _validate_sample(want: Sample, vocab_size: int) -> None:
    if not 0 <= want.temperature < math.inf:
        raise InvalidArgument(f"temperature must be finite and >= 0, got {want.temperature}")
    if not 0 < want.top_p <= 1:
        raise InvalidArgument(f"top_p must be in (0, 1], got {want.top_p}")
    if want.top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0, got {want.top_k}")
    if want.seed is not None and not -2**63 <= want.seed < 2**64:
        raise InvalidArgument(f"a seed is a 64-bit integer, got {want.seed}")
    if not 0 <= want.min_p <= 1:
        raise InvalidArgument(f"min_p must be in [0, 1], got {want.min_p}")
    if not 0 < want.repetition_penalty < math.inf:
        raise InvalidArgument(f"repetition_penalty must be finite and > 0, got {want.repetition_penalty}")
    if want.penalized and any(not isinstance(i, int) or not 0 <= i < vocab_size for i in want.penalized):
        raise InvalidArgument(f"penalized token ids must be in [0, {vocab_size})")
    if not 0 <= want.top_logprobs <= min(vocab_size, MAX_TOP_LOGPROBS) or (want.top_logprobs and not want.logprobs):
        raise InvalidArgument(f"top_logprobs must be in [0, {min(vocab_size, MAX_TOP_LOGPROBS)}], with logprobs")
    if not want.logit_bias and want.allowed_tokens is None:  # (most: no ids to check)
        return
    if not all(abs(value) <= FLOAT32_MAX for value in want.logit_bias.values()):  # (NaN fails too)
        raise InvalidArgument(f"logit_bias values must be finite float32 numbers (at most {FLOAT32_MAX:g})")
    ids = list(want.logit_bias) + list(want.allowed_tokens or ())
    if any(not isinstance(i, int) or not 0 <= i < vocab_size for i in ids):
        raise InvalidArgument(f"token ids in logit_bias / allowed_tokens must be in [0, {vocab_size})")
    if want.allowed_tokens is not None and not want.allowed_tokens:
        raise InvalidArgument("allowed_tokens must not be empty")


def process_logits(logits: torch.Tensor, wants: list[Want], default_generator: torch.Generator,
                   grammar_masks: dict | None = None) -> list[PredResult]:
    """logits [N, V] float32 (one row per request) -> one PredResult per request. Unseeded
    draws take their randomness from `default_generator`. `grammar_masks`: {row: its grammar's
    bitmask, or the error computing it} computed already (the engine does it during the
    forward pass); rows not in it compute their own."""
    if logits.is_cuda:
        return process_logits_batched(logits, wants, default_generator, grammar_masks)
    return process_logits_reference(logits, wants, default_generator, grammar_masks)


# ---- the host reference ----

def _grammar_mask(want: Sample, given) -> torch.Tensor:
    """The row's grammar bitmask: the one computed already (raising its error), else now."""
    if given is not None:
        if isinstance(given, Exception):
            raise given
        return given
    return want.grammar.next_bitmask()


def _penalize(logits: torch.Tensor, ids, penalty: float) -> torch.Tensor:
    """logits with those at `ids` (repeats allowed) under a repetition penalty: a positive one
    divided by it, a negative one multiplied."""
    ids = torch.as_tensor(ids, dtype=torch.int64, device=logits.device)
    chosen = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(chosen > 0, chosen / penalty, chosen * penalty)
    return logits


def _min_p_cut(tempered: torch.Tensor, min_p: float) -> torch.Tensor:
    """Tempered logits (the largest 0) without the tokens less than min_p times as likely as the
    most likely: below log(min_p), in float32 (the kernel compares the same numbers)."""
    return tempered.masked_fill(tempered < float(np.float32(math.log(min_p))), float("-inf"))


def _sample_row(logits: torch.Tensor, want: Sample, generator: torch.Generator, grammar_mask=None) -> int:
    if want.penalized and want.repetition_penalty != 1:
        logits = _penalize(logits, want.penalized, want.repetition_penalty)
    if want.logit_bias:
        ids = torch.tensor(list(want.logit_bias), device=logits.device)
        logits = logits.index_add(0, ids, torch.tensor(list(want.logit_bias.values()), device=logits.device))
    if want.allowed_tokens is not None:
        masked = torch.full_like(logits, float("-inf"))
        ids = torch.tensor(want.allowed_tokens, device=logits.device)
        masked[ids] = logits[ids]
        logits = masked
    if want.grammar is not None:
        logits = apply_bitmask(logits, _grammar_mask(want, grammar_mask))
        if not bool(torch.isfinite(logits.max())):
            raise InvalidArgument("no token can be drawn: every token the grammar allows has a logit of -inf")
    if want.temperature == 0:
        return int(logits.argmax())
    # Relative to the largest: at most 0, so no temperature, however small, overflows (the
    # largest stays 0) and the softmax below is never NaN (kernels/sampling.py does the same).
    logits = (logits - logits.max()) / max(want.temperature, FLOAT32_TINY)
    if want.min_p > 0:
        logits = _min_p_cut(logits, want.min_p)
    if want.top_k and want.top_k < logits.numel():
        threshold = torch.topk(logits, want.top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if want.top_p < 1.0:
        sorted_probs, _ = probs.sort(descending=True)
        # Drop a token when the tokens before it already reach top_p (the first always stays),
        # unless it ties with the last one kept.
        last_kept = sorted_probs[~(sorted_probs.cumsum(0) - sorted_probs >= want.top_p)][-1]
        probs = probs.masked_fill(probs < last_kept, 0.0)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def top_k_of_row(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest of a 1-D tensor, largest first, ties to the lower id
    (torch.topk orders ties as it likes, and may keep a higher id tied at the k-th)."""
    k = min(k, values.numel())
    threshold = torch.topk(values, k).values[-1]
    candidates = (values >= threshold).nonzero().squeeze(1)  # ascending ids
    order = values[candidates].sort(descending=True, stable=True).indices[:k]
    return values[candidates[order]], candidates[order]


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of tied maxima, as torch's). On the host through numpy,
    whose argmax is SIMD: 0.7 ms for 128 x 32,000 float32s against torch's 3.2 ms, which was
    most of the engine's host time per greedy token at batch 128 on a CPU."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def process_logits_reference(logits: torch.Tensor, wants: list[Want], default_generator: torch.Generator,
                             grammar_masks: dict | None = None) -> list[PredResult]:
    """Row by row on the host, with torch's own ops; seeded draws use torch.Generator(seed). A
    row that raises gets a result holding its `error`, and the other rows are answered."""
    results: list[PredResult] = []
    log_probs = greedy = None
    for row, want in enumerate(wants):
        try:
            if isinstance(want, Distribution):
                # The softmax waits to be taken straight into where it goes (PredResult.write_probs)
                # when that is soon or costs nothing to wait for: a row kept for later holds the
                # batch's logits (a LIP's unwaited tickets count one row each), and a copy of its
                # own costs more than it saves (bench/NOTES.md).
                if want.taken_at_once or len(logits) == 1:
                    results.append(PredResult(logits=logits[row]))
                else:
                    results.append(PredResult(distribution=torch.softmax(logits[row], dim=-1).cpu()))
            elif isinstance(want, TopK):
                if log_probs is None:
                    log_probs = torch.log_softmax(logits, dim=-1)
                values, ids = top_k_of_row(log_probs[row], want.k)
                results.append(PredResult(top_ids=ids.tolist(), top_logprobs=values.tolist()))
            elif want is GREEDY or (want.temperature == 0 and not want.logit_bias and want.allowed_tokens is None
                                    and want.grammar is None and not want.penalized and not want.logprobs):
                if greedy is None:  # one argmax over the batch, one transfer
                    greedy = _argmax_rows(logits)
                results.append(PredResult(token=greedy[row]))
            else:
                generator = default_generator
                if want.seed is not None:
                    generator = torch.Generator().manual_seed(want.seed)
                token = _sample_row(logits[row], want, generator, (grammar_masks or {}).get(row))
                if want.grammar is not None:
                    want.grammar.consume(token)
                result = PredResult(token=token)
                if want.logprobs:
                    model = torch.log_softmax(logits[row].float(), dim=-1)
                    result.logprob = float(model[token])
                    if want.top_logprobs:
                        values, ids = top_k_of_row(model, want.top_logprobs)
                        result.top_ids, result.top_logprobs = ids.tolist(), values.tolist()
                results.append(result)
        except Exception as error:  # one request's failure is its own: the batch's other rows go on
            # Kept without its frames, which hold the batch's logits until the request is answered.
            error.add_note("".join(traceback.format_tb(error.__traceback__)).rstrip())
            results.append(PredResult(error=error.with_traceback(None)))
    return results


# ---- batched, on the device ----

def _upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or array on `device`; to a GPU through pinned memory, without a sync."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]: a slice when the rows are consecutive (the usual, homogeneous batch)."""
    if rows[-1] - rows[0] == len(rows) - 1:
        return logits[rows[0]:rows[-1] + 1]
    return logits.index_select(0, _upload(rows, torch.int64, logits.device))


def _as_int64(seed: int) -> int:
    """Any seed torch.Generator.manual_seed takes, folded one-to-one into int64."""
    return (seed + 2**63) % 2**64 - 2**63


def _allowed_bitmask(wants: list[Sample], vocab_size: int, grammar_masks: list) -> np.ndarray:
    """int32 [rows, ceil(V / 32)]: bit j % 32 of word j // 32 set when token j is allowed (by
    `allowed_tokens`, and by the row's grammar mask, when it has one)."""
    words = np.full((len(wants), -(-vocab_size // 32)), 0xFFFFFFFF, dtype=np.uint32)
    for row, want in enumerate(wants):
        if want.allowed_tokens is not None:
            ids = np.asarray(want.allowed_tokens, dtype=np.int64)
            words[row] = 0
            np.bitwise_or.at(words[row], ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
        if grammar_masks[row] is not None:  # and, with allowed tokens, those the grammar allows too
            words[row] &= grammar_masks[row].numpy().view(np.uint32)
    return words.view(np.int32)


def _sample_rows(logits: torch.Tensor, wants: list[Sample], default_generator: torch.Generator,
                 grammar_masks: list):
    """Token ids [rows] of the Sample rows, drawn by one call of the sampling kernel
    (`grammar_masks`: each row's grammar's bitmask, or None)."""
    from ..kernels.sampling import sample  # imports triton: only where a batch needs it

    device = logits.device
    if any(want.penalized and want.repetition_penalty != 1 for want in wants):
        logits = _penalize_rows(logits, wants)
    unseeded = [row for row, want in enumerate(wants) if want.seed is None]
    seeds = [_as_int64(want.seed) if want.seed is not None else 0 for want in wants]
    if unseeded:
        for row, seed in zip(unseeded, torch.randint(0, 2**63 - 1, (len(unseeded),), generator=default_generator).tolist()):
            seeds[row] = seed
    kwargs = {}
    num_bias = max(len(want.logit_bias) for want in wants)
    if num_bias:
        bias_ids = np.full((len(wants), num_bias), -1, dtype=np.int64)
        bias_values = np.zeros((len(wants), num_bias), dtype=np.float32)
        for row, want in enumerate(wants):
            bias_ids[row, :len(want.logit_bias)] = list(want.logit_bias)
            bias_values[row, :len(want.logit_bias)] = list(want.logit_bias.values())
        kwargs.update(bias_ids=_upload(bias_ids, torch.int64, device),
                      bias_values=_upload(bias_values, torch.float32, device))
    if any(want.allowed_tokens is not None or mask is not None for want, mask in zip(wants, grammar_masks)):
        kwargs["allowed"] = _upload(_allowed_bitmask(wants, logits.shape[1], grammar_masks), torch.int32, device)
    temperatures = [max(w.temperature, FLOAT32_TINY) if w.temperature > 0 else 0.0 for w in wants]
    rows = [temperatures, [w.top_p for w in wants]]
    if any(want.min_p > 0 for want in wants):
        rows.append([math.log(w.min_p) if w.min_p > 0 else -math.inf for w in wants])
    floats = _upload(rows, torch.float32, device)
    if len(rows) == 3:
        kwargs["log_min_p"] = floats[2]
    ints = _upload([[w.top_k for w in wants], seeds], torch.int64, device)
    return sample(logits, floats[0], ints[0], floats[1], ints[1], **kwargs).token_ids


def _penalize_rows(logits: torch.Tensor, wants: list[Sample]) -> torch.Tensor:
    """A copy of the Sample rows' logits with each row's repetition penalty applied (`_penalize`,
    batched): one gather and one scatter. A row's padding repeats its first penalized id (the
    same value written twice); a row without one rewrites column 0 as it was."""
    width = max(len(want.penalized) for want in wants)
    ids = np.zeros((len(wants), width), dtype=np.int64)
    factors = np.ones(len(wants), dtype=np.float32)
    for row, want in enumerate(wants):
        if want.penalized and want.repetition_penalty != 1:
            ids[row] = want.penalized[0]
            ids[row, :len(want.penalized)] = want.penalized
            factors[row] = want.repetition_penalty
    ids = _upload(ids, torch.int64, logits.device)
    factors = _upload(factors, torch.float32, logits.device)[:, None].to(logits.dtype)
    chosen = logits.gather(1, ids)
    return logits.clone().scatter_(1, ids, torch.where(chosen > 0, chosen / factors, chosen * factors))


def _top_k_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probs) [rows, k], most likely first, ties to the lower id."""
    if k > KERNEL_MAX_TOP_K:
        rows = [top_k_of_row(row, k) for row in torch.log_softmax(logits, dim=-1)]
        return torch.stack([ids for _, ids in rows]), torch.stack([values for values, _ in rows])
    from ..kernels.sampling import sample

    rows, device = logits.shape[0], logits.device
    zeros = torch.zeros(rows, dtype=torch.int64, device=device)
    out = sample(logits, zeros.float(), zeros, torch.ones(rows, device=device), zeros, num_logprobs=k)
    return out.topk_ids, out.topk_logprobs


def process_logits_batched(logits: torch.Tensor, wants: list[Want], default_generator: torch.Generator,
                           given_masks: dict | None = None) -> list[PredResult]:
    """The same answers from batched work on logits' device: one Triton `sample` call for the
    Sample rows, one top-k pass for the TopK rows, one softmax for the Distribution rows, then
    a single device-to-host copy of every token and top-k list. Greedy tokens and top-k lists
    equal the reference's (ties to the lower id); seeded draws come from the kernel's Philox
    stream instead of torch.Generator. On CPU tensors this needs TRITON_INTERPRET=1 (tests)."""
    results = [PredResult() for _ in wants]
    rows_of: dict[type, list[int]] = {Distribution: [], TopK: [], Sample: []}
    for row, want in enumerate(wants):
        rows_of[type(want)].append(row)

    if rows_of[Distribution]:
        probs = torch.softmax(_rows(logits, rows_of[Distribution]), dim=-1)
        for i, row in enumerate(rows_of[Distribution]):
            results[row].distribution = probs[i]

    # The grammars' masks first, on the host: a grammar that fails fails its row alone.
    grammar_masks: dict[int, torch.Tensor] = {}
    for row in [row for row in rows_of[Sample] if wants[row].grammar is not None]:
        try:
            grammar_masks[row] = _grammar_mask(wants[row], (given_masks or {}).get(row))
        except Exception as error:
            results[row].error = error
            rows_of[Sample].remove(row)
    # Everything the host needs goes back in one float64 tensor (ids < 2**53 are exact).
    parts: list[torch.Tensor] = []
    if rows_of[Sample]:
        parts.append(_sample_rows(_rows(logits, rows_of[Sample]), [wants[r] for r in rows_of[Sample]],
                                  default_generator, [grammar_masks.get(r) for r in rows_of[Sample]]))
    max_k = max((wants[r].k for r in rows_of[TopK]), default=0)
    if max_k:
        parts.extend(_top_k_rows(_rows(logits, rows_of[TopK]), max_k))
    # The Sample rows that asked for log-probabilities: their model's (the raw logits'), the drawn
    # token's picked on the device from the kernel's tokens, and the top ones by the kernel too.
    scored = [i for i, row in enumerate(rows_of[Sample]) if wants[row].logprobs]
    max_top = max((wants[rows_of[Sample][i]].top_logprobs for i in scored), default=0)
    if scored:
        raw = _rows(logits, [rows_of[Sample][i] for i in scored])
        drawn = parts[0].index_select(0, _upload(scored, torch.int64, logits.device)).clamp(min=0)
        parts.append(torch.log_softmax(raw.float(), dim=-1).gather(1, drawn[:, None]))
        if max_top:
            parts.extend(_top_k_rows(raw, max_top))
    if not parts:
        return results
    host = torch.cat([part.reshape(-1).double() for part in parts]).cpu().tolist()

    tokens = host[:len(rows_of[Sample])]
    for row, token in zip(rows_of[Sample], tokens):
        if token < 0:  # the kernel's failed row: as the reference's, its error is its own
            results[row].error = RuntimeError("sampling failed: the row's logits are not finite "
                                              "(NaN, +inf, or every allowed token at -inf)")
        else:
            results[row].token = int(token)
            if row in grammar_masks:
                try:
                    wants[row].grammar.consume(int(token))
                except Exception as error:
                    results[row].token, results[row].error = None, error
    top = len(tokens)
    ids_at, logprobs_at = top, top + len(rows_of[TopK]) * max_k
    for i, row in enumerate(rows_of[TopK]):
        k = wants[row].k
        results[row].top_ids = [int(t) for t in host[ids_at + i * max_k:ids_at + i * max_k + k]]
        results[row].top_logprobs = host[logprobs_at + i * max_k:logprobs_at + i * max_k + k]
    chosen_at = logprobs_at + len(rows_of[TopK]) * max_k
    ids_at, logprobs_at = chosen_at + len(scored), chosen_at + len(scored) + len(scored) * max_top
    for i, position in enumerate(scored):
        result, k = results[rows_of[Sample][position]], wants[rows_of[Sample][position]].top_logprobs
        if result.error is None:
            result.logprob = host[chosen_at + i]
            if k:
                result.top_ids = [int(t) for t in host[ids_at + i * max_top:ids_at + i * max_top + k]]
                result.top_logprobs = host[logprobs_at + i * max_top:logprobs_at + i * max_top + k]
    return results
