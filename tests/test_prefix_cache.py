"""The automatic prefix cache (prefix_cache.py): what it keeps must be exactly the KV of the
token ids it is filed under, whatever a guest does to the file it offers, and a block it could
not make must leave nothing behind."""
import struct

from hostile import guest, report, sent_i32s

from symphony_os.errors import PoolExhausted
from symphony_os.kv.kvfs import KVFS
from symphony_os.kv.pool import KVPool
from symphony_os.kv.prefix_cache import PrefixCache, cache_owner, page_keys
from symphony_os.lip.runtime import Runtime

PROMPT = list(range(1, 9)) + [9]  # two whole pages of 4, and one token to feed
OTHER = list(range(100, 108))
# Positions that are not consecutive: the pred fails when it is scheduled, not when submitted.
BAD_POSITIONS = [0, 2, 3, 4, 5, 6, 7, 8]


def data(address: int, ints: list[int]) -> str:
    escaped = "".join(f"\\{b:02x}" for b in struct.pack(f"<{len(ints)}i", *ints))
    return f'(data (i32.const {address}) "{escaped}")'


DATA = data(3000, PROMPT) + data(3200, OTHER) + data(3400, BAD_POSITIONS)
# Opens the prompt's longest cached prefix, feeds what is not cached, sends (cached, next token).
READER = guest("""(local.set $h (call $kv_open_prefix (i32.const 3000) (i32.const 9)))
  (local.set $i (call $kv_len (local.get $h)))""" + report(
    "(local.get $i)", "(call $pred (local.get $h) (i32.add (i32.const 3000) (i32.mul (local.get $i) (i32.const 4))) "
    "(i32.const 0) (i32.sub (i32.const 9) (local.get $i)) (i32.const 2) (i32.const 0) (i32.const 0) (i32.const 0))"),
    data=DATA)


def test_a_file_whose_pred_failed_is_never_cached_under_the_ids_the_host_recorded(tiny_engine):
    """The prompt's 8 tokens fail when scheduled (bad positions) and 8 others then succeed: the
    host had recorded both, the file held only the others' KV, and after a truncate to 8 the
    lengths agreed and kv_cache_prefix filed that KV under the prompt. Every later process of the tenant (and its OpenAI
    completions) then read the wrong KV. Now the offer is refused."""
    poisoner = guest("""(local.set $h (call $kv_open_prefix (i32.const 3000) (i32.const 9)))
      (i32.store (i32.const 4000) (call $pred_submit (local.get $h) (i32.const 3000) (i32.const 3400) (i32.const 8)
                                                     (i32.const 2) (i32.const 0)))
      (i32.store (i32.const 4004) (call $pred_submit (local.get $h) (i32.const 3200) (i32.const 0) (i32.const 8)
                                                     (i32.const 2) (i32.const 0)))
      (i32.store (i32.const 4008) (call $pred_wait (i32.load (i32.const 4000)) (i32.const 0) (i32.const 0)))
      (i32.store (i32.const 4012) (call $pred_wait (i32.load (i32.const 4004)) (i32.const 0) (i32.const 0)))
      (drop (call $kv_truncate (local.get $h) (i32.const 8)))  ;; the recorded ids: the prompt's
      """ +
                     report("(i32.load (i32.const 4008))", "(i32.load (i32.const 4012))",
                            "(call $kv_cache_prefix (local.get $h))"), data=DATA)
    with Runtime(tiny_engine) as runtime:
        def run(module, tenant):
            out = []
            process = runtime.spawn(runtime.load(module, "guest"), tenant=tenant, on_output=out.append)
            assert runtime.wait(process, 60) == 0, process.end_reason
            return sent_i32s(b"".join(out))

        clean = run(READER, "clean")
        failed, succeeded, cached = run(poisoner, "alice")
        assert failed == -7 and succeeded >= 0  # POSITION_ERROR, then a token
        assert cached == -1  # INVALID_ARGUMENT: nothing filed under the prompt
        assert run(READER, "alice") == clean == [0, clean[1]]


def test_a_block_that_could_not_be_made_leaves_no_empty_block_behind():
    """save_copy named the block, then ran out of pages copying into it: the empty block stayed,
    and every later lookup over that prefix raised IndexError (INTERNAL to the guest) and leaked
    the handle it had opened."""
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=4, page_size=4)
    fs = KVFS(pool)
    cache = PrefixCache(fs)
    tenant = fs.session("victim")
    handle, tracked = cache.open_longest(tenant, PROMPT)
    with fs.lock:
        fs.reserve_slots(tenant.file_of(handle), [0, 1, 2, 3])  # what a pred appends
    tracked.ids.extend(PROMPT[:4])
    other = fs.session("other")  # fills the pool with pinned open files: the victim's goes to host memory
    for _ in range(4):
        pinned = other.create()
        other.set_hints(pinned, pinned=True)
        with fs.lock:
            fs.reserve_slots(other.file_of(pinned), [0, 1, 2, 3])
    try:
        cache.offer(tenant, handle, tracked)
        raise AssertionError("the offer found room")
    except PoolExhausted:
        pass
    assert fs.lookup(cache_owner("victim"), page_keys(PROMPT[:4], 4)[0]) is None
    other.close_all()
    assert cache.offer(tenant, handle, tracked) == 4
    opened = tenant.open_handles
    again, _ = cache.open_longest(tenant, PROMPT)
    assert tenant.len(again) == 4 and tenant.open_handles == opened + 1
    tenant.close_all()
