"""The answer to a `pred` request, delivered later: a small future.

concurrent.futures.Future builds a Condition (an RLock and more) for every instance: about
5 us per request on the dev machine, paid on every token of every process. This one takes a
plain Lock and creates an Event only for a caller that actually blocks in `result()`.
"""
from __future__ import annotations

import threading
from typing import Any, Callable


class PredFuture:
    __slots__ = ("_lock", "_done", "_result", "_error", "_callbacks", "_event")

    def __init__(self):
        self._lock = threading.Lock()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["PredFuture"], None]] = []
        self._event: threading.Event | None = None

    def done(self) -> bool:
        return self._done

    def _settle(self, result: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._done:
                raise RuntimeError("this pred was already answered")
            self._result, self._error, self._done = result, error, True
            callbacks, self._callbacks = self._callbacks, []
            event = self._event
        if event is not None:
            event.set()
        for callback in callbacks:
            callback(self)

    def set_result(self, result: Any) -> None:
        self._settle(result, None)

    def set_exception(self, error: BaseException) -> None:
        self._settle(None, error)

    def add_done_callback(self, callback: Callable[["PredFuture"], None]) -> None:
        """Run `callback(self)` once answered (at once, here, if it already is)."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    def result(self, timeout: float | None = None) -> Any:
        """The PredResult, or raise the request's error. Blocks until answered."""
        if not self._done:
            with self._lock:
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(timeout):
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
