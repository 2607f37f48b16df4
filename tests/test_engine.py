"""The engine: batching invariants, what pred returns, and errors, on a tiny random Llama."""
import threading

import pytest
import torch

from symphony_os.engine import sampling
from symphony_os.engine.loop import Engine
from symphony_os.engine.model_runner import ARGMAX_ROWS
from symphony_os.engine.sampling import Distribution, GreedyEach, Sample, ScoreEach, TopK
from symphony_os.errors import BadHandle, FileBusy, InvalidArgument, PoolExhausted, PositionError, ReadOnlyFile
from symphony_os.kv.kvfs import OpenFlags

PROMPTS = [[1, 5, 9, 17, 33, 65, 3, 12, 100, 7, 8, 9, 10], [1, 40], [1, 90, 91, 92, 93, 94], [1, 7, 7, 7, 7, 7, 7, 7, 7]]


def greedy_alone(engine, prompt, steps):
    """Tokens and final distribution of one sequence run by itself."""
    kv = engine.session()
    h = kv.create()
    tokens, feed, probs = [], prompt, None
    for _ in range(steps):
        probs = engine.pred(kv, h, feed, want=Distribution()).probs
        tokens.append(int(probs.argmax()))
        feed = [tokens[-1]]
    kv.close_all()
    return tokens, probs


def greedy_together(engine, prompts, steps, kv=None, handles=None):
    """The same for many sequences whose preds are all in flight together."""
    kv = kv or engine.session()
    handles = handles or [kv.create() for _ in prompts]
    feeds, tokens, probs = list(prompts), [[] for _ in prompts], [None] * len(prompts)
    for _ in range(steps):
        futures = [engine.submit(kv, h, f, want=Distribution()) for h, f in zip(handles, feeds)]
        engine.run_until_idle()
        for i, fut in enumerate(futures):
            probs[i] = fut.result().probs
            tokens[i].append(int(probs[i].argmax()))
            feeds[i] = [tokens[i][-1]]
    kv.close_all()
    return tokens, probs


def test_chunked_prefill_equals_single_prefill(tiny_llama):
    whole = Engine.from_path(tiny_llama, device="cpu", page_size=4, num_pages=64, token_budget=512)
    chunked = Engine.from_path(tiny_llama, device="cpu", page_size=4, num_pages=64, token_budget=3)
    prompt = PROMPTS[0]
    t1, p1 = greedy_alone(whole, prompt, 5)
    t2, p2 = greedy_alone(chunked, prompt, 5)
    assert t1 == t2
    assert torch.allclose(p1, p2, atol=1e-5)
    assert chunked.stats().batches > whole.stats().batches


def test_batch_of_unrelated_sequences_matches_running_alone(tiny_engine):
    alone = [greedy_alone(tiny_engine, p, 8) for p in PROMPTS]
    before = tiny_engine.stats().batches
    together_tokens, together_probs = greedy_together(tiny_engine, PROMPTS, 8)
    assert tiny_engine.stats().batches - before == 8  # one batch per step for all four
    for (tokens, probs), t, p in zip(alone, together_tokens, together_probs):
        assert t == tokens
        assert torch.allclose(p, probs, atol=1e-5)


def test_forks_decoded_in_one_batch_match_independent_sequences(tiny_engine):
    prefix = PROMPTS[0]
    branches = [[3], [50], [77], [101]]
    expected = [greedy_alone(tiny_engine, prefix + b, 6)[0] for b in branches]
    kv = tiny_engine.session()
    root = kv.create()
    tiny_engine.pred(kv, root, prefix)
    forks = [kv.fork(root) for _ in branches]
    kv.close(root)
    batches = tiny_engine.stats().batches
    tokens, _ = greedy_together(tiny_engine, branches, 6, kv=kv, handles=forks)
    assert tokens == expected
    assert tiny_engine.stats().batches - batches == 6


def test_several_preds_of_one_producer_land_in_one_batch(tiny_engine):
    kv = tiny_engine.session()
    handles = [kv.create() for _ in range(3)]
    futures = [tiny_engine.submit(kv, h, [1, 2 + i]) for i, h in enumerate(handles)]
    assert tiny_engine.step() and not tiny_engine.step()
    assert all(f.done() for f in futures)
    stats = tiny_engine.stats()
    assert (stats.batches, stats.sequences, stats.tokens) == (1, 3, 6)
    kv.close_all()


def test_what_pred_returns(tiny_engine):
    kv = tiny_engine.session()
    h = kv.create()
    probs = tiny_engine.pred(kv, h, [1, 5, 9], want=Distribution()).probs
    assert probs.shape == (128,) and abs(probs.sum().item() - 1) < 1e-5
    kv.truncate(h, 0)
    top = tiny_engine.pred(kv, h, [1, 5, 9], want=TopK(5))
    assert top.top_ids == probs.topk(5).indices.tolist()
    assert torch.allclose(torch.tensor(top.top_logprobs), probs.topk(5).values.log(), atol=1e-5)
    kv.truncate(h, 0)
    assert tiny_engine.pred(kv, h, [1, 5, 9]).token == int(probs.argmax())
    kv.close_all()


def sample_next(engine, prompt, want):
    kv = engine.session()
    h = kv.create()
    token = engine.pred(kv, h, prompt, want=want).token
    kv.close_all()
    return token


def test_sampling_seed_mask_bias_top_k(tiny_engine):
    prompt = [1, 5, 9]
    seeded = [sample_next(tiny_engine, prompt, Sample(temperature=1.0, seed=s)) for s in range(20)]
    assert seeded == [sample_next(tiny_engine, prompt, Sample(temperature=1.0, seed=s)) for s in range(20)]
    assert len(set(seeded)) > 1  # random weights: a flat-ish distribution
    allowed = (10, 11, 12)
    for s in range(20):
        assert sample_next(tiny_engine, prompt, Sample(temperature=2.0, seed=s, allowed_tokens=allowed)) in allowed
    assert sample_next(tiny_engine, prompt, Sample(logit_bias={42: 1e4})) == 42
    greedy = sample_next(tiny_engine, prompt, Sample())
    for s in range(10):
        assert sample_next(tiny_engine, prompt, Sample(temperature=1.0, top_k=1, seed=s)) == greedy
        assert sample_next(tiny_engine, prompt, Sample(temperature=1.0, top_p=1e-6, seed=s)) == greedy


@pytest.mark.parametrize("want", [TopK(0), TopK(1000), Sample(temperature=-1), Sample(top_p=0),
                                  Sample(allowed_tokens=()), Sample(allowed_tokens=(500,)),
                                  Sample(logit_bias={-3: 1.0}), Sample(logit_bias={3: float("nan")}),
                                  Sample(logit_bias={3: float("inf")}), Sample(logit_bias={3: 1e39}),
                                  Sample(temperature=float("inf")), Sample(seed=2**64), Sample(seed=-2**63 - 1), "argmax"])
def test_bad_requests_are_refused_at_submit(tiny_engine, want):
    kv = tiny_engine.session()
    h = kv.create()
    with pytest.raises(InvalidArgument):
        tiny_engine.submit(kv, h, [1, 2], want=want)
    kv.close_all()


def test_a_row_that_fails_fails_only_its_own_request(tiny_engine, monkeypatch):
    """Defence in depth under the validation at submit: whatever still makes one row's sampling
    raise reaches that request alone; its neighbours in the batch get their tokens, its file is
    rolled back, and the engine goes on."""
    real = sampling._sample_row

    def sample_row(logits, want, generator, grammar_mask=None):
        if want.seed == 13:
            raise RuntimeError("this row's sampling broke")
        return real(logits, want, generator, grammar_mask)

    monkeypatch.setattr(sampling, "_sample_row", sample_row)
    kv = tiny_engine.session()
    handles = [kv.create() for _ in range(3)]
    wants = [Sample(temperature=1.0, seed=12), Sample(temperature=1.0, seed=13), Sample()]
    batches = tiny_engine.stats().batches
    futures = [tiny_engine.submit(kv, h, [1, 5, 9], want=w) for h, w in zip(handles, wants)]
    tiny_engine.run_until_idle()
    assert tiny_engine.stats().batches == batches + 1  # the three shared one batch
    with pytest.raises(RuntimeError, match="this row's sampling broke"):
        futures[1].result()
    assert futures[0].result().token == sample_next(tiny_engine, [1, 5, 9], wants[0])
    assert futures[2].result().token == sample_next(tiny_engine, [1, 5, 9], Sample())
    assert [kv.len(h) for h in handles] == [3, 0, 3]
    kv.close_all()


def test_preds_that_all_find_the_pool_full_fail_instead_of_waiting_forever(tiny_llama):
    """Every chunk of a batch short of pages, with nothing to swap to: none runs, so waiting for
    the next batch would wait forever (a chunk waits only while another in its batch runs)."""
    engine = Engine.from_path(tiny_llama, device="cpu", page_size=4, num_pages=8)
    engine.pool.max_swapped = 0
    kv = engine.session()
    hog = kv.create()
    engine.pred(kv, hog, list(range(1, 33)))  # all 8 pages, held open
    futures = [engine.submit(kv, kv.create(), [1, 2, 3]) for _ in range(2)]
    for _ in range(10):
        if not engine.step():
            break
    assert all(f.done() for f in futures)
    for future in futures:
        with pytest.raises(PoolExhausted):
            future.result()
    kv.close_all()
    assert engine.pool.stats().used == 0


def test_bad_tokens_handles_and_read_only_are_refused(tiny_engine):
    kv = tiny_engine.session()
    h = kv.create()
    for tokens in ([], [128], [-1], [1.5]):
        with pytest.raises(InvalidArgument):
            tiny_engine.submit(kv, h, tokens)
    with pytest.raises(InvalidArgument):
        tiny_engine.submit(kv, h, [1, 2], positions=[0])
    # Positions are 32-bit integers, as the guest ABI passes them: a float reached the batch and,
    # two of them, stopped the engine's thread (one was taken, and the file's next position was 3.5).
    for positions in ([2.5], [0.0, 1.0], [2**31], [-2**31 - 1], ["0"]):
        with pytest.raises(InvalidArgument, match="positions must be 32-bit integers"):
            tiny_engine.submit(kv, h, [1] * len(positions), positions=positions)
    kv.close(h)
    with pytest.raises(BadHandle):
        tiny_engine.submit(kv, h, [1])
    named = kv.open("p", OpenFlags.CREATE)
    tiny_engine.pred(kv, named, [1, 2, 3])
    ro = kv.open("p", OpenFlags.READ_ONLY)
    with pytest.raises(ReadOnlyFile):
        tiny_engine.submit(kv, ro, [4])
    kv.close_all()
    kv.remove("p")


def test_position_gap_fails_the_pred_and_leaves_the_file(tiny_engine):
    kv = tiny_engine.session()
    h = kv.create()
    tiny_engine.pred(kv, h, [1, 2, 3])
    with pytest.raises(PositionError):
        tiny_engine.pred(kv, h, [4], positions=[7])
    assert kv.len(h) == 3
    assert tiny_engine.pred(kv, h, [4], positions=[3]).token is not None
    kv.close_all()


def test_exhausted_pool_fails_cleanly_and_rolls_back(tiny_llama):
    engine = Engine.from_path(tiny_llama, device="cpu", page_size=4, num_pages=4, token_budget=6)
    kv = engine.session()
    h = kv.create()
    kv.set_hints(h, pinned=True)
    engine.pred(kv, h, [1, 2, 3])
    with pytest.raises(PoolExhausted):
        engine.pred(kv, h, list(range(1, 20)))  # the first chunk fits, the rest does not
    assert kv.len(h) == 3  # chunks already appended were undone
    assert engine.pred(kv, h, [4]).token is not None
    kv.close_all()
    assert engine.pool.stats().used == 0


def test_closing_a_handle_mid_flight_still_answers_and_frees(tiny_engine):
    kv = tiny_engine.session()
    h = kv.create()
    future = tiny_engine.submit(kv, h, [1, 2, 3])
    kv.close(h)
    tiny_engine.run_until_idle()
    assert future.result().token is not None
    assert tiny_engine.pool.stats().used == 0


def test_a_sessions_queued_preds_are_dropped_and_a_started_one_runs_on(tiny_llama):
    """What a process that ends leaves queued (Engine.drop_queued): preds no batch started go
    at once, files released; a prefill a batch started runs its remaining chunks; another
    session's preds are untouched."""
    engine = Engine.from_path(tiny_llama, device="cpu", page_size=4, num_pages=64, token_budget=8)
    kv, other = engine.session(), engine.session()
    started = engine.submit(kv, kv.create(), list(range(1, 20)))  # 19 tokens: three chunks of 8
    assert engine.step()  # its first chunk ran
    queued = [engine.submit(kv, kv.create(), [1, 2, 3]) for _ in range(3)]
    theirs = engine.submit(other, other.create(), [4, 5])
    used = engine.pool.stats().used
    assert engine.drop_queued(kv) == 3
    assert not any(future.done() for future in queued)  # their answers go to no one
    assert len(engine.scheduler) == 2 and engine.pool.stats().used == used  # (they had no pages yet)
    kv.close_all()
    engine.run_until_idle()
    assert started.result().token is not None and theirs.result().token is not None
    other.close_all()
    assert engine.pool.stats().used == 0


@pytest.mark.parametrize("copy", ["fork", "extract", "merge first", "merge second"])
def test_copying_a_file_with_a_pred_in_flight_is_busy(tiny_engine, copy):
    """fork / extract / merge read the file's KV, which an unanswered pred has not written yet
    (and would leave missing if it failed): refused until it is answered, then as usual."""
    kv = tiny_engine.session()
    h, other = kv.create(), kv.create()
    tiny_engine.pred(kv, other, [1, 7])
    future = tiny_engine.submit(kv, h, PROMPTS[0])
    attempt = {"fork": lambda: kv.fork(h), "extract": lambda: kv.extract(h, 0, kv.len(h)),
               "merge first": lambda: kv.merge(h, other), "merge second": lambda: kv.merge(other, h)}[copy]
    handles, used = kv.open_handles, tiny_engine.pool.stats().used
    with pytest.raises(FileBusy):
        attempt()
    assert kv.open_handles == handles and tiny_engine.pool.stats().used == used  # nothing left behind
    tiny_engine.run_until_idle()
    assert future.result().token is not None
    copied = attempt()
    expected = len(PROMPTS[0]) + (2 if copy.startswith("merge") else 0)
    assert kv.len(copied) == expected
    kv.close_all()
    assert tiny_engine.pool.stats().used == 0


def test_background_thread_serves_many_producers(tiny_engine):
    expected = [greedy_alone(tiny_engine, p, 6)[0] for p in PROMPTS]
    tiny_engine.start()
    results = [None] * len(PROMPTS)

    def produce(i):
        results[i] = greedy_alone(tiny_engine, PROMPTS[i], 6)[0]

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    tiny_engine.stop()
    assert results == expected
    stats = tiny_engine.stats()
    assert stats.batches > 0 and stats.mean_batch_size >= 1 and stats.mean_queue_wait_ms >= 0


# ---- greedy each (pred kind 3): the argmax after every appended token ----

def greedy_step_by_step(engine, tokens):
    """The argmax after each token, one single-token pred at a time."""
    kv = engine.session()
    h = kv.create()
    argmaxes = [int(engine.pred(kv, h, [t], want=Distribution()).probs.argmax()) for t in tokens]
    kv.close_all()
    return argmaxes


def test_greedy_each_shares_a_batch_with_every_other_kind(tiny_engine):
    prompt, other = PROMPTS[0], PROMPTS[2]
    expected = greedy_step_by_step(tiny_engine, prompt)
    kv = tiny_engine.session()
    others = [Distribution(), TopK(3), Sample()]
    alone = [tiny_engine.pred(kv, kv.create(), other, want=want) for want in others]
    before = tiny_engine.stats().batches
    futures = [tiny_engine.submit(kv, kv.create(), prompt, want=GreedyEach())] + [
        tiny_engine.submit(kv, kv.create(), other, want=want) for want in others]
    tiny_engine.run_until_idle()
    assert tiny_engine.stats().batches - before == 1
    each, distribution, top_k, sample = (future.result() for future in futures)
    assert each.tokens == expected
    assert torch.allclose(distribution.probs, alone[0].probs, atol=1e-5)
    assert top_k.top_ids == alone[1].top_ids and sample.token == alone[2].token
    kv.close_all()


def test_score_each_is_each_prefixs_distribution_over_chunks_and_refuses_a_single_token(tiny_llama):
    """ScoreEach: each appended token after the first, scored by the distribution after those
    before it (as one token at a time would score it), the top k there; chunk boundaries change
    nothing (a chunk's last row is scored against the next chunk's first token)."""
    engine = Engine.from_path(tiny_llama, device="cpu", page_size=4, num_pages=64, token_budget=5)
    kv = engine.session()
    tokens = [5, 17, 3, 99, 42, 7, 7, 120, 11, 64, 2, 8]
    scored = engine.pred(kv, kv.create(), tokens, want=ScoreEach(3))
    one_by_one, expected, tops = kv.create(), [], []
    for i, token in enumerate(tokens[:-1]):
        logprobs = torch.log(engine.pred(kv, one_by_one, [token], want=Distribution()).probs)
        expected.append(float(logprobs[tokens[i + 1]]))
        tops.append(logprobs.topk(3).indices.tolist())
    assert scored.scores == pytest.approx(expected, abs=1e-4)
    assert scored.score_top_ids == tops and scored.token is None
    assert all(values == sorted(values, reverse=True) for values in scored.score_top_logprobs)
    with pytest.raises(InvalidArgument, match="at least 2"):
        engine.submit(kv, kv.create(), [5], want=ScoreEach(1))
    with pytest.raises(InvalidArgument, match="score-each"):
        engine.submit(kv, kv.create(), [5, 6], want=ScoreEach(999))
    kv.close_all()
    assert engine.pool.stats().used == 0


def test_greedy_each_over_chunked_prefill_and_many_argmax_slices(tiny_llama):
    chunked = Engine.from_path(tiny_llama, device="cpu", page_size=4, num_pages=128, token_budget=5)
    whole = Engine.from_path(tiny_llama, device="cpu", page_size=4, num_pages=128, token_budget=512)
    draft = [(7 * i + 1) % 128 for i in range(2 * ARGMAX_ROWS + 3)]  # three slices of rows
    results = []
    for engine in (chunked, whole):
        kv = engine.session()
        results.append(engine.pred(kv, kv.create(), draft, want=GreedyEach()).tokens)
        kv.close_all()
    assert results[0] == results[1] == greedy_step_by_step(whole, draft)
    assert chunked.stats().batches >= len(draft) // 5


@pytest.mark.parametrize("source", ["stories260K", "bundled", "word", "clean-up"])
def test_detokenize_is_transformers_decode(source, request, tiny_llama):
    """detokenize takes the Rust tokenizer's decode directly when transformers adds nothing:
    the text must stay transformers' own, special and byte tokens included."""
    from transformers import AutoTokenizer

    from symphony_os.engine.loop import direct_decode
    from symphony_os.model.loader import DEFAULT_MODEL_DIR

    path = {"bundled": DEFAULT_MODEL_DIR, "word": tiny_llama, "clean-up": tiny_llama}.get(source) \
        or request.getfixturevalue("stories_path")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if source == "clean-up":
        tokenizer.clean_up_tokenization_spaces = True  # the wrapper's own step: it must stay in
    decode = direct_decode(tokenizer)
    assert (decode == tokenizer.decode) == (source == "clean-up")
    generator = torch.Generator().manual_seed(0)
    for length in (0, 1, 2, 5, 12, 40):
        for _ in range(20):
            ids = torch.randint(0, len(tokenizer), (length,), generator=generator).tolist()
            for skip in (True, False):
                assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_model_without_a_tokenizer_runs_preds_and_refuses_text(tiny_engine):
    """A model built in memory (bench/gpu.py's random weights) has no tokenizer: the engine
    starts, runs token ids, and refuses text with a clear error."""
    import dataclasses

    engine = Engine(dataclasses.replace(tiny_engine.loaded, tokenizer=None), num_pages=64)
    prompt = [5, 9, 13, 2]
    tokens, probs = greedy_alone(engine, prompt, 4)
    expected_tokens, expected_probs = greedy_alone(tiny_engine, prompt, 4)
    assert tokens == expected_tokens
    torch.testing.assert_close(probs, expected_probs)
    for call in (lambda: engine.tokenize("hello"), lambda: engine.detokenize([5, 9])):
        with pytest.raises(InvalidArgument, match="without a tokenizer"):
            call()


def test_padded_page_table_rows_in_order_zero_padded():
    from symphony_os.engine.model_runner import padded_page_table

    table = padded_page_table([[3, 4, 5], [7], [1, 2]])
    assert table.dtype.name == "int32" and table.tolist() == [[3, 4, 5], [7, 0, 0], [1, 2, 0]]
    assert padded_page_table([[9]]).tolist() == [[9]]


def test_a_request_failing_in_an_unforeseen_way_fails_alone_and_the_loop_goes_on(tiny_engine, monkeypatch):
    """Anything a request raises while its batch is prepared fails that request; before, any error
    but ours stopped the background thread, and every later pred waited forever."""
    reserve = tiny_engine.kvfs.reserve_slots
    calls = []

    def fail_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("unforeseen")
        return reserve(*args, **kwargs)

    monkeypatch.setattr(tiny_engine.kvfs, "reserve_slots", fail_first)
    tiny_engine.start()
    try:
        kv = tiny_engine.session()
        h = kv.create()
        with pytest.raises(RuntimeError, match="unforeseen"):
            tiny_engine.submit(kv, h, [1, 2, 3]).result(timeout=30)
        assert tiny_engine.submit(kv, h, [1, 2, 3]).result(timeout=30).token is not None
        kv.close_all()
    finally:
        tiny_engine.stop()


def test_a_flood_of_one_tenants_decodes_lets_anothers_prompt_into_the_next_batch(tiny_llama):
    """One process's forks kept every seat of every batch with their decodes, and another
    tenant's prompt waited for as long as they went on."""
    engine = Engine.from_path(tiny_llama, device="cpu", page_size=4, num_pages=128, max_batch_size=8)
    flood, other = engine.session("flood"), engine.session("other")
    root = flood.create()
    engine.pred(flood, root, [1, 2, 3])
    forks = [flood.fork(root) for _ in range(12)]  # more decodes than the batch has seats
    prompt_handle = other.create()
    prompt = None
    for step in range(6):
        futures = [engine.submit(flood, fork, [step % 100 + 1]) for fork in forks]
        if step == 1:
            prompt = engine.submit(other, prompt_handle, list(range(1, 17)))
        while not all(f.done() for f in futures):
            engine.step()
            if step == 1:
                assert prompt.done(), "the prompt waited behind the other tenant's decodes"
    assert prompt.result().token >= 0 and other.len(prompt_handle) == 16
    flood.close_all()
    other.close_all()
    assert engine.pool.stats().used == 0
