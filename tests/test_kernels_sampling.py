"""The batched sampling kernel against a float64 reference written out per row: greedy and the
top log-probs exactly; seeded draws for determinism, for never leaving the allowed/kept set,
and for their frequencies over many seeds (a chi-square bound loose enough never to flake,
on fixed seeds, so a run is reproducible)."""
from __future__ import annotations

import math

import pytest
import torch

from symphony_os.kernels.sampling import sample

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOGIT_DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
        DEVICE != "cuda", reason="bf16 kernels are checked on a GPU; the CPU interpreter checks fp32")),
]


def processed_logits(logits: torch.Tensor, bias: dict[int, float] | None, allowed: torch.Tensor | None):
    """float64 logits of one row after bias and the allowed mask."""
    x = logits.double().cpu().clone()
    for token, value in (bias or {}).items():
        x[token] += value
    if allowed is not None:
        x[~allowed.cpu()] = float("-inf")
    return x


def reference_probs(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """The distribution one row is drawn from (float64), as symphony_os.engine.sampling defines it."""
    if temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).double()
    y = (x - x.max()) / temperature
    if min_p > 0:
        # Keep the test away from the cut, where float32 rounding could decide.
        assert (y - math.log(min_p)).abs().min() > 1e-3, "pick a min_p away from a token's probability ratio"
        y = y.masked_fill(y < math.log(min_p), float("-inf"))
    if 0 < top_k < y.numel():
        y = y.masked_fill(y < y.topk(top_k).values[-1], float("-inf"))
    probs = y.softmax(-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        # Keep the test away from the cut, where float order of summation could decide.
        assert (cumulative - top_p).abs().min() > 1e-3, "pick a top_p away from a cumulative sum"
        drop = cumulative - sorted_probs >= top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum()


def as_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [B, V] -> int32 [B, ceil(V / 32)], bit j % 32 of word j // 32 set when j is allowed."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    bits = torch.zeros(rows, words * 32, dtype=torch.int64, device=allowed.device)
    bits[:, :vocab] = allowed.long()
    packed = (bits.view(rows, words, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def params(rows: int, temperature=0.0, top_k=0, top_p=1.0, seeds=None, min_p=0.0) -> dict:
    return dict(
        temperature=torch.full((rows,), temperature, device=DEVICE),
        top_k=torch.full((rows,), top_k, dtype=torch.int32, device=DEVICE),
        top_p=torch.full((rows,), top_p, device=DEVICE),
        seeds=(torch.arange(rows) if seeds is None else seeds).to(DEVICE),
        **({"log_min_p": torch.full((rows,), math.log(min_p), device=DEVICE)} if min_p > 0 else {}),
    )


def random_bias(rows: int, vocab: int, generator: torch.Generator):
    """Sparse biases, padded with -1: row r has r % 3 + 1 entries of +-4 (enough to move argmax)."""
    ids = torch.full((rows, 3), -1, dtype=torch.int32)
    values = torch.zeros(rows, 3)
    biases = []
    for row in range(rows):
        count = row % 3 + 1
        tokens = torch.randperm(vocab, generator=generator)[:count]
        signs = torch.randint(0, 2, (count,), generator=generator) * 8.0 - 4.0
        ids[row, :count], values[row, :count] = tokens.int(), signs
        biases.append(dict(zip(tokens.tolist(), signs.tolist())))
    return ids.to(DEVICE), values.to(DEVICE), biases


@pytest.mark.parametrize("logit_dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("vocab", [50, 3000])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bitmask"])
def test_greedy_is_argmax_after_bias_and_mask(mask_kind, vocab, logit_dtype):
    rows = 6
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=generator).to(DEVICE, logit_dtype)
    logits[0, 3] = logits[0, 7] = 20.0  # a tie: the lower id wins
    bias_ids, bias_values, biases = random_bias(rows, vocab, generator)
    biases[0] = {}
    bias_ids[0] = -1
    allowed = torch.rand(rows, vocab, generator=generator) < 0.5
    allowed[0, [3, 7]] = True
    allowed = allowed.to(DEVICE)
    mask = {"none": None, "bool": allowed, "bitmask": as_bitmask(allowed)}[mask_kind]
    out = sample(logits, **params(rows), bias_ids=bias_ids, bias_values=bias_values, allowed=mask)
    expected = [int(processed_logits(logits[r], biases[r], None if mask is None else allowed[r]).argmax())
                for r in range(rows)]
    assert out.token_ids.dtype == torch.int64 and out.topk_ids is None
    assert out.token_ids.tolist() == expected
    assert expected[0] == 3


@pytest.mark.parametrize("logit_dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("vocab", [40, 3000])
def test_top_logprobs_are_log_softmax_of_processed_logits(vocab, logit_dtype):
    rows, k = 5, 6
    generator = torch.Generator().manual_seed(vocab + 1)
    logits = (3 * torch.randn(rows, vocab, generator=generator)).to(DEVICE, logit_dtype)
    bias_ids, bias_values, biases = random_bias(rows, vocab, generator)
    allowed = (torch.rand(rows, vocab, generator=generator) < 0.7).to(DEVICE)
    # Sampled rows too: the log-probs do not depend on temperature, top-k or top-p.
    out = sample(logits, **params(rows, temperature=0.5, top_k=3, top_p=0.9),
                 bias_ids=bias_ids, bias_values=bias_values, allowed=allowed, num_logprobs=k)
    assert out.topk_ids.shape == (rows, k) and out.topk_logprobs.dtype == torch.float32
    for r in range(rows):
        log_probs = processed_logits(logits[r], biases[r], allowed[r]).log_softmax(-1)
        # Most likely first, ties (common with bf16 logits) to the lower id.
        ids = torch.tensor(sorted(range(vocab), key=lambda token: (-log_probs[token], token))[:k])
        values = log_probs[ids]
        assert out.topk_ids[r].tolist() == ids.tolist()
        torch.testing.assert_close(out.topk_logprobs[r].cpu().double(), values, rtol=0, atol=1e-5)
        assert int(out.token_ids[r]) in ids[:3].tolist()  # drawn from the top 3


def test_top_k_keeps_every_token_tied_with_the_kth():
    draws, vocab = 3000, 10
    row = torch.tensor([0.0, 2.0, 0.5, 2.0, 1.0, 2.0, -1.0, 1.9, 0.0, 0.0])
    out = sample(row.expand(draws, vocab).contiguous().to(DEVICE), **params(draws, temperature=1.0, top_k=2))
    counts = torch.bincount(out.token_ids.cpu(), minlength=vocab)
    assert counts[[1, 3, 5]].sum() == draws
    assert counts[[1, 3, 5]].min() > draws / 3 - 150  # each tied token about a third of the time


def test_draws_are_deterministic_per_seed_and_independent_of_the_batch():
    vocab = 30
    generator = torch.Generator().manual_seed(0)
    row = torch.randn(1, vocab, generator=generator)
    logits = row.expand(64, vocab).contiguous().to(DEVICE)
    seeds = torch.arange(64) * 7919 + 2**40  # 64-bit seeds
    first = sample(logits, **params(64, temperature=1.0, seeds=seeds)).token_ids
    second = sample(logits, **params(64, temperature=1.0, seeds=seeds)).token_ids
    assert torch.equal(first, second)
    assert len(set(first.tolist())) > 5, "different seeds must give different draws"
    alone = sample(logits[:1], **params(1, temperature=1.0, seeds=seeds[10:11])).token_ids
    assert int(alone) == int(first[10])


def test_min_p_keeps_the_tokens_at_least_min_p_as_likely_as_the_best_and_leaves_greedy_rows_alone():
    rows, vocab = 256, 40
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=generator) * 2
    min_p = torch.where(torch.arange(rows) % 2 == 0, 0.3, 0.02)
    temperature = torch.where(torch.arange(rows) % 4 == 3, 0.0, 0.9)  # a quarter greedy
    out = sample(logits.to(DEVICE), temperature.to(DEVICE), torch.zeros(rows, dtype=torch.int32, device=DEVICE),
                 torch.ones(rows, device=DEVICE), torch.arange(rows).to(DEVICE), log_min_p=min_p.log().to(DEVICE))
    kept_counts = set()
    for r, token in enumerate(out.token_ids.tolist()):
        if temperature[r] == 0:
            assert token == int(logits[r].argmax())
            continue
        y = (logits[r] - logits[r].max()) / float(temperature[r])
        assert y[token] >= math.log(float(min_p[r])) - 1e-6
        kept_counts.add(int((y >= math.log(float(min_p[r]))).sum()))
    assert len(kept_counts) > 3  # rows kept sets of several sizes


def test_filtered_and_disallowed_tokens_are_never_drawn():
    rows, vocab = 768, 24
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=generator)
    allowed = torch.rand(rows, vocab, generator=generator) < 0.6
    allowed[:, 0] = True
    # Three kinds of rows: top-k 3, top-p 0.5 (the cut may fall near a cumulative sum here,
    # so only the support is checked, with the cut's token allowed either way), and mask only.
    kind = torch.arange(rows) % 3
    temperature = torch.where(kind == 2, 2.0, 0.8)
    top_k = torch.where(kind == 0, 3, 0).int()
    top_p = torch.where(kind == 1, 0.5, 1.0)
    out = sample(logits.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE),
                 torch.arange(rows).to(DEVICE), allowed=as_bitmask(allowed.to(DEVICE)))
    for r, token in enumerate(out.token_ids.tolist()):
        y = processed_logits(logits[r], None, allowed[r]) / float(temperature[r])
        assert allowed[r, token]
        if kind[r] == 0:
            assert y[token] >= y.topk(3).values[-1]
        elif kind[r] == 1:
            probs = y.softmax(-1)
            assert probs[probs > probs[token]].sum() < 0.5 + 1e-6


CONFIGS = {
    "plain": dict(temperature=1.0),
    "hot-top-k": dict(temperature=1.5, top_k=5),
    "cold-top-p": dict(temperature=0.7, top_p=0.8),
    "everything": dict(temperature=0.6, top_k=8, top_p=0.9, bias=True, mask=True),
    "min-p": dict(temperature=1.2, min_p=0.12),
    "min-p-then-top-k-and-top-p": dict(temperature=1.3, min_p=0.07, top_k=6, top_p=0.85, bias=True, mask=True),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_draws_follow_the_reference_distribution(config):
    settings = dict(CONFIGS[config])
    draws, vocab = 4096, 20
    generator = torch.Generator().manual_seed(11)
    row = torch.randn(vocab, generator=generator)
    bias = {4: 2.0, 9: -1.5, 17: 1.0} if settings.pop("bias", False) else None
    allowed = (torch.arange(vocab) % 4 != 1) if settings.pop("mask", False) else None
    x = processed_logits(row, bias, allowed)
    probs = reference_probs(x, settings["temperature"], settings.get("top_k", 0), settings.get("top_p", 1.0),
                            settings.get("min_p", 0.0))

    kwargs = {}
    if bias:
        kwargs["bias_ids"] = torch.tensor([list(bias)] * draws, dtype=torch.int32, device=DEVICE)
        kwargs["bias_values"] = torch.tensor([list(bias.values())] * draws, device=DEVICE)
    if allowed is not None:
        kwargs["allowed"] = allowed.expand(draws, vocab).contiguous().to(DEVICE)
    out = sample(row.expand(draws, vocab).contiguous().to(DEVICE), **params(draws, **settings), **kwargs)
    counts = torch.bincount(out.token_ids.cpu(), minlength=vocab).double()

    assert counts[probs == 0].sum() == 0, "a token outside the kept set was drawn"
    expected = probs * draws
    # Pool cells expected fewer than 5 times into one, as a chi-square test needs.
    small = (expected > 0) & (expected < 5)
    observed = torch.cat([counts[expected >= 5], counts[small].sum()[None]])
    expected = torch.cat([expected[expected >= 5], expected[small].sum()[None]])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    # Far beyond the 1e-6 tail for these degrees of freedom: a wrong distribution (a missed
    # temperature, cut or bias) lands in the hundreds or thousands.
    assert chi_square < dof + 10 * math.sqrt(2 * dof) + 10, (chi_square, dof, observed, expected)
