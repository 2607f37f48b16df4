"""Per-process limits (limits.py): the KV page limit's accounting (check_kv_pages), against the
engine's own steps (a pred queued, then running: its slots reserved, the forward pass not yet
done, then done), and the host-call rate."""
import time
from types import SimpleNamespace

import pytest

from symphony_os.engine.sampling import GREEDY
from symphony_os.engine.scheduler import PredRequest
from symphony_os.errors import LimitExceeded
from symphony_os.kv.kvfs import KVFS
from symphony_os.kv.pool import KVPool
from symphony_os.lip.syscalls import check_kv_pages
from symphony_os.lip.limits import ProcessLimits, Usage


def test_a_pred_in_flight_counts_once_while_queued_running_and_done():
    """The running pred's tokens are in the file's length (reserved) but not yet in its `done`
    (counted after the forward pass): they were counted twice then, and a process near its
    limit was refused at random while an earlier pred ran."""
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=64, page_size=4)
    fs = KVFS(pool)
    kv = fs.session("t")
    handle = kv.create()
    request = PredRequest(kv.take_for_pred(handle), list(range(16)), None, GREEDY)  # 4 pages
    process = SimpleNamespace(limits=SimpleNamespace(kv_pages=5), kv=kv, engine=SimpleNamespace(pool=pool),
                              syscalls=SimpleNamespace(tickets={1: request}))
    check_kv_pages(process, handle, 4)  # queued: 4 pages, and 1 for 4 tokens more
    with pytest.raises(LimitExceeded, match="its files hold 0 of 5 pages, 6 more needed"):
        check_kv_pages(process, handle, 5)
    with fs.lock:  # Engine._prepare: the first chunk's slots are reserved
        request.length_before = request.file.length
        fs.reserve_slots(request.file, list(range(8)))
    check_kv_pages(process, handle, 4)  # running: the same 5 pages
    request.done = 8
    with fs.lock:
        fs.reserve_slots(request.file, list(range(8, 16)))
    check_kv_pages(process, handle, 4)
    request.done = 16
    request.future.set_result(None)  # done: its tokens are the file's now
    check_kv_pages(process, handle, 4)
    with pytest.raises(LimitExceeded, match="its files hold 4 of 5 pages, 2 more needed"):
        check_kv_pages(process, handle, 5)
    request.file.inflight -= 1
    fs.release(request.file)
    kv.close_all()


@pytest.mark.parametrize("body, limits, by_limit", [
    # Grows its memory until refused, then traps: a trap's reason spans lines (its backtrace).
    ("(block $b (loop $l (br_if $b (i32.eq (memory.grow (i32.const 1)) (i32.const -1))) (br $l))) unreachable",
     dict(memory_bytes=4 << 20), True),
    ("(loop $l (br $l))", dict(cpu_time_s=0.2), True),
    ("unreachable", {}, False),
])
def test_an_end_by_a_limit_is_told_from_other_ends(tiny_engine, body, limits, by_limit):
    """The OpenAI path answers a completion stopped by its tenant's limits with a 403."""
    from dataclasses import replace

    from guests import wat

    from symphony_os.lip.limits import ProcessLimits, ended_by_limit
    from symphony_os.lip.runtime import Runtime

    module = wat(f'(module (memory (export "memory") 1) (func (export "_start") {body}))')
    with Runtime(tiny_engine) as runtime:
        process = runtime.spawn(runtime.load(module, "guest"), limits=replace(ProcessLimits(), **limits))
        runtime.wait(process, 60)
    assert ended_by_limit(process.end_reason) is by_limit, process.end_reason
    assert not ended_by_limit("killed: the request went away") and not ended_by_limit("exit 3")


def test_host_call_rate_holds_after_an_idle_spell():
    """The window was replaced only once the count passed the limit: after an idle second, a
    stale window's room and a fresh one's added up to twice the rate within a millisecond."""
    usage = Usage(ProcessLimits(hostcalls_per_s=1000))
    usage.charge_hostcall()
    time.sleep(1.05)
    accepted = 0
    with pytest.raises(LimitExceeded):
        for _ in range(3000):
            usage.charge_hostcall()
            accepted += 1
    assert 1000 <= accepted <= 1000 * 17 // 16
    time.sleep(1.05)
    usage.charge_hostcall()  # a new second, a new window


def test_a_host_call_rate_of_zero_refuses_every_call():
    usage = Usage(ProcessLimits(hostcalls_per_s=0))
    for _ in range(3):
        with pytest.raises(LimitExceeded):
            usage.charge_hostcall()
