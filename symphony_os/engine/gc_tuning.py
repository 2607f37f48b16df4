"""Python's cyclic garbage collector, kept off the serving hot path.

Each pred request lives from submit to completion as a handful of container objects. With a
few hundred requests in flight they outlive young collections, get promoted, and trigger full
collections over everything loaded (torch, transformers, the model: ~340k objects, 240 ms per
full collection on the dev VM). Measured, engine alone, null model, per request (submit +
batch): 17-20 us untuned against 8 tuned at 256 requests in flight, 32-35 against 8 at 1024;
with 256 LIP processes GC took 320 ms of a 1.07 s run, 60 ms tuned.

`serving_gc()` (a context manager) or `tune_gc()` / `untune_gc()` around serving: what is loaded
is frozen out of collections and young collections run less often. Calls nest (a runtime
and the engine's own loop may both serve): the last `untune_gc()` restores the defaults.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

DEFAULT_GC_THRESHOLD = gc.get_threshold()
SERVING_GC_THRESHOLD = (20_000, 20, 20)

_lock = threading.Lock()
_users = 0
_served_before = False  # has anything in this process served (and so maybe left garbage) yet?


def tune_gc(collect_all: bool = True) -> None:
    """Start serving: collect, freeze what is alive, collect young objects less often.
    Garbage is collected first: frozen, the cycles of an earlier runtime's ended processes
    (each holding a store's address-space reservation) would never be freed, and a program
    that ran runtime after runtime ran out of memory mappings ("Thread creation failed").
    `collect_all=False`, for a short-lived program that loads and then serves once (`symphony
    run`): the first time in a process only the young generations are collected (1 ms; a full
    collection of the 360k objects torch, transformers and a model leave took 200 ms, and found
    67 unreachable). Once anything has served in the process, everything is collected."""
    global _users, _served_before
    with _lock:
        _users += 1
        if _users > 1:
            return
        gc.collect() if collect_all or _served_before else gc.collect(1)
        _served_before = True
        gc.freeze()
        gc.set_threshold(*SERVING_GC_THRESHOLD)


def untune_gc() -> None:
    """Stop serving; the last user unfreezes and restores the default thresholds (frozen
    objects are never collected, not even at exit, where some extension modules then
    report leaks)."""
    global _users
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users == 0:
            gc.unfreeze()
            gc.set_threshold(*DEFAULT_GC_THRESHOLD)


@contextlib.contextmanager
def serving_gc() -> Iterator[None]:
    """`tune_gc()` for the duration of the block: for code that drives `Engine.step()` itself."""
    tune_gc()
    try:
        yield
    finally:
        untune_gc()
