"""`process_logits` on the device path (the batched Triton kernel: on the GPU when there is one,
else in Triton's CPU interpreter) against the host reference on the same logits: the same
greedy tokens, top-k lists and distributions, row order kept in mixed batches, and seeded
draws that repeat per call and stay inside the allowed / kept set."""
from __future__ import annotations

import pytest
import torch

from symphony_os.engine.sampling import (KERNEL_MAX_TOP_K, Distribution, Sample, TopK, process_logits_batched,
                                         process_logits_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 300


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def both(logits: torch.Tensor, wants):
    reference = process_logits_reference(logits, wants, torch.Generator().manual_seed(0))
    batched = process_logits_batched(logits.to(DEVICE), wants, torch.Generator().manual_seed(0))
    return reference, batched


def test_mixed_batch_matches_the_reference_row_by_row():
    wants = [TopK(5), Sample(), Distribution(), Sample(logit_bias={7: 50.0}), TopK(KERNEL_MAX_TOP_K + 8),
             Sample(allowed_tokens=(3, 30, 299)), TopK(1), Sample(logit_bias={5: -100.0, 9: 2.5}, allowed_tokens=(5, 9))]
    logits = random_logits(len(wants))
    logits[1, 11] = logits[1, 12] = 40.0  # a tie: the lower id wins on both paths
    reference, batched = both(logits, wants)
    for row, (want, ref, got) in enumerate(zip(wants, reference, batched)):
        if isinstance(want, Sample):
            assert got.token == ref.token, f"row {row}"
        elif isinstance(want, TopK):
            assert got.top_ids == ref.top_ids, f"row {row}"
            assert got.top_logprobs == pytest.approx(ref.top_logprobs, abs=1e-5)
        else:
            assert got.probs.device.type == "cpu"
            torch.testing.assert_close(got.probs, ref.probs, rtol=0, atol=1e-6)
    assert [batched[r].token for r in (1, 3, 5, 7)] == [11, 7, 3, 9]


def test_a_repetition_penalty_and_min_p_give_the_same_tokens_on_both_paths():
    """The penalty divides a penalized token's positive logit and multiplies a negative one
    (the greedy rows show it); min-p keeps only the tokens near the best (a tiny min-p keeps
    every one, a min-p of 1 the best alone, so a seeded draw is the argmax)."""
    logits = random_logits(6, seed=4)
    best, runner_up = logits[0].topk(2).indices.tolist()
    lowest = int(logits[1].argmin())
    logits[1, lowest] = -0.5  # a negative logit, made the largest by a penalty below 1
    logits[1, :lowest] = logits[1, lowest + 1:] = -1.0  # (the rest lower still)
    wants = [Sample(repetition_penalty=50.0, penalized=(best, best)),  # repeated: penalized once
             Sample(repetition_penalty=0.5, penalized=(lowest,)),
             Sample(temperature=0.8, seed=7, min_p=1.0, repetition_penalty=1.3, penalized=(1, 2, 3)),
             Sample(temperature=0.8, seed=7, min_p=1e-30),
             Sample(),
             Sample(temperature=0.5, seed=3, top_k=4, min_p=0.2, logit_bias={5: 1.0}, penalized=(5, 6),
                    repetition_penalty=2.0)]
    reference, batched = both(logits, wants)
    deterministic = (0, 1, 2, 4)  # (a seed's draw differs between the paths; each repeats)
    assert [batched[r].token for r in deterministic] == [reference[r].token for r in deterministic]
    assert batched[0].token == runner_up and batched[1].token == lowest
    penalized = logits[2].clone()
    penalized[[1, 2, 3]] = torch.where(penalized[[1, 2, 3]] > 0, penalized[[1, 2, 3]] / 1.3, penalized[[1, 2, 3]] * 1.3)
    assert batched[2].token == int(penalized.argmax())
    plain = both(logits[3:4], [Sample(temperature=0.8, seed=7)])
    assert batched[3].token == plain[1][0].token and reference[3].token == plain[0][0].token
    row = logits[5].clone()
    row[[5, 6]] = torch.where(row[[5, 6]] > 0, row[[5, 6]] / 2, row[[5, 6]] * 2)
    row[5] += 1.0
    tempered = (row - row.max()) / 0.5
    kept = set((tempered >= torch.log(torch.tensor(0.2))).nonzero().flatten().tolist()) & set(tempered.topk(4).indices.tolist())
    assert {batched[5].token, reference[5].token} <= kept


def test_a_sampled_token_comes_with_the_models_log_probabilities_on_both_paths():
    """Whatever the draw's options (a bias, a grammar-like mask, a penalty), the log-probabilities
    are the model's own: log-softmax of the raw logits, the drawn token's and the top ones."""
    logits = random_logits(4, seed=5)
    wants = [Sample(logprobs=True, top_logprobs=3), Sample(logprobs=True, logit_bias={7: 100.0}),
             Sample(temperature=0.9, seed=2, logprobs=True, top_logprobs=5, allowed_tokens=(3, 4, 5),
                    repetition_penalty=1.5, penalized=(3,)),
             Sample(top_logprobs=0)]
    for results in both(logits, wants):
        model = torch.log_softmax(logits, dim=-1)
        assert results[1].token == 7 and results[2].token in (3, 4, 5)
        for row in range(3):
            assert results[row].logprob == pytest.approx(float(model[row, results[row].token]), abs=1e-5)
        for row, k in ((0, 3), (2, 5)):
            values, ids = model[row].topk(k)
            assert results[row].top_ids == ids.tolist()
            assert results[row].top_logprobs == pytest.approx(values.tolist(), abs=1e-5)
        assert results[1].top_ids is None and results[3].logprob is None


def test_homogeneous_greedy_batch_matches_argmax():
    logits = random_logits(64, seed=1)
    _, batched = both(logits, [Sample()] * 64)
    assert [r.token for r in batched] == logits.argmax(-1).tolist()


def test_seeded_draws_repeat_per_call_and_stay_in_the_kept_set():
    logits = random_logits(1, seed=2).expand(40, VOCAB).contiguous().to(DEVICE)
    seeded = [Sample(temperature=1.0, seed=s) for s in range(40)]
    first = [r.token for r in process_logits_batched(logits, seeded, torch.Generator())]
    again = [r.token for r in process_logits_batched(logits, seeded[::-1], torch.Generator())][::-1]
    assert first == again  # a seed's draw depends neither on the call nor on its row
    assert len(set(first)) > 1
    greedy = int(logits[0].argmax())
    allowed = (10, 11, 12)
    filtered = [Sample(temperature=2.0, seed=s, allowed_tokens=allowed) for s in range(10)]
    filtered += [Sample(temperature=1.0, top_k=1, seed=s) for s in range(10)]
    filtered += [Sample(temperature=1.0, top_p=1e-6, seed=s) for s in range(10)]
    tokens = [r.token for r in process_logits_batched(logits[:30], filtered, torch.Generator())]
    assert set(tokens[:10]) <= set(allowed)
    assert tokens[10:] == [greedy] * 20


# x - max x and its quotient go to -inf for far-apart logits on purpose (the interpreter runs on numpy,
# which warns; a GPU does not).
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_a_vanishing_temperature_or_a_bias_at_the_float_limit_still_gives_a_token_on_both_paths():
    """logits / temperature overflowed to inf, and inf - inf is NaN: the host's multinomial
    raised (failing its whole batch) and the kernel drew the lowest id that overflowed. Relative
    to the row's largest logit nothing overflows: the draw is the argmax, or a biased token."""
    logits = random_logits(5, seed=4)
    wants = [Sample(temperature=1e-45), Sample(temperature=1e-45, seed=3), Sample(temperature=1e-30, top_k=3, top_p=0.5),
             Sample(temperature=1e-5, logit_bias={5: 3.4e38, 6: 3.4e38}, seed=1),
             Sample(temperature=1.0, top_p=0.5, logit_bias={5: 3.4e38, 6: -3.4e38})]
    for results in both(logits, wants):
        tokens = [r.token for r in results]
        assert tokens[:3] == logits[:3].argmax(-1).tolist()
        assert tokens[3] in (5, 6) and tokens[4] == 5


def test_unseeded_draws_follow_the_default_generator():
    logits = random_logits(16, seed=3).to(DEVICE)
    wants = [Sample(temperature=1.5)] * 16

    def draw(seed):
        return [r.token for r in process_logits_batched(logits, wants, torch.Generator().manual_seed(seed))]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU: on CPU distributions are host tensors already")
def test_distribution_stays_on_the_device_until_read():
    (result,) = process_logits_batched(random_logits(1).to(DEVICE), [Distribution()], torch.Generator())
    assert result.distribution.is_cuda
    assert result.probs.device.type == "cpu" and abs(float(result.probs.sum()) - 1) < 1e-5


@pytest.mark.parametrize("path,rows", [("reference", 1), ("reference", 2), ("batched", 2)])
def test_write_probs_writes_the_distribution_into_a_host_buffer(path, rows):
    """What a LIP's pred gets: `write_probs` fills a host buffer (a view of guest memory) with
    exactly `probs`, whether the softmax is still to be taken (the host path's batch of one),
    was taken already, or was taken on the device; `vocab_size` is known without taking it."""
    logits = random_logits(rows, seed=4)
    process = process_logits_reference if path == "reference" else process_logits_batched
    results = process(logits.to(DEVICE) if path == "batched" else logits, [Distribution()] * rows,
                      torch.Generator())
    memory = torch.full((rows * VOCAB + 8,), -1.0)
    for row, result in enumerate(results):
        assert result.vocab_size == VOCAB
        with pytest.raises(ValueError):  # never more or less than the distribution
            result.write_probs(memory[4:4 + VOCAB - 1])
        result.write_probs(memory[4 + row * VOCAB:4 + (row + 1) * VOCAB])
    assert torch.equal(memory[:4], torch.full((4,), -1.0)) and torch.equal(memory[-4:], torch.full((4,), -1.0))
    for row, result in enumerate(results):
        assert torch.equal(memory[4 + row * VOCAB:4 + (row + 1) * VOCAB], result.probs)
        torch.testing.assert_close(result.probs, torch.softmax(logits[row], dim=-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 8])
def test_a_distribution_taken_at_once_goes_straight_into_its_buffer(rows):
    """`Distribution(taken_at_once=True)` (a blocking pred): the row's logits wait for the caller,
    whose `write_probs` takes the softmax straight into its buffer (a suspended LIP's memory),
    exactly there and nowhere else; a row that may wait longer, in a batch of several, gets a
    softmax of its own."""
    logits = random_logits(rows, seed=6)
    memory = torch.full((rows * VOCAB + 8,), -1.0)
    buffers = [memory[4 + row * VOCAB:4 + (row + 1) * VOCAB] for row in range(rows)]
    wants = [Distribution(taken_at_once=True)] * rows + [Distribution()]
    results = process_logits_reference(torch.cat([logits, logits[:1]]), wants, torch.Generator())
    for row, (buffer, result) in enumerate(zip(buffers, results)):
        assert result.logits is not None and result.distribution is None  # left for the caller
        result.write_probs(buffer)
        torch.testing.assert_close(buffer, torch.softmax(logits[row], dim=-1), rtol=0, atol=1e-6)
    assert torch.equal(memory[:4], torch.full((4,), -1.0)) and torch.equal(memory[-4:], torch.full((4,), -1.0))
    waits = results[-1]
    assert waits.logits is None and waits.distribution is not None
    torch.testing.assert_close(waits.probs, torch.softmax(logits[0], dim=-1), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="exactly"):
        results[0].write_probs(torch.zeros(VOCAB - 1))


@pytest.mark.parametrize("rows", [1, 8])
def test_a_kept_host_distribution_holds_its_own_row_only(rows):
    """A result holds one row's worth of memory, not the whole batch's logits: a LIP's unwaited
    tickets are counted at one row each (syscalls' distribution_bytes)."""
    results = process_logits_reference(random_logits(rows, seed=5), [Distribution()] * rows, torch.Generator())
    for result in results:
        held = result.logits if result.logits is not None else result.distribution
        assert held.untyped_storage().nbytes() == 4 * VOCAB
        assert result.probs.untyped_storage().nbytes() == 4 * VOCAB


def test_rows_with_non_finite_logits_fail_alone_on_both_paths():
    """The kernel drew from nothing: token 2^31 - 1 (past the vocabulary) or an arbitrary id,
    where the reference raised for the row."""
    logits = random_logits(4, seed=5)
    logits[0, 10] = float("inf")
    logits[1, 11] = float("nan")
    logits[2, 3] = float("-inf")
    wants = [Sample(temperature=1.0, top_k=5, top_p=0.9), Sample(temperature=1.0), Sample(temperature=1.0, allowed_tokens=(3,)),
             Sample(temperature=1.0, seed=1)]
    for results in both(logits, wants):
        assert [r.error is not None for r in results] == [True, True, True, False]
        assert 0 <= results[3].token < VOCAB


def test_temperatures_below_float32s_smallest_draw_among_the_tied_on_both_paths():
    """1e-50 is 0 in float32: the device path ran greedy and the host divided by 0 and raised."""
    logits = random_logits(1, seed=6)
    logits[0, 3] = logits[0, 20] = 50.0
    for path in (process_logits_reference, process_logits_batched):
        tokens = {path(logits.to(DEVICE), [Sample(temperature=1e-50, seed=seed)], torch.Generator())[0].token
                  for seed in range(32)}
        assert tokens == {3, 20}, path.__name__


def test_top_p_keeps_every_token_tied_with_the_last_kept_on_both_paths():
    """The kernel kept the ties at the cut and the host a prefix of its sort order: {0, 1, 2, 3}
    against {0, 1} at top_p 0.3."""
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, :4] = 5.0
    for path in (process_logits_reference, process_logits_batched):
        tokens = {path(logits.to(DEVICE), [Sample(temperature=1.0, top_p=0.3, seed=seed)], torch.Generator())[0].token
                  for seed in range(64)}
        assert tokens == {0, 1, 2, 3}, path.__name__


def test_top_k_lists_put_ties_in_id_order_on_both_paths():
    logits = random_logits(1, seed=7)
    logits[0, 3] = logits[0, 20] = 40.0
    logits[0, 299] = logits[0, 100] = 30.0
    for k in (3, KERNEL_MAX_TOP_K + 8):
        reference, batched = both(logits, [TopK(k)])
        assert reference[0].top_ids[:4] == batched[0].top_ids[:4] == [3, 20, 100, 299][:k]
        assert reference[0].top_ids == batched[0].top_ids
