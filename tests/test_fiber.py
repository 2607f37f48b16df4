"""Guests as wasmtime fibers: blocking host calls, round-robin polling, preemption, traps."""
from __future__ import annotations

import ctypes
import subprocess
import sys
import threading

import pytest
import wasmtime

from symphony_os.wasm.fiber import (_HOST_OBJECTS, MAX_PREFETCHED_OBJECTS, AsyncLinker, EpochTicker, Fiber, Pending,
                                    Ready, make_async_engine, set_time_slice)

I32 = wasmtime.ValType.i32()

# A guest that imports `symphony.wait(x) -> y`, a host call that may block.
GUEST_WAT = """
(module
  (import "symphony" "wait" (func $wait (param i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "\\2a\\00\\00\\00")
  ;; sum of wait(i) for i in 0..n
  (func (export "sum_waits") (param $n i32) (result i32) (local $i i32) (local $sum i32)
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
      (local.set $sum (i32.add (local.get $sum) (call $wait (local.get $i))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next)))
    (local.get $sum))
  ;; wait(ptr), then read the i32 the host left at ptr
  (func (export "wait_then_load") (param $ptr i32) (result i32)
    (drop (call $wait (local.get $ptr)))
    (i32.load (local.get $ptr)))
  (func (export "count_to") (param $n i32) (result i32) (local $i i32)
    (loop $next
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $next (i32.lt_u (local.get $i) (local.get $n))))
    (local.get $i))
  (func (export "spin") (loop $forever (br $forever)))
  (func (export "crash") unreachable))
"""


class WaitQueue:
    """The `symphony.wait` handler: every call waits until `answer_all` completes it with
    `answer(owner, x)`. `fail_when(owner, x)` picks calls that fail instead."""

    def __init__(self, answer=lambda owner, x: 2 * x, fail_when=lambda owner, x: False):
        self.answer = answer
        self.fail_when = fail_when
        self.waiting: list[tuple[Pending, object, int]] = []

    def __call__(self, call, args):
        pending = Pending()
        self.waiting.append((pending, call.fiber.owner, args[0]))
        return pending

    def answer_all(self) -> int:
        batch, self.waiting = self.waiting, []
        for pending, owner, x in batch:
            if self.fail_when(owner, x):
                pending.fail(f"no answer for {owner} at {x}")
            else:
                pending.complete([self.answer(owner, x)])
        return len(batch)


def make_guest_env(handler, **engine_options):
    engine = make_async_engine(**engine_options)
    linker = AsyncLinker(engine)
    linker.define_async("symphony", "wait", [I32], [I32], handler)
    return engine, linker, wasmtime.Module(engine, wasmtime.wat2wasm(GUEST_WAT))


def new_guest(engine, linker, module, slice_ticks=1):
    store = wasmtime.Store(engine)
    set_time_slice(store, slice_ticks)
    instance = linker.instantiate(store, module)
    return store, instance.exports(store)


def run_to_end(fiber: Fiber, max_polls: int = 1000) -> Fiber:
    for _ in range(max_polls):
        if fiber.poll():
            return fiber
    raise AssertionError(f"fiber still running after {max_polls} polls")


def test_blocking_host_call_suspends_and_resumes():
    queue = WaitQueue(answer=lambda owner, x: x * 10)
    engine, linker, module = make_guest_env(queue)
    store, exports = new_guest(engine, linker, module, slice_ticks=1000)
    fiber = Fiber(store, exports["sum_waits"], [3], owner="guest")

    for expected_x in range(3):
        assert fiber.poll() is False and fiber.poll() is False  # waiting, however often polled
        assert [(owner, x) for _, owner, x in queue.waiting] == [("guest", expected_x)]
        queue.answer_all()
    assert fiber.poll() is True
    assert fiber.result == [0 + 10 + 20] and fiber.trap is None and fiber.done


def test_many_guests_round_robin_on_one_thread():
    queue = WaitQueue(answer=lambda owner, x: 1000 * owner + x)
    engine, linker, module = make_guest_env(queue, epoch_interruption=False)
    calls_each = 20
    guests = [new_guest(engine, linker, module) for _ in range(256)]
    fibers = [Fiber(store, exports["sum_waits"], [calls_each], owner=index)
              for index, (store, exports) in enumerate(guests)]

    for round_index in range(calls_each + 1):
        running = [fiber for fiber in fibers if not fiber.poll()]
        # Each round every guest runs to its next call: one call per guest, none starved.
        assert len(running) == (len(fibers) if round_index < calls_each else 0)
        assert queue.answer_all() == len(running)
    for index, fiber in enumerate(fibers):
        assert fiber.result == [calls_each * 1000 * index + sum(range(calls_each))]


def test_a_poll_that_prefetches_the_next_fiber_changes_no_result():
    """A scheduler passes the next fiber's slot to each poll, to be fetched into the cache
    meanwhile. What that slot names may be stale (a call answered since, a fiber closed in its
    call, host objects freed) or not there yet (a fiber never polled): a prefetch reads none of it."""
    queue = WaitQueue(answer=lambda owner, x: 1000 * owner + x)
    engine, linker, module = make_guest_env(queue, epoch_interruption=False)
    guests = [new_guest(engine, linker, module) for _ in range(10)]
    # Guest i makes i + 1 calls: the first ones finish while the others still wait.
    fibers = [Fiber(store, exports["sum_waits"], [index + 1], owner=index)
              for index, (store, exports) in enumerate(guests[:8])]
    never_polled = Fiber(guests[8][0], guests[8][1]["sum_waits"], [1], owner=8)
    closed_in_its_call = Fiber(guests[9][0], guests[9][1]["sum_waits"], [5], owner=9)
    assert closed_in_its_call.poll() is False
    closed_in_its_call.close()
    queue.waiting.clear()
    # Host objects prefetched with the fibers, replaced, or freed before they are prefetched.
    held = [object(), [1, 2, 3], {"a": 1}]
    fibers[1].prefetch_with(held + [None, object()])  # None is skipped; the last is freed at once
    fibers[2].prefetch_with(held[:1])
    fibers[2].prefetch_with([[4, 5], bytes(1 << 24)])  # replaces the first; freed at once
    sizes = fibers[2]._fields[_HOST_OBJECTS + MAX_PREFETCHED_OBJECTS:][:MAX_PREFETCHED_OBJECTS].tolist()
    assert 0 < max(sizes) <= 1024 and sizes[4:] == [0] * (MAX_PREFETCHED_OBJECTS - 4)  # a large object: its head
    del held[:]
    with pytest.raises(ValueError, match="at most 6"):
        fibers[3].prefetch_with([object()] * 7)
    for _ in range(9):
        for fiber, following in zip(fibers, fibers[1:] + [never_polled]):
            fiber.poll(prefetch=following.slot_address)
        fibers[-1].poll(prefetch=closed_in_its_call.slot_address)  # still waiting: polled again
        queue.answer_all()
    for index, fiber in enumerate(fibers):
        assert fiber.done and fiber.result == [sum(1000 * index + x for x in range(index + 1))]
    assert never_polled.poll(prefetch=fibers[0].slot_address) is False  # waits in its call
    queue.answer_all()
    assert never_polled.poll(prefetch=never_polled.slot_address) is True and never_polled.result == [8000]


@pytest.mark.timeout(60, method="thread")  # without preemption the first poll of `spin` never returns
def test_epoch_preemption_lets_other_guests_finish():
    queue = WaitQueue()
    engine, linker, module = make_guest_env(queue)
    spinner_store, spinner_exports = new_guest(engine, linker, module)
    spinner = Fiber(spinner_store, spinner_exports["spin"])
    workers = []
    for _ in range(3):
        store, exports = new_guest(engine, linker, module)
        workers.append(Fiber(store, exports["count_to"], [3_000_000]))

    spinner_yields = 0
    with EpochTicker(engine, interval_s=0.002):
        while not all(worker.done for worker in workers):
            spinner_yields += not spinner.poll()
            for worker in workers:
                worker.poll()
    assert [worker.result for worker in workers] == [[3_000_000]] * 3
    assert spinner_yields >= 1 and not spinner.done
    spinner.close()
    assert spinner.trap == "closed before it finished"


# A guest spinning forever, polled through a ctypes call that keeps the GIL (PyDLL): it yields
# only if the epoch ticks while this thread holds the GIL.
TICKS_WITHOUT_THE_GIL = """
import ctypes, wasmtime
from symphony_os.wasm import fiber
engine = fiber.make_async_engine()
store = wasmtime.Store(engine)
fiber.set_time_slice(store, 1)
module = wasmtime.Module(engine, '(module (func (export "spin") (loop (br 0))))')
instance = fiber.AsyncLinker(engine).instantiate(store, module)
spinner = fiber.Fiber(store, instance.exports(store)["spin"])
keeps_gil = ctypes.PyDLL(fiber._native._name, handle=fiber._native._handle).sym_fiber_poll
keeps_gil.restype, keeps_gil.argtypes = fiber._fiber_poll.restype, fiber._fiber_poll.argtypes
fiber._fiber_poll = keeps_gil
with fiber.EpochTicker(engine, interval_s=0.002):
    print("yielded" if spinner.poll() is False else "finished?")
spinner.close()
"""


def test_the_epoch_ticks_while_the_polling_thread_holds_the_gil():
    """The ticks come from a thread that never takes the GIL: a tick that needed it (the old
    ticker, in Python) waited for a thread polling a guest, and here would wait forever."""
    done = subprocess.run([sys.executable, "-c", TICKS_WITHOUT_THE_GIL], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "yielded"


def test_a_ticker_stops_without_waiting_out_its_interval():
    engine = make_async_engine()
    ticker = EpochTicker(engine, interval_s=3600).start()
    stopper = threading.Thread(target=ticker.stop)
    stopper.start()
    stopper.join(timeout=60)  # an interval is slept in parts of 10 ms
    assert not stopper.is_alive()


def test_handler_exception_becomes_trap_and_host_survives():
    def broken(call, args):
        raise ValueError(f"bad argument {args[0]}")

    engine, linker, module = make_guest_env(broken, epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    fiber = run_to_end(Fiber(store, exports["sum_waits"], [5]))
    assert fiber.result is None
    assert "symphony.wait failed: ValueError: bad argument 0" in fiber.trap
    assert isinstance(fiber.error, ValueError)
    # The same store runs the next call normally.
    assert run_to_end(Fiber(store, exports["count_to"], [10])).result == [10]


def test_sync_handler_exception_becomes_trap():
    engine, linker, module = make_guest_env(WaitQueue(), epoch_interruption=False)
    linker.define_func("symphony", "probe", [I32], [I32], lambda call, args: [args[0] // 0])
    probe_module = wasmtime.Module(engine, wasmtime.wat2wasm("""
        (module (import "symphony" "probe" (func $probe (param i32) (result i32)))
          (func (export "run") (result i32) (call $probe (i32.const 1))))"""))
    store = wasmtime.Store(engine)
    fiber = run_to_end(Fiber(store, linker.instantiate(store, probe_module).exports(store)["run"]))
    assert "symphony.probe failed: ZeroDivisionError" in fiber.trap


def test_handler_returning_wrong_values_traps():
    engine, linker, module = make_guest_env(lambda call, args: Ready([1, 2]), epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    fiber = run_to_end(Fiber(store, exports["sum_waits"], [1]))
    assert "symphony.wait takes 1 values, got 2" in fiber.trap

    engine, linker, module = make_guest_env(lambda call, args: 7, epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    fiber = run_to_end(Fiber(store, exports["sum_waits"], [1]))
    assert "handler returned int, not Ready or Pending" in fiber.trap


def test_pending_answered_wrongly_traps():
    queue = WaitQueue(answer=lambda owner, x: x)
    engine, linker, module = make_guest_env(queue, epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    fiber = Fiber(store, exports["sum_waits"], [1])
    assert fiber.poll() is False
    (pending, _, _), = queue.waiting
    pending.complete([1, 2])
    assert run_to_end(fiber).trap is not None and "symphony.wait takes 1 values, got 2" in fiber.trap
    assert isinstance(fiber.error, ValueError)


def test_pending_answered_before_its_handler_returns():
    """A Pending done by the time wasmtime gets it (answered on another thread at once, or by
    the handler itself) lets the guest run on in the same poll, once, with that answer."""
    def answer_at_once(call, args):
        pending = Pending()
        worker = threading.Thread(target=pending.complete, args=([args[0] + 100],))
        worker.start()
        worker.join()
        return pending

    engine, linker, module = make_guest_env(answer_at_once, epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    fiber = Fiber(store, exports["sum_waits"], [3])
    assert fiber.poll() is True and fiber.result == [100 + 101 + 102]


def test_pending_answered_from_other_threads_while_polled():
    """Answers from another thread race with the handler registering its wait: every call
    still gets its own answer exactly once."""
    queue = WaitQueue(answer=lambda owner, x: x + 1)
    engine, linker, module = make_guest_env(queue, epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    stop = threading.Event()

    def answer_forever():
        while not stop.is_set():
            queue.answer_all()

    answerer = threading.Thread(target=answer_forever)
    answerer.start()
    try:
        fiber = Fiber(store, exports["sum_waits"], [300])
        while not fiber.poll():
            pass
    finally:
        stop.set()
        answerer.join()
    assert fiber.result == [sum(range(1, 301))]


def test_pending_fail_traps_guest_with_message():
    queue = WaitQueue(fail_when=lambda owner, x: x == 2)
    engine, linker, module = make_guest_env(queue, epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    fiber = Fiber(store, exports["sum_waits"], [5], owner="g7")
    while not fiber.poll():
        queue.answer_all()
    assert fiber.result is None and "no answer for g7 at 2" in fiber.trap


def test_guest_trap_reported():
    engine, linker, module = make_guest_env(WaitQueue(), epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    fiber = run_to_end(Fiber(store, exports["crash"]))
    assert fiber.trap_code == wasmtime.TrapCode.UNREACHABLE
    assert "unreachable" in fiber.trap and fiber.result is None


def test_missing_time_slice_interrupts_guest():
    engine, linker, module = make_guest_env(WaitQueue())
    store = wasmtime.Store(engine)  # epochs on, but no set_time_slice
    exports = linker.instantiate(store, module).exports(store)
    fiber = run_to_end(Fiber(store, exports["count_to"], [10]))
    assert fiber.trap_code == wasmtime.TrapCode.INTERRUPT


def test_out_of_fuel_when_fuel_is_enabled():
    engine, linker, module = make_guest_env(WaitQueue(), epoch_interruption=False, consume_fuel=True)
    store = wasmtime.Store(engine)
    store.set_fuel(100_000)
    exports = linker.instantiate(store, module).exports(store)
    fiber = run_to_end(Fiber(store, exports["spin"]))
    assert fiber.trap_code == wasmtime.TrapCode.OUT_OF_FUEL
    store.set_fuel(100_000)
    assert run_to_end(Fiber(store, exports["count_to"], [100])).result == [100]


def test_close_midway_frees_everything():
    queue = WaitQueue()
    engine, linker, module = make_guest_env(queue, epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    for _ in range(300):
        fiber = Fiber(store, exports["sum_waits"], [10])
        assert fiber.poll() is False
        (pending, _, _), = queue.waiting
        fiber.close()
        assert pending.abandoned and fiber.trap == "closed before it finished"
        pending.complete([1])  # a late answer for a closed fiber is harmless
        queue.waiting.clear()
    # Fibers dropped without close(), mid-call, are closed by the garbage collector.
    for _ in range(100):
        Fiber(store, exports["sum_waits"], [10]).poll()
    assert all(pending.abandoned for pending, _, _ in queue.waiting)
    assert run_to_end(Fiber(store, exports["count_to"], [5])).result == [5]


def test_one_call_at_a_time_per_store():
    engine, linker, module = make_guest_env(WaitQueue(), epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    first = Fiber(store, exports["sum_waits"], [1])
    with pytest.raises(RuntimeError, match="one call at a time"):
        Fiber(store, exports["count_to"], [1])
    first.close()
    assert run_to_end(Fiber(store, exports["count_to"], [1])).result == [1]


def test_two_threads_each_with_own_stores():
    """Handlers are shared; each thread's traps must name its own guests, never the other's."""
    def failing_guest(owner) -> bool:
        thread_name, index = owner
        return thread_name == "odd" and index % 2 == 1

    queue_by_thread = {}

    def wait(call, args):
        thread_name, index = call.fiber.owner
        if failing_guest(call.fiber.owner) and args[0] == 3:
            raise RuntimeError(f"guest {thread_name}/{index}")
        return queue_by_thread[thread_name](call, args)

    engine, linker, module = make_guest_env(wait, epoch_interruption=False)
    outcomes = {}

    def scheduler(thread_name):
        queue = queue_by_thread[thread_name]
        fibers = []
        for index in range(32):
            store, exports = new_guest(engine, linker, module)
            fibers.append(Fiber(store, exports["sum_waits"], [50], owner=(thread_name, index)))
        while not all([fiber.poll() for fiber in fibers]):
            queue.answer_all()
        outcomes[thread_name] = [(fiber.owner, fiber.result, fiber.trap) for fiber in fibers]

    threads = []
    for thread_name in ("odd", "even"):
        queue_by_thread[thread_name] = WaitQueue()
        threads.append(threading.Thread(target=scheduler, args=(thread_name,)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    for thread_name in ("odd", "even"):
        assert len(outcomes[thread_name]) == 32
        for owner, result, trap in outcomes[thread_name]:
            if failing_guest(owner):
                assert result is None and f"RuntimeError: guest {owner[0]}/{owner[1]}" in trap
            else:
                assert result == [2 * sum(range(50))] and trap is None


def test_handler_reads_and_writes_guest_memory():
    def wait(call, args):
        base, size = call.memory_location()
        assert size == 65536  # one wasm page
        value = ctypes.c_int32.from_address(base + 16).value  # the data segment's 42
        ctypes.c_int32.from_address(base + args[0]).value = value + 1
        return Ready([0])

    engine, linker, module = make_guest_env(wait, epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    assert run_to_end(Fiber(store, exports["wait_then_load"], [128])).result == [43]


def test_memory_written_while_waiting_is_seen_on_resume():
    calls = []

    def wait(call, args):
        calls.append((call, args[0], Pending()))
        return calls[-1][2]

    engine, linker, module = make_guest_env(wait, epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    fiber = Fiber(store, exports["wait_then_load"], [256])
    assert fiber.poll() is False
    (call, ptr, pending), = calls
    base, _ = call.memory_location()  # the guest is suspended: its memory holds still
    ctypes.c_int32.from_address(base + ptr).value = -7
    pending.complete([0])
    assert run_to_end(fiber).result == [-7]
    with pytest.raises(RuntimeError, match="already completed"):
        call.memory_location()


def test_sync_and_async_host_functions_side_by_side():
    engine, linker, _ = make_guest_env(lambda call, args: Ready([args[0] * 3]), epoch_interruption=False)
    linker.define_func("symphony", "add", [I32, I32], [I32], lambda call, args: [args[0] + args[1]])
    module = wasmtime.Module(engine, wasmtime.wat2wasm("""
        (module
          (import "symphony" "wait" (func $wait (param i32) (result i32)))
          (import "symphony" "add" (func $add (param i32 i32) (result i32)))
          (func (export "run") (param i32) (result i32)
            (call $add (call $wait (local.get 0)) (i32.const 1))))"""))
    store = wasmtime.Store(engine)
    exports = linker.instantiate(store, module).exports(store)
    assert run_to_end(Fiber(store, exports["run"], [5])).result == [16]


def test_start_function_may_block():
    queue = WaitQueue(answer=lambda owner, x: x + 1)
    engine, linker, _ = make_guest_env(queue, epoch_interruption=False)
    module = wasmtime.Module(engine, wasmtime.wat2wasm("""
        (module
          (import "symphony" "wait" (func $wait (param i32) (result i32)))
          (global $ready (mut i32) (i32.const 0))
          (func $start (global.set $ready (call $wait (i32.const 41))))
          (start $start)
          (func (export "ready") (result i32) (global.get $ready)))"""))
    store = wasmtime.Store(engine)
    instantiation = linker.start_instantiate(store, module, owner="booting")
    assert instantiation.poll() is False and queue.waiting[0][1:] == ("booting", 41)
    queue.answer_all()
    assert instantiation.poll() is True
    instance, = instantiation.result
    assert run_to_end(Fiber(store, instance.exports(store)["ready"])).result == [42]


def test_instantiate_reports_missing_import():
    engine = make_async_engine(epoch_interruption=False)
    module = wasmtime.Module(engine, wasmtime.wat2wasm(GUEST_WAT))
    with pytest.raises(wasmtime.WasmtimeError, match="symphony::wait"):
        AsyncLinker(engine).instantiate(wasmtime.Store(engine), module)


def test_wasi_guest_output_and_exit_code(tmp_path):
    engine = make_async_engine(epoch_interruption=False)
    linker = AsyncLinker(engine)
    linker.define_wasi()
    module = wasmtime.Module(engine, wasmtime.wat2wasm("""
        (module
          (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
          (memory (export "memory") 1)
          (data (i32.const 8) "\\00\\01\\00\\00\\03\\00\\00\\00")  ;; iovec: 3 bytes at 256
          (data (i32.const 256) "hi\\n")
          (func (export "_start")
            (drop (call $fd_write (i32.const 1) (i32.const 8) (i32.const 1) (i32.const 32)))
            (call $proc_exit (i32.const 3))))"""))
    store = wasmtime.Store(engine)
    wasi = wasmtime.WasiConfig()
    wasi.stdout_file = str(tmp_path / "stdout")
    store.set_wasi(wasi)
    fiber = run_to_end(Fiber(store, linker.instantiate(store, module).exports(store)["_start"]))
    assert fiber.exit_code == 3 and fiber.result == [] and fiber.trap is None
    assert (tmp_path / "stdout").read_text() == "hi\n"


def test_keyboard_interrupt_in_handler_reaches_host():
    def interrupted(call, args):
        raise KeyboardInterrupt

    engine, linker, module = make_guest_env(interrupted, epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    fiber = Fiber(store, exports["sum_waits"], [1])
    with pytest.raises(KeyboardInterrupt):
        fiber.poll()
    assert fiber.done and "KeyboardInterrupt" in fiber.trap


def test_a_fresh_time_slice_at_poll_lets_a_resumed_guest_reach_its_next_call():
    queue = WaitQueue()
    engine, linker, module = make_guest_env(queue)
    store, exports = new_guest(engine, linker, module, slice_ticks=1)
    fibers = [Fiber(store, exports["sum_waits"], [3])]
    assert fibers[0].poll() is False and len(queue.waiting) == 1
    for _ in range(3):
        engine.increment_epoch()  # its deadline passes while it waits
    queue.answer_all()
    assert fibers[0].poll() is False and queue.waiting == []  # resumed past its deadline: it yields at once
    assert fibers[0].poll(time_slice_ticks=5) is False and len(queue.waiting) == 1  # a fresh slice: the next call


TICKING_GUEST_WAT = """
(module
  (import "symphony" "wait" (func $wait (param i32) (result i32)))
  (import "symphony" "tick" (func $tick))
  (func (export "wait_tick_wait") (result i32) (local $i i32)
    (drop (call $wait (i32.const 1)))
    (call $tick)  ;; the epoch ticks just after the guest resumed
    (loop $next  ;; a little computing: epoch checks on every back edge
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $next (i32.lt_u (local.get $i) (i32.const 100))))
    (call $wait (i32.const 2))))
"""


@pytest.mark.parametrize("ticks", [1, 3])
def test_a_fresh_time_slice_of_n_ticks_outlasts_n_ticks(ticks):
    """A slice's deadline counts ticks of a clock that does not start with it: the next tick
    may come a microsecond after the guest resumed. A slice of one tick was then over at once,
    and a guest that resumed from a pred was preempted before it reached its next pred (the
    batch went on without it: hello's batches of 8 split, 49 forward passes for 48 tokens).
    Now a fresh slice of n ticks lasts until the (n+1)th tick."""
    queue, ticking = WaitQueue(), [0]
    engine = make_async_engine()
    linker = AsyncLinker(engine)
    linker.define_async("symphony", "wait", [I32], [I32], queue)

    def tick(call, args):
        for _ in range(ticking[0]):
            engine.increment_epoch()
        return ()

    linker.define_func("symphony", "tick", [], [], tick)
    module = wasmtime.Module(engine, wasmtime.wat2wasm(TICKING_GUEST_WAT))
    for passed, preempted in ((ticks, False), (ticks + 1, True)):
        ticking[0], queue.waiting = passed, []  # the ticks that come just after the guest resumes
        store, exports = new_guest(engine, linker, module, slice_ticks=ticks)
        fiber = Fiber(store, exports["wait_tick_wait"])
        assert fiber.poll(time_slice_ticks=ticks) is False and len(queue.waiting) == 1
        queue.answer_all()
        assert fiber.poll(time_slice_ticks=ticks) is False
        assert len(queue.waiting) == (0 if preempted else 1)  # its next call, or yielded before it


def test_a_blocking_function_takes_at_most_sixteen_parameters():
    linker = AsyncLinker(make_async_engine())
    with pytest.raises(TypeError, match="at most 16"):
        linker.define_async("symphony", "wide", [I32] * 17, [I32], WaitQueue())


def test_a_blocking_call_outside_fiber_poll_traps_the_guest():
    """Only `Fiber.poll` tells the C callback where to record a call: a future polled any other
    way gets a trap, never a write through a null slot."""
    from symphony_os.wasm import fiber as fiber_module

    queue = WaitQueue()
    engine, linker, module = make_guest_env(queue, epoch_interruption=False)
    store, exports = new_guest(engine, linker, module)
    fiber = Fiber(store, exports["sum_waits"], [2])
    assert fiber_module._future_poll(fiber._future) is True  # the guest trapped in its first call
    fiber._finish()
    assert queue.waiting == [] and "outside Fiber.poll" in fiber.trap


WIDE_WAT = """
(module
  (import "symphony" "wide" (func $wide (param i32 i64 f32 f64) (result i64)))
  (func (export "run") (result i64)
    (call $wide (i32.const -7) (i64.const 9000000000) (f32.const 1.5) (f64.const -2.25))))
"""


def test_a_blocking_call_receives_arguments_of_every_kind():
    seen = []

    def wide(call, args):
        seen.append(tuple(args))
        return Ready([args[1] + 1])

    engine = make_async_engine(epoch_interruption=False)
    linker = AsyncLinker(engine)
    I64, F32, F64 = wasmtime.ValType.i64(), wasmtime.ValType.f32(), wasmtime.ValType.f64()
    linker.define_async("symphony", "wide", [I32, I64, F32, F64], [I64], wide)
    store = wasmtime.Store(engine)
    exports = linker.instantiate(store, wasmtime.Module(engine, wasmtime.wat2wasm(WIDE_WAT))).exports(store)
    assert run_to_end(Fiber(store, exports["run"])).result == [9000000001]
    assert seen == [(-7, 9000000000, 1.5, -2.25)]


SPIN_THEN_WAIT_WAT = """
(module
  (import "symphony" "wait2" (func $wait (param i32 i32) (result i32)))
  (func (export "run") (param $id i32) (param $n i32) (result i32) (local $i i32) (local $k i32) (local $sum i32)
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
      (local.set $k (i32.const 0))
      (loop $spin (local.set $k (i32.add (local.get $k) (i32.const 1)))
        (br_if $spin (i32.lt_u (local.get $k) (i32.const 20000))))
      (local.set $sum (i32.add (local.get $sum) (call $wait (local.get $id) (local.get $i))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next)))
    (local.get $sum)))
"""


def test_two_threads_polling_at_once_record_each_call_in_its_own_fiber():
    """Each guest computes before each call, so both threads are inside the C poll together
    (ctypes lets go of the GIL there): a call must land in the fiber its own thread polls."""
    misplaced = []

    def wait(call, args):
        if args[0] != call.fiber.owner:
            misplaced.append((call.fiber.owner, args[0]))
        return Ready([args[1]])

    engine = make_async_engine(epoch_interruption=False)
    linker = AsyncLinker(engine)
    linker.define_async("symphony", "wait2", [I32, I32], [I32], wait)
    module = wasmtime.Module(engine, wasmtime.wat2wasm(SPIN_THEN_WAIT_WAT))
    results = {}

    def scheduler(base: int) -> None:
        fibers = []
        for owner in range(base, base + 4):
            store = wasmtime.Store(engine)
            exports = linker.instantiate(store, module).exports(store)
            fibers.append((store, Fiber(store, exports["run"], [owner, 300], owner=owner)))
        for _, fiber in fibers:
            run_to_end(fiber, max_polls=10)
        results[base] = [fiber.result for _, fiber in fibers]

    threads = [threading.Thread(target=scheduler, args=(base,)) for base in (100, 200)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert misplaced == []
    assert results == {100: [[sum(range(300))]] * 4, 200: [[sum(range(300))]] * 4}


def test_a_sync_handler_may_poll_another_fiber_and_its_own_guest_blocks_afterwards():
    queue = WaitQueue()
    engine, linker, _ = make_guest_env(queue, epoch_interruption=False)
    nested = {}

    def poke(call, args):
        nested["other polled"] = nested["other"].poll()
        return [7]

    linker.define_func("symphony", "poke", [], [I32], poke)
    module = wasmtime.Module(engine, wasmtime.wat2wasm("""
        (module
          (import "symphony" "wait" (func $wait (param i32) (result i32)))
          (import "symphony" "poke" (func $poke (result i32)))
          (func (export "outer") (result i32) (call $wait (i32.add (call $poke) (i32.const 100))))
          (func (export "other") (result i32) (call $wait (i32.const 5))))"""))
    stores = [wasmtime.Store(engine) for _ in range(2)]
    outer_exports, other_exports = (linker.instantiate(store, module).exports(store) for store in stores)
    nested["other"] = other = Fiber(stores[1], other_exports["other"], owner="other")
    outer = Fiber(stores[0], outer_exports["outer"], owner="outer")
    assert outer.poll() is False and nested["other polled"] is False
    assert sorted((owner, x) for _, owner, x in queue.waiting) == [("other", 5), ("outer", 107)]
    queue.answer_all()
    assert run_to_end(outer).result == [214] and run_to_end(other).result == [10]


def test_a_handler_that_closes_its_own_fiber_ends_it_without_touching_the_call():
    fibers = []

    def close_mine(call, args):
        fibers[0].close()  # the guest's call is unwound: its result and trap slots are gone
        return Ready([1]) if args[0] == 0 else Pending()

    engine, linker, module = make_guest_env(close_mine, epoch_interruption=False)
    for start in (0, 1):  # answered at once / left waiting
        store, exports = new_guest(engine, linker, module)
        fibers[:] = [Fiber(store, exports["wait_then_load"], [start])]
        assert fibers[0].poll() is True
        assert fibers[0].done and fibers[0].trap == "closed before it finished"
        assert fibers[0].poll() is True
