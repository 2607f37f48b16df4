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

from ..engine.pred_future import PredFuture

_COMPACT_AT = 64  # cancelled entries kept in the heap before it is rebuilt without them
_LONGEST_WAIT_S = 3600.0
log = logging.getLogger("symphony.timers")


class Timers:
    """One daemon thread completing futures at their deadlines (time.monotonic). A future whose
    waiter is gone is `cancel`led: its entry leaves the heap at once if it is next, or when the
    cancelled ones outnumber the live (a process that slept for 2^64 ns and was killed meanwhile
    leaves nothing behind). Entries are [deadline, order, future]; a cancelled one's future is
    None (marking the entry, never a future's id: a freed future's id comes back with the next
    one, which was then never answered)."""

    def __init__(self):
        self._heap: list[list] = []
        self._entries: dict[PredFuture, list] = {}  # the futures still to answer -> their entries
        self._cancelled = 0  # entries in the heap whose future is None
        self._cond = threading.Condition()
        self._order = itertools.count()  # ties: first asked, first answered
        self._thread: threading.Thread | None = None
        self._stopping = False

    def __len__(self) -> int:
        """Deadlines still to answer."""
        with self._cond:
            return len(self._entries)

    def at(self, deadline: float) -> PredFuture:
        """A future answered (with None) once time.monotonic() reaches `deadline`."""
        future = PredFuture()
        entry = [deadline, next(self._order), future]
        with self._cond:
            heapq.heappush(self._heap, entry)
            self._entries[future] = entry
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="symphony-timers", daemon=True)
                self._thread.start()
            self._cond.notify()
        return future

    def cancel(self, future: PredFuture) -> None:
        """Nobody waits for `future` any more: never answer it (a no-op once it is answered,
        or taken out to be)."""
        with self._cond:
            entry = self._entries.pop(future, None)
            if entry is None:
                return
            entry[2] = None
            self._cancelled += 1
            if self._heap[0] is entry:
                heapq.heappop(self._heap)
                self._cancelled -= 1
                self._cond.notify()  # the thread may be waiting for its deadline
            elif self._cancelled > _COMPACT_AT and 2 * self._cancelled > len(self._heap):
                self._heap = [entry for entry in self._heap if entry[2] is not None]
                heapq.heapify(self._heap)
                self._cancelled = 0

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
            self._entries.clear()
            self._cancelled = 0
            self._thread, self._stopping = None, False

    def _run(self) -> None:
        while True:
            due = []
            with self._cond:
                while not self._stopping:
                    now = time.monotonic()
                    while self._heap and self._heap[0][0] <= now:
                        future = heapq.heappop(self._heap)[2]
                        if future is None:
                            self._cancelled -= 1
                        else:
                            del self._entries[future]
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
