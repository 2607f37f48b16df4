"""PredFuture: each callback runs exactly once, waiters wake, whichever thread comes first."""
from __future__ import annotations

import threading

import pytest

from symphony_os.engine.pred_future import PredFuture


def test_result_error_and_callbacks():
    future, seen = PredFuture(), []
    future.add_done_callback(seen.append)
    assert not future.done()
    future.set_result(7)
    assert future.done() and future.result() == 7 and seen == [future]
    future.add_done_callback(seen.append)  # already answered: runs at once
    assert seen == [future, future]
    with pytest.raises(RuntimeError, match="already answered"):
        future.set_result(8)

    failed = PredFuture()
    failed.set_exception(ValueError("no"))
    assert isinstance(failed.exception(), ValueError)
    with pytest.raises(ValueError):
        failed.result()


def test_result_times_out_then_wakes_when_answered():
    future = PredFuture()
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)
    answerer = threading.Timer(0.05, future.set_result, args=("late",))
    answerer.start()
    assert future.result(timeout=10) == "late"
    answerer.join()


def test_callbacks_run_once_when_added_while_answered_on_another_thread():
    for _ in range(300):
        future, counts = PredFuture(), [0] * 20
        start = threading.Barrier(2)

        def add_all():
            start.wait()
            for i in range(20):
                future.add_done_callback(lambda f, i=i: counts.__setitem__(i, counts[i] + 1))

        adder = threading.Thread(target=add_all)
        adder.start()
        start.wait()
        future.set_result(None)
        adder.join()
        assert counts == [1] * 20


def test_many_waiters_all_wake():
    future, got = PredFuture(), []
    waiters = [threading.Thread(target=lambda: got.append(future.result(timeout=10))) for _ in range(8)]
    for waiter in waiters:
        waiter.start()
    future.set_result(3)
    for waiter in waiters:
        waiter.join()
    assert got == [3] * 8
