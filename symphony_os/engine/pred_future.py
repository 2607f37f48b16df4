"""The answer to a `pred` request, delivered later: a small future.

concurrent.futures.Future builds a Condition (an RLock and more) for every instance: about
5 us per request on the dev machine, paid on every token of every process. This one takes no
lock on the common path (answered by the engine, a callback run by it): callbacks pass through
a list whose `append` and `pop` are atomic under the GIL, so each runs exactly once whichever
thread gets there first. Only a caller that blocks in `result()` makes an Event.

The producer (the engine's batch loop) answers a future once; a second answer is refused, on a
best-effort basis only (two threads answering at once are not told apart: nothing does that).
This relies on the GIL: a free-threaded build of Python would need the lock back.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

_event_lock = threading.Lock()  # makes one Event per waited-on future, for all futures (rare)


class PredFuture:
    __slots__ = ("_done", "_result", "_error", "_callbacks", "_event")

    def __init__(self):
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["PredFuture"], None]] = []
        self._event: threading.Event | None = None

    def done(self) -> bool:
        return self._done

    def settle(self, result: Any, error: BaseException | None) -> None:
        """Answer with `error` if it is not None, else with `result` (for a producer holding
        either: one call fewer per request than choosing between the two below)."""
        if self._done:
            raise RuntimeError("this pred was already answered")
        self._result, self._error = result, error
        self._done = True  # after the answer, before the waiters and callbacks look
        event = self._event
        if event is not None:
            event.set()
        if self._callbacks:
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        callbacks = self._callbacks
        while callbacks:
            try:
                callback = callbacks.pop(0)  # in the order added
            except IndexError:  # another thread took the last one
                return
            callback(self)

    def outcome(self) -> tuple[Any, BaseException | None]:
        """(result, error) of an answered future, without raising the error."""
        return self._result, self._error

    def set_result(self, result: Any) -> None:
        self.settle(result, None)

    def set_exception(self, error: BaseException) -> None:
        self.settle(None, error)

    def add_done_callback(self, callback: Callable[["PredFuture"], None]) -> None:
        """Run `callback(self)` once answered: on the answering thread, or at once, here, if it
        already is (or, when another thread adds a callback just as the answer lands, possibly
        on that thread)."""
        self._callbacks.append(callback)
        if self._done:  # answered before or while it was added: whoever pops it runs it
            self._run_callbacks()

    def result(self, timeout: float | None = None) -> Any:
        """The PredResult, or raise the request's error. Blocks until answered."""
        if not self._done:
            with _event_lock:
                if self._event is None:
                    self._event = threading.Event()
                event = self._event
            # settle marks the future done before it reads _event; here _event is set before
            # `done` is read: one of the two sees the other's write.
            if not self._done and not event.wait(timeout):
                raise TimeoutError("the pred was not answered in time")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self) -> BaseException | None:
        try:
            self.result()
        except BaseException as error:  # noqa: B902 - the answer itself
            return error
        return None
