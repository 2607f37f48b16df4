"""The decode lane (fiber_native.c, lip/process.py, runtime.Worker): once a guest's decode step in
the common shape went the fast way, C answers its next ones on that handle (pred_submit's tickets,
pred_wait on them, blocking preds) and the worker resumes every such guest of a round in one
native call. It must answer exactly as the ordinary way; every call outside it sends the guest
back there, with what the lane counted (host calls, tickets, CPU time, a pred not queued yet)
taken back first."""
from __future__ import annotations

import collections
import threading
from pathlib import Path

import pytest

from guests import build_c
from symphony_os.engine import Engine
from symphony_os.errors import ErrorCode as E
from symphony_os.lip import core_abi
from symphony_os.lip.limits import ProcessLimits, Usage
from symphony_os.lip.process import EXIT_KILLED, Process
from symphony_os.lip.runtime import Runtime

GUEST = Path(__file__).resolve().parent / "c_guests" / "decode_lane.c"


@pytest.fixture(scope="module")
def engine(stories_path):
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=512)
    yield engine
    engine.stop()


@pytest.fixture
def program(engine, tmp_path_factory):
    yield build_c(GUEST, tmp_path_factory.getbasetemp() / "decode_lane.wasm")
    stats = engine.pool.stats()
    assert stats.used == 0 and stats.swapped == 0, f"leaked KV pages: {stats}"


def run(engine: Engine, program: Path, args, limits=None, processes: int = 1, drive_in_caller: bool = False):
    """Each process's reports, as (label, value) pairs; `tokens=` lines as a list of ids."""
    outputs = [[] for _ in range(processes)]
    with Runtime(engine, drive_in_caller=drive_in_caller) as runtime:
        loaded = runtime.load(program)
        procs = [runtime.spawn(loaded, args=list(args), on_output=outputs[i].append,
                               **({"limits": limits} if limits else {})) for i in range(processes)]
        for proc in procs:
            assert runtime.wait(proc, 120) == 0, (proc.end_reason, proc.log[-3:])
    reports = []
    for output in outputs:
        pairs = [line.split("=", 1) for line in b"".join(output).decode().splitlines()]
        reports.append([(label, [int(t) for t in value.split()] if label == "tokens" else int(value))
                        for label, value in pairs])
    return reports


def greedy(engine: Engine, steps: int) -> list[int]:
    """The guest's decoding through the engine's own API: the prefill's token, then `steps` more."""
    ids = engine.tokenize("Once upon a time", add_special_tokens=False)
    session = engine.session()
    handle = session.create()
    tokens = [engine.pred(session, handle, ids).token]
    for _ in range(steps):
        tokens.append(engine.pred(session, handle, [tokens[-1]]).token)
    session.close_all()
    return tokens


def count_calls(monkeypatch, owner, names) -> collections.Counter:
    counts = collections.Counter()
    for name in names:
        def counted(*args, _name=name, _call=getattr(owner, name)):
            counts[_name] += 1
            return _call(*args)
        monkeypatch.setattr(owner, name, counted)
    return counts


@pytest.mark.parametrize("mode", ["pred", "submit-wait"])
def test_the_lane_answers_as_greedy_decoding_with_the_steps_taken_in_c(engine, program, monkeypatch, mode):
    fast = count_calls(monkeypatch, Process, ["_fast_pred", "_fast_pred_submit", "_fast_pred_wait"])
    ordinary = count_calls(monkeypatch, core_abi.CoreCalls, ["pred", "pred_submit", "pred_wait"])
    [reports] = run(engine, program, [mode, "40"])
    assert reports == [("tokens", greedy(engine, 40))]
    # The first step goes the fast way in Python and opens the lane; C takes the other 39.
    assert ordinary == {"pred": 1}  # the prefill
    assert fast == ({"_fast_pred": 1} if mode == "pred" else {"_fast_pred_submit": 1, "_fast_pred_wait": 1})


def test_under_a_kv_page_limit_the_lane_takes_the_steps_that_fit_in_the_last_page(engine, program, monkeypatch):
    fast = count_calls(monkeypatch, Process, ["_fast_pred"])
    ordinary = count_calls(monkeypatch, core_abi.CoreCalls, ["pred"])
    [reports] = run(engine, program, ["pred", "40"], limits=ProcessLimits(kv_pages=3))
    assert reports == [("tokens", greedy(engine, 40))]
    # 4 + 40 tokens in pages of 16: a step that needs a new page (at 16 and 32) goes the ordinary
    # way, declined by the fast way in Python; the first step and each one after those opens the
    # lane there; C takes the other 35.
    assert ordinary["pred"] == 1 + 2 and fast["_fast_pred"] == 5


@pytest.mark.parametrize("drive_in_caller", [False, True], ids=["threads", "one-thread"])
def test_a_round_of_lane_processes_is_resumed_together_and_each_answers_alike(engine, program, drive_in_caller):
    expected = [("tokens", greedy(engine, 24))]
    for mode in ("pred", "submit-wait"):
        assert run(engine, program, [mode, "24"], processes=12, drive_in_caller=drive_in_caller) == [expected] * 12


def test_calls_around_the_lane_see_its_tickets_and_its_pending_pred(engine, program):
    answers = dict(run(engine, program, ["tickets"])[0])
    tokens = greedy(engine, 6)
    prompt = len(engine.tokenize("Once upon a time", add_special_tokens=False))
    assert answers == {
        # tickets 1-3 went to the three steps before (the first the Python way, then the lane's)
        "lane-ticket": 4, "lane-token": tokens[4],
        # a pred_submit C answered, then an ordinary call: the pred is queued before that call
        # runs (it has not run yet: the round is not over), and its wait answers as usual
        "length-between": prompt + 4, "pending-ticket": 5, "pending-token": tokens[5],
        "wait-again": E.BAD_HANDLE,  # an ended ticket, as the ordinary way says
        "ordinary-ticket": 6, "ordinary-token": tokens[6],  # the process's counter goes on from the lane's
        "length": prompt + 6,
    }


def test_a_pred_submitted_in_the_lane_and_never_waited_for_is_released_after_exit(engine, program):
    """Its `send` closed the lane, so the pred was queued (as the ordinary way queues it); the
    guest exits without waiting, and the pred leaves the queue with it: no batch need run to
    release its pages (the fixture checks them)."""
    assert run(engine, program, ["submit-exit"]) == [[("ticket", 4)]]
    assert len(engine.scheduler) == 0


def test_lane_calls_count_against_the_host_call_rate(engine, program, monkeypatch):
    """The rate is checked every 1/16 of it (Usage): the lane's calls bring that check on as any
    call does. 400 steps are 800 calls; at 1,600 a second the check runs every 100 calls."""
    checks = count_calls(monkeypatch, Usage, ["check_rate"])
    [reports] = run(engine, program, ["submit-wait", "400"], limits=ProcessLimits(hostcalls_per_s=1600))
    assert len(reports[0][1]) == 401
    assert checks["check_rate"] >= 7


def test_a_cpu_time_limit_ends_a_guest_in_the_lane(engine, program):
    with Runtime(engine) as runtime:
        process = runtime.spawn(runtime.load(program), args=["spin"], limits=ProcessLimits(cpu_time_s=0.3))
        assert runtime.wait(process, 120) == EXIT_KILLED
    assert process.end_reason == "killed: cpu time limit 0.3s exceeded"
    assert process.cpu_seconds > 0.3


def test_a_kill_reaches_a_guest_in_the_lane(engine, program):
    decoding = threading.Event()  # its first 100 steps reported: well inside its decode loop

    def output(data: bytes) -> None:
        if b"steps=" in data:
            decoding.set()

    with Runtime(engine) as runtime:
        process = runtime.spawn(runtime.load(program), args=["spin"], on_output=output)
        assert decoding.wait(60)
        runtime.kill(process.pid, "killed: by the test")
        assert runtime.wait(process, 60) == EXIT_KILLED
    assert process.end_reason == "killed: by the test"
