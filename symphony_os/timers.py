"""Deadlines for sleeping guests. A LIP that sleeps (WASI poll_oneoff with clock subscriptions:
C's sleep and nanosleep, Rust's std::thread::sleep) waits on a future that `Timers` completes at
its deadline: the process is suspended like one waiting for a pred, and its worker runs the
others meanwhile. (wasmtime's own poll_oneoff slept inside the host call, on the worker's thread:
every process of the runtime stopped with it, and a 2^64 ns timeout held the runtime for good.)
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time

from .pred_future import PredFuture

_COMPACT_AT = 64  # cancelled entries kept in the heap before it is rebuilt without them
_LONGEST_WAIT_S = 3600.0
log = logging.getLogger("symphony.timers")


class Timers:
    """One daemon thread completing futures at their deadlines (time.monotonic). A future whose
    waiter is gone is `cancel`led: its entry leaves the heap at once if it is next, or when the
    cancelled ones outnumber the live (a process that slept for 2^64 ns and was killed meanwhile
    leaves nothing behind)."""

    def __init__(self):
        self._heap: list[tuple[float, int, PredFuture]] = []
        self._cancelled: set[int] = set()  # ids of futures in the heap that nobody waits for
        self._cond = threading.Condition()
        self._order = itertools.count()  # ties: first asked, first answered
        self._thread: threading.Thread | None = None
        self._stopping = False

    def __len__(self) -> int:
        """Deadlines still to answer."""
        with self._cond:
            return sum(id(entry[2]) not in self._cancelled for entry in self._heap)

    def at(self, deadline: float) -> PredFuture:
        """A future answered (with None) once time.monotonic() reaches `deadline`."""
        future = PredFuture()
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._order), future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="symphony-timers", daemon=True)
                self._thread.start()
            self._cond.notify()
        return future

    def cancel(self, future: PredFuture) -> None:
        """Nobody waits for `future` any more: never answer it."""
        with self._cond:
            if future.done():
                return
            if self._heap and self._heap[0][2] is future:
                heapq.heappop(self._heap)
                self._cond.notify()  # the thread may be waiting for its deadline
                return
            # (A future just taken out to be answered lands here too: the next rebuild forgets it.)
            self._cancelled.add(id(future))
            if len(self._cancelled) > _COMPACT_AT and 2 * len(self._cancelled) > len(self._heap):
                self._heap = [entry for entry in self._heap if id(entry[2]) not in self._cancelled]
                heapq.heapify(self._heap)
                self._cancelled.clear()

    def stop(self) -> None:
        """End the thread; deadlines not reached are forgotten (their processes have ended).
        A later `at` starts it again."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cond:
            self._heap.clear()
            self._cancelled.clear()
            self._thread, self._stopping = None, False

    def _run(self) -> None:
        while True:
            due = []
            with self._cond:
                while not self._stopping:
                    now = time.monotonic()
                    while self._heap and self._heap[0][0] <= now:
                        future = heapq.heappop(self._heap)[2]
                        if id(future) in self._cancelled:
                            self._cancelled.discard(id(future))
                        else:
                            due.append(future)
                    if due:
                        break
                    # At most an hour at a time: a deadline 2^64 ns away overflows the wait.
                    self._cond.wait(min(self._heap[0][0] - now, _LONGEST_WAIT_S) if self._heap else None)
                if self._stopping:
                    return
            for future in due:  # outside the lock: answering wakes processes, which take theirs
                try:
                    future.set_result(None)
                except Exception:  # a waiter's bug must not stop every other sleeper's clock
                    log.exception("waking a sleeping process failed")
