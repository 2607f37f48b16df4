"""Deadlines for sleeping guests (symphony_os/lip/timers.py)."""
import time

from symphony_os.lip.timers import Timers


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


def test_a_future_cancelled_while_it_is_being_answered_costs_no_later_one_its_answer():
    """Cancelled between leaving the heap and its answer, its id was kept as cancelled; the next
    future, allocated at the freed one's address, shared the id and was never answered."""
    timers = Timers()
    deadline = time.monotonic() + 0.2  # both in the heap well before: taken out together
    first, second = timers.at(deadline), timers.at(deadline)
    cancelled = []
    first.add_done_callback(lambda _: (timers.cancel(second), cancelled.append(second.done())))
    first.result(5)
    second.result(5)  # answered already, or being answered: cancelling it did nothing
    first = second = None  # freed: a later future may take their addresses
    for _ in range(20):
        assert timers.at(time.monotonic()).result(5) is None
    timers.stop()


def test_timers_start_again_after_a_stop():
    timers = Timers()
    timers.at(time.monotonic() + 1e9)
    timers.stop()
    assert len(timers) == 0
    timers.at(time.monotonic()).result(5)
    timers.stop()
