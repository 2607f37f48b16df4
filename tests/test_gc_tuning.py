"""The cyclic GC kept off the serving path: tuned while something serves, restored after."""
import gc
import subprocess
import sys

from symphony_os.engine.gc_tuning import SERVING_GC_THRESHOLD, serving_gc, tune_gc, untune_gc
from symphony_os.lip.runtime import Runtime


def gc_state():
    return gc.get_threshold(), gc.get_freeze_count()


def test_nested_users_restore_the_state_when_the_last_leaves():
    before = gc_state()  # the defaults, unless an earlier test left a runtime serving
    tune_gc()
    frozen = gc.get_freeze_count()
    assert frozen > 0 and gc.get_threshold() == SERVING_GC_THRESHOLD
    with serving_gc():  # a second user: nothing re-collected or re-frozen
        assert gc_state() == (SERVING_GC_THRESHOLD, frozen)
    assert gc_state() == (SERVING_GC_THRESHOLD, frozen)
    untune_gc()
    assert gc_state()[0] == before[0]
    if before[1] == 0:
        assert gc.get_freeze_count() == 0


def test_engine_loop_serves_with_tuned_gc(tiny_engine):
    before = gc_state()
    tiny_engine.start()
    try:
        assert gc.get_threshold() == SERVING_GC_THRESHOLD and gc.get_freeze_count() > 0
        kv = tiny_engine.session()
        assert tiny_engine.pred(kv, kv.create(), [1, 2, 3]).token is not None
        kv.close_all()
    finally:
        tiny_engine.stop()
    assert gc_state()[0] == before[0]


def test_garbage_is_collected_before_freezing_except_the_first_time_asked():
    """A first user that asks (`symphony run`'s one-thread runtime) freezes without a full
    collection; any later one collects first, so an earlier runtime's garbage cycles are not
    frozen for good."""
    script = """
import gc, weakref
from symphony_os.engine.gc_tuning import tune_gc, untune_gc
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else None)
tune_gc(collect_all=False)
assert full == [], "collected on first use"
untune_gc()
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
dead = weakref.ref(a)
del a, b
tune_gc(collect_all=False)
assert full and dead() is None, "an earlier user's garbage was frozen"
untune_gc()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


def test_a_serving_runtime_collects_everything_first(tiny_engine):
    """A runtime with threads of its own (`symphony serve`) collects all garbage before it
    freezes, even as the first user: a server lives long, and what it froze would stay."""
    full = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.callbacks.append(count)
    try:
        with Runtime(tiny_engine):
            pass
    finally:
        gc.callbacks.remove(count)
    assert full
