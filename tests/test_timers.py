"""Deadlines for sleeping guests (symphony_os/timers.py)."""
import time

from symphony_os.timers import Timers


def test_futures_are_answered_at_their_deadlines_in_order():
    timers = Timers()
    now = time.monotonic()
    answered = []
    late, early = timers.at(now + 0.2), timers.at(now + 0.05)
    for future in (late, early):
        future.add_done_callback(lambda f: answered.append((f, time.monotonic())))
    late.result(5)
    assert [f for f, _ in answered] == [early, late]
    assert answered[0][1] >= now + 0.05 and answered[1][1] >= now + 0.2
    timers.stop()


def test_cancelled_futures_are_never_answered_and_leave_nothing():
    timers = Timers()
    now = time.monotonic()
    head = timers.at(now + 0.1)
    far = [timers.at(now + 1e12) for _ in range(100)]  # a process asked to sleep for ever
    timers.cancel(head)
    for future in far:
        timers.cancel(future)
    assert len(timers) == 0 and len(timers._heap) < 100  # rebuilt without the cancelled
    time.sleep(0.2)
    assert not head.done()
    timers.stop()


def test_timers_start_again_after_a_stop():
    timers = Timers()
    timers.at(time.monotonic() + 1e9)
    timers.stop()
    assert len(timers) == 0
    timers.at(time.monotonic()).result(5)
    timers.stop()
