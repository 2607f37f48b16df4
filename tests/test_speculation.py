"""Tentative decode steps (engine/speculation.py): the engine runs a LIP's likely next step before
the guest asks, in the slot the file's next token would take, without the file growing; the guest
adopts it (the same answer as a step it submitted) or it is dropped and leaves nothing behind. With
a runner that works asynchronously, the batch driver launches those steps before the guests'
round and runs the round while the device computes (runtime.BatchDriver._step)."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest

from guests import build_c
from symphony_os.engine import Engine
from symphony_os.engine import speculation as states
from symphony_os.lip.runtime import Runtime

GUEST = Path(__file__).resolve().parent / "c_guests" / "decode_lane.c"


@pytest.fixture(scope="module")
def engine(stories_path):
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=256)
    yield engine
    engine.stop()


@pytest.fixture
def session(engine):
    session = engine.session()
    yield session
    session.close_all()
    engine.run_until_idle()
    stats = engine.pool.stats()
    assert stats.used == 0, f"leaked KV pages: {stats}"
    assert not engine.scheduler, "requests left queued"


def prefilled(engine, session):
    """A file holding the prompt, and the greedy token after it."""
    handle = session.create()
    ids = engine.tokenize("Once upon a time", add_special_tokens=False)
    return handle, engine.pred(session, handle, ids).token


class Answer:
    def __init__(self):
        self.outcomes = []

    def settle(self, result, error):
        self.outcomes.append((result.token if result is not None else None, error))


def reference(engine, steps: int) -> list[int]:
    session = engine.session()
    handle, token = prefilled(engine, session)
    tokens = [token]
    for _ in range(steps):
        tokens.append(engine.pred(session, handle, [tokens[-1]]).token)
    session.close_all()
    return tokens


def test_a_step_adopted_before_its_batch_is_the_callers_own(engine, session):
    handle, token = prefilled(engine, session)
    file = session.file_of(handle)
    speculation = engine.speculate(file, token)
    answer = Answer()
    assert engine.adopt(speculation, answer) and speculation.state == states.ADOPTED
    engine.run_until_idle()
    assert answer.outcomes == [(reference(engine, 1)[1], None)]
    assert file.length == 5


def test_a_step_adopted_while_its_batch_runs_grows_the_file_then(engine, session):
    handle, token = prefilled(engine, session)
    file = session.file_of(handle)
    speculation = engine.speculate(file, token)
    launched = engine.launch()
    assert speculation.state == states.RUNNING and file.length == 4  # tentative: the file is as it was
    answer = Answer()
    assert engine.adopt(speculation, answer) and file.length == 5
    engine.complete(launched)
    expected = reference(engine, 2)
    assert answer.outcomes == [(expected[1], None)]
    assert engine.pred(session, handle, [expected[1]]).token == expected[2]


def test_a_step_nobody_adopts_leaves_the_file_as_it_was(engine, session):
    handle, token = prefilled(engine, session)
    file = session.file_of(handle)
    speculation = engine.speculate(file, token + 1)  # not the step the caller will make
    engine.step()
    assert speculation.state == states.DROPPED and file.length == 4
    assert engine.pool.refcount[file.pages[-1]] == 1  # unpinned
    assert not engine.adopt(speculation, Answer())
    expected = reference(engine, 2)
    assert engine.pred(session, handle, [token]).token == expected[1]  # its slot written over
    assert engine.pred(session, handle, [expected[1]]).token == expected[2]


def test_a_dropped_step_leaves_the_queue_and_one_in_a_batch_outlives_a_truncate(engine, session):
    handle, token = prefilled(engine, session)
    file = session.file_of(handle)
    queued = engine.speculate(file, token)
    engine.abandon(queued)
    assert queued.state == states.DROPPED and not engine.scheduler
    running = engine.speculate(file, token)
    launched = engine.launch()
    engine.abandon(running)
    session.truncate(handle, 0)  # its page leaves the file while the pass writes into it
    assert engine.pool.refcount[running.page] == 1  # the pin keeps it
    engine.complete(launched)
    assert running.state == states.DROPPED and file.length == 0


def test_no_step_is_speculated_where_the_next_token_needs_a_page(engine, session):
    handle, token = prefilled(engine, session)
    file = session.file_of(handle)
    while file.length % engine.pool.page_size:
        token = engine.pred(session, handle, [token]).token
    assert engine.speculate(file, token) is None


class AsyncRunner:
    """The model runner, its passes launched and completed apart (as a GPU's are): the driver
    runs the guests' round between the two."""

    def __init__(self, runner):
        self.runner = runner
        self.launched = 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def launch(self, seqs):
        self.launched += 1
        logits = self.runner.run(seqs)
        return type("Pass", (), {"result": lambda _self: logits})()


@pytest.mark.parametrize("drive_in_caller", [False, True], ids=["threads", "one-thread"])
def test_lane_guests_run_while_the_next_batch_does_and_answer_alike(engine, tmp_path_factory, monkeypatch,
                                                                    drive_in_caller):
    program = build_c(GUEST, tmp_path_factory.getbasetemp() / "decode_lane.wasm")
    adopted = collections.Counter()
    adopt = Engine.adopt

    def counted(self, speculation, answer):
        state = speculation.state
        taken = adopt(self, speculation, answer)
        adopted[state, taken] += 1
        return taken

    monkeypatch.setattr(Engine, "adopt", counted)
    monkeypatch.setattr(engine, "runner", AsyncRunner(engine.runner))
    outputs = [[] for _ in range(6)]
    with Runtime(engine, drive_in_caller=drive_in_caller) as runtime:
        loaded = runtime.load(program)
        procs = [runtime.spawn(loaded, args=["submit-wait", "30"], on_output=outputs[i].append) for i in range(6)]
        for proc in procs:
            assert runtime.wait(proc, 120) == 0, proc.end_reason
    expected = "tokens=" + " ".join(map(str, reference(engine, 30))) + "\n"
    assert [b"".join(output).decode() for output in outputs] == [expected] * 6
    # Most steps were adopted while their batch ran: the round overlapped the pass.
    assert adopted[states.RUNNING, True] >= 6 * 15
    stats = engine.pool.stats()
    assert stats.used == 0, f"leaked KV pages: {stats}"


def test_a_step_dropped_while_its_batch_runs_lets_its_file_go_at_once(engine, session):
    handle, token = prefilled(engine, session)
    file = session.file_of(handle)
    files = engine.kvfs.file_count
    speculation = engine.speculate(file, token)
    launched = engine.launch()
    engine.abandon(speculation)
    session.close(handle)  # the guest's last call: its file goes now, not once the pass ran
    assert engine.kvfs.file_count == files - 1
    engine.complete(launched)
    assert speculation.state == states.DROPPED


class InterruptedRunner:
    """A runner whose next pass is interrupted (Ctrl-C in the middle of the forward)."""

    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, seqs):
        raise KeyboardInterrupt


def test_an_interrupted_pass_fails_its_batch_and_leaves_the_engine_usable(engine, session, monkeypatch):
    handle, token = prefilled(engine, session)
    file = session.file_of(handle)
    speculation = engine.speculate(file, token)
    answer = Answer()
    assert engine.adopt(speculation, answer)
    monkeypatch.setattr(engine, "runner", InterruptedRunner(engine.runner))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    assert [error.__class__ for _, error in answer.outcomes] == [KeyboardInterrupt] and file.length == 4
    assert engine.pred(session, handle, [token]).token == reference(engine, 1)[1]  # the lock, the pages: free


def test_a_step_nobody_adopts_is_not_counted_as_generated(engine, session):
    handle, token = prefilled(engine, session)
    before = engine.stats()
    engine.speculate(session.file_of(handle), token)
    engine.step()
    after = engine.stats()
    assert after.batches == before.batches + 1
    assert (after.sequences, after.tokens) == (before.sequences, before.tokens)
