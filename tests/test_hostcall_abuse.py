"""Every host call with hostile arguments: out-of-bounds, negative and huge pointers and
lengths, stale and foreign handles, bad tickets. Each gets its error code; the host and a
well-behaved process next to it carry on; nothing leaks."""
import struct
import threading
import time
from pathlib import Path

import pytest
from guests import ECHO, build_c, rust_test_guest, wat

from symphony_os.engine.sampling import GreedyEach
from symphony_os.errors import ErrorCode as E
from symphony_os.lip.core_abi import MIN_SLEEP_S, CoreCalls
from symphony_os.lip.syscalls import MAX_TEXT_BYTES
from symphony_os.lip.limits import ProcessLimits
from symphony_os.lip.process import EXIT_KILLED
from symphony_os.lip.runtime import Runtime

ROOT = Path(__file__).resolve().parent.parent
PAGE = 65536  # the guest has one page of memory
OOB, NEG, HUGE = PAGE - 2, -1, 0x7FFFFFF0
TEXT, BAD_IDS, GOOD_IDS, BAD_IOVEC = 1024, 1100, 1200, 1300
RESULTS = 4096
# Sampling records (core_abi.SAMPLING_RECORD, then SAMPLING_MORE when has_seed holds 2): a flag
# no one defined; penalized ids out of bounds; more penalized ids than the vocabulary; a record
# whose 24 more bytes would lie past the end of memory; log-probabilities that are neither on
# nor off; too many top ones; two top ones (5 values, for a cap of 3).
SAMPLING = struct.Struct("<ffiiQiiiiiiffiiii")
BAD_FLAGS, WILD_PENALIZED, TOO_MANY_PENALIZED, MORE_PAST_THE_END = 1400, 1500, 1600, PAGE - 56
ODD_LOGPROBS, TOO_MANY_TOP, TWO_TOP = 1700, 1800, 1900
SAMPLING_RECORDS = {
    BAD_FLAGS: SAMPLING.pack(0, 1, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0),
    WILD_PENALIZED: SAMPLING.pack(0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 2, OOB, 10, 0, 0),
    TOO_MANY_PENALIZED: SAMPLING.pack(0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 2, GOOD_IDS, HUGE, 0, 0),
    MORE_PAST_THE_END: SAMPLING.pack(0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0)[:48],
    ODD_LOGPROBS: SAMPLING.pack(0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 2, 0),
    TOO_MANY_TOP: SAMPLING.pack(0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 99),
    TWO_TOP: SAMPLING.pack(0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 2),
}

# (call, args, expected). "KV" is a handle the guest created, "STALE" one it closed,
# "TICKET" a pred in flight. 3 is a handle number this guest never got (another process may hold it).
CASES = [
    ("kv_len", [99], E.BAD_HANDLE), ("kv_len", [NEG], E.BAD_HANDLE), ("kv_len", ["STALE"], E.BAD_HANDLE),
    ("kv_close", ["STALE"], E.BAD_HANDLE), ("kv_close", [0], E.BAD_HANDLE),
    ("kv_fork", [HUGE], E.BAD_HANDLE), ("kv_fork", [3], E.BAD_HANDLE),
    ("kv_extract", ["KV", 5, 2], E.INVALID_ARGUMENT), ("kv_extract", ["KV", NEG, 0], E.INVALID_ARGUMENT),
    ("kv_extract", ["STALE", 0, 0], E.BAD_HANDLE),
    ("kv_merge", ["KV", 12345], E.BAD_HANDLE),
    # KV has a pred in flight (TICKET): its length and KV are not settled, so no copy of it
    ("kv_fork", ["KV"], E.FILE_BUSY), ("kv_extract", ["KV", 0, 0], E.FILE_BUSY), ("kv_merge", ["KV", "KV"], E.FILE_BUSY),
    ("kv_truncate", ["KV", 0], E.FILE_BUSY),
    ("kv_truncate", ["KV", 99999], E.INVALID_ARGUMENT), ("kv_truncate", ["KV", NEG], E.INVALID_ARGUMENT),
    ("kv_hint", ["KV", 8, 0, 0], E.INVALID_ARGUMENT), ("kv_hint", ["STALE", 1, 0, 0], E.BAD_HANDLE),
    ("kv_open", [OOB, 100, 0], E.BAD_POINTER), ("kv_open", [NEG, 4, 0], E.BAD_POINTER),
    ("kv_open", [TEXT, NEG, 0], E.INVALID_ARGUMENT), ("kv_open", [TEXT, HUGE, 1], E.INVALID_ARGUMENT),
    ("kv_open", [TEXT, 3, 99], E.INVALID_ARGUMENT), ("kv_open", [TEXT, 3, 0], E.FILE_NOT_FOUND),
    ("kv_open", [TEXT + 4, 4, 1], E.INVALID_ARGUMENT),  # "../x"
    ("kv_remove", [TEXT, 3], E.FILE_NOT_FOUND), ("kv_remove", [OOB, 10], E.BAD_POINTER),
    ("kv_open_prefix", [NEG, 1], E.BAD_POINTER), ("kv_open_prefix", [OOB, 100], E.BAD_POINTER),
    ("kv_open_prefix", [GOOD_IDS, 0], E.INVALID_ARGUMENT), ("kv_open_prefix", [GOOD_IDS, HUGE], E.INVALID_ARGUMENT),
    ("kv_cache_prefix", ["KV"], E.BAD_HANDLE), ("kv_cache_prefix", [NEG], E.BAD_HANDLE),
    ("tool", [OOB, 4, TEXT, 3, RESULTS + 512, 16], E.BAD_POINTER),
    ("tool", [TEXT, 0, TEXT, 3, RESULTS + 512, 16], E.INVALID_ARGUMENT),
    ("tool", [TEXT, 3, TEXT, NEG, RESULTS + 512, 16], E.INVALID_ARGUMENT),
    ("tool", [TEXT, 3, OOB, 10, RESULTS + 512, 16], E.BAD_POINTER),
    ("tool", [TEXT, 3, TEXT, 3, OOB, 100], E.BAD_POINTER), ("tool", [TEXT, 3, TEXT, 3, 0, NEG], E.INVALID_ARGUMENT),
    ("tool", [TEXT, 3, TEXT, 3, RESULTS + 512, 16], E.UNSUPPORTED),  # "abc": no such tool
    ("tokenize", [OOB, 10, 0, RESULTS + 512, 4], E.BAD_POINTER),
    ("tokenize", [TEXT, NEG, 0, RESULTS + 512, 4], E.INVALID_ARGUMENT),
    ("tokenize", [TEXT, 3, 0, OOB, 100], E.BAD_POINTER), ("tokenize", [TEXT, 3, 0, 0, NEG], E.INVALID_ARGUMENT),
    ("tokenize", [TEXT, 3, 7, 0, 0], E.INVALID_ARGUMENT),
    ("detokenize", [NEG, 2, 0, 0], E.BAD_POINTER), ("detokenize", [GOOD_IDS, NEG, 0, 0], E.INVALID_ARGUMENT),
    ("detokenize", [GOOD_IDS, HUGE, 0, 0], E.INVALID_ARGUMENT), ("detokenize", [BAD_IDS, 1, 0, 0], E.INVALID_ARGUMENT),
    ("detokenize", [GOOD_IDS, 1, OOB, 100], E.BAD_POINTER),
    ("chat_template", [OOB, 10, 1, RESULTS, 100], E.BAD_POINTER),
    ("chat_template", [TEXT, NEG, 1, RESULTS, 100], E.INVALID_ARGUMENT),
    ("chat_template", [TEXT, HUGE, 1, RESULTS, 100], E.INVALID_ARGUMENT),
    ("chat_template", [TEXT, 3, 1, OOB, 100], E.BAD_POINTER), ("chat_template", [TEXT, 3, 7, 0, 0], E.INVALID_ARGUMENT),
    ("chat_template", [TEXT, 3, 1, RESULTS, NEG], E.INVALID_ARGUMENT),
    ("chat_template", [TEXT, 3, 1, RESULTS, 100], E.INVALID_ARGUMENT),  # not JSON messages
    ("grammar_new", [9, TEXT, 3], E.INVALID_ARGUMENT), ("grammar_new", [0, OOB, 100], E.BAD_POINTER),
    ("grammar_new", [0, TEXT, NEG], E.INVALID_ARGUMENT), ("grammar_new", [0, TEXT, HUGE], E.INVALID_ARGUMENT),
    ("grammar_new", [0, TEXT, 3], E.INVALID_ARGUMENT),  # "abc": not a JSON schema
    ("grammar_fork", [NEG], E.BAD_HANDLE), ("grammar_accept", [7, GOOD_IDS, 1], E.BAD_HANDLE),
    ("grammar_accept", [7, NEG, HUGE], E.INVALID_ARGUMENT), ("grammar_rollback", [HUGE, 1], E.BAD_HANDLE),
    ("grammar_state", [0], E.BAD_HANDLE), ("grammar_close", [NEG], E.BAD_HANDLE),
    ("eos_ids", [NEG, 4], E.BAD_POINTER), ("eos_ids", [0, NEG], E.INVALID_ARGUMENT),
    ("model_name", [OOB, 100], E.BAD_POINTER),
    ("pred_submit", [77, GOOD_IDS, 0, 1, 0, 0], E.BAD_HANDLE),
    ("pred_submit", ["STALE", GOOD_IDS, 0, 1, 0, 0], E.BAD_HANDLE),
    ("pred_submit", ["KV", NEG, 0, 1, 0, 0], E.BAD_POINTER),
    ("pred_submit", ["KV", GOOD_IDS, OOB, 1, 0, 0], E.BAD_POINTER),
    ("pred_submit", ["KV", GOOD_IDS, 0, 0, 0, 0], E.INVALID_ARGUMENT),
    ("pred_submit", ["KV", GOOD_IDS, 0, NEG, 0, 0], E.INVALID_ARGUMENT),
    ("pred_submit", ["KV", GOOD_IDS, 0, HUGE, 0, 0], E.INVALID_ARGUMENT),
    ("pred_submit", ["KV", OOB, 0, 1000, 0, 0], E.BAD_POINTER),
    ("pred_submit", ["KV", BAD_IDS, 0, 1, 0, 0], E.INVALID_ARGUMENT),
    ("pred_submit", ["KV", GOOD_IDS, 0, 1, 9, 0], E.INVALID_ARGUMENT),
    ("pred_submit", ["KV", GOOD_IDS, 0, 1, 1, 0], E.INVALID_ARGUMENT),  # top-0
    ("pred_submit", ["KV", GOOD_IDS, 0, 1, 2, OOB], E.BAD_POINTER),  # sampling record
    ("pred_submit", ["KV", GOOD_IDS, 0, 1, 2, NEG], E.BAD_POINTER),
    ("pred_submit", ["KV", GOOD_IDS, 0, 1, 2, BAD_FLAGS], E.INVALID_ARGUMENT),
    ("pred_submit", ["KV", GOOD_IDS, 0, 1, 2, WILD_PENALIZED], E.BAD_POINTER),
    ("pred_submit", ["KV", GOOD_IDS, 0, 1, 2, TOO_MANY_PENALIZED], E.INVALID_ARGUMENT),
    ("pred_submit", ["KV", GOOD_IDS, 0, 1, 2, MORE_PAST_THE_END], E.BAD_POINTER),
    ("pred_submit", ["KV", GOOD_IDS, 0, 1, 2, ODD_LOGPROBS], E.INVALID_ARGUMENT),
    ("pred_submit", ["KV", GOOD_IDS, 0, 1, 2, TOO_MANY_TOP], E.INVALID_ARGUMENT),
    ("pred_wait", [999, 0, 0], E.BAD_HANDLE), ("pred_wait", [NEG, 0, 0], E.BAD_HANDLE),
    ("pred_wait", ["TICKET", OOB, 1000], E.BAD_POINTER),  # the distribution does not fit there
    ("pred_wait", ["TICKET", RESULTS + 1024, 3], E.BUFFER_TOO_SMALL),
    ("send", [NEG, 5], E.BAD_POINTER), ("send", [0, NEG], E.INVALID_ARGUMENT), ("send", [OOB, 10], E.BAD_POINTER),
    ("send", [0, HUGE], E.INVALID_ARGUMENT),
    ("recv", [0, NEG], E.INVALID_ARGUMENT), ("recv", [OOB, 100], E.BAD_POINTER),
    ("pred_wait", ["TICKET", 0, NEG], E.INVALID_ARGUMENT), ("pred_wait", ["TICKET", 0, HUGE], E.BAD_POINTER),
    # pred (submit + wait in one call): every failure comes before anything is queued
    ("pred", [77, GOOD_IDS, 0, 1, 2, 0, 0, 0], E.BAD_HANDLE), ("pred", ["STALE", GOOD_IDS, 0, 1, 2, 0, 0, 0], E.BAD_HANDLE),
    ("pred", ["KV", OOB, 0, 1000, 2, 0, 0, 0], E.BAD_POINTER), ("pred", ["KV", GOOD_IDS, 0, NEG, 2, 0, 0, 0], E.INVALID_ARGUMENT),
    ("pred", ["KV", GOOD_IDS, 0, 1, 9, 0, 0, 0], E.INVALID_ARGUMENT),
    ("pred", ["KV", GOOD_IDS, 0, 1, 0, 0, RESULTS + 1024, 3], E.BUFFER_TOO_SMALL),  # the distribution
    ("pred", ["KV", GOOD_IDS, 0, 1, 2, TWO_TOP, RESULTS + 1024, 3], E.BUFFER_TOO_SMALL),  # the log-probabilities
    ("pred", ["KV", GOOD_IDS, 0, 1, 4, 2, RESULTS + 1024, 99], E.INVALID_ARGUMENT),  # scoring 1 token
    ("pred", ["KV", GOOD_IDS, 0, 2, 4, 2, RESULTS + 1024, 4], E.BUFFER_TOO_SMALL),  # 1 score and its top 2: 5 values
    ("pred_submit", ["KV", GOOD_IDS, 0, 2, 4, 99], E.INVALID_ARGUMENT),  # top 99
    ("pred", ["KV", GOOD_IDS, 0, 1, 0, 0, OOB, HUGE], E.BAD_POINTER), ("pred", ["KV", GOOD_IDS, 0, 1, 2, 0, 0, NEG], E.INVALID_ARGUMENT),
]


def arg(value):
    return f"(global.get ${value.lower()})" if isinstance(value, str) else f"(i32.const {value})"


def _wat_bytes(data: bytes) -> str:
    return "".join("\\%02x" % b for b in data)


def abusive_module() -> bytes:
    table = CoreCalls.table()
    imports = "\n".join(
        f'(import "symphony" "{name}" (func ${name} (param {" i32" * n}) (result i32)))' if n else
        f'(import "symphony" "{name}" (func ${name} (result i32)))' for name, n in table.items())
    calls = "\n".join(
        f"(i32.store (i32.const {RESULTS + 4 * i}) (call ${name} {' '.join(arg(a) for a in args)}))"
        for i, (name, args, _) in enumerate(CASES))
    records = "\n".join(f'(data (i32.const {at}) "{_wat_bytes(record)}")' for at, record in SAMPLING_RECORDS.items())
    return wat(f"""(module
      {imports}
      (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
      (memory (export "memory") 1)
      (data (i32.const {TEXT}) "abc\\00../x")
      (data (i32.const {BAD_IDS}) "\\ff\\ff\\ff\\7f")
      (data (i32.const {GOOD_IDS}) "\\01\\00\\00\\00")
      (data (i32.const {BAD_IOVEC}) "\\00\\00\\ff\\7f\\10\\00\\00\\00")
      {records}
      (global $kv (mut i32) (i32.const 0))
      (global $stale (mut i32) (i32.const 0))
      (global $ticket (mut i32) (i32.const 0))
      (func (export "_start")
        (global.set $kv (call $kv_create))
        (global.set $stale (call $kv_create))
        (drop (call $kv_close (global.get $stale)))
        (global.set $ticket (call $pred_submit (global.get $kv) (i32.const {GOOD_IDS}) (i32.const 0)
                                              (i32.const 1) (i32.const 0) (i32.const 0)))
        {calls}
        ;; WASI output with a wild iovec: an errno, not a crash
        (i32.store (i32.const {RESULTS + 4 * len(CASES)})
                   (call $fd_write (i32.const 1) (i32.const {BAD_IOVEC}) (i32.const 1) (i32.const 0)))
        (i32.store (i32.const {RESULTS + 4 * len(CASES) + 4})
                   (call $fd_write (i32.const 9) (i32.const {BAD_IOVEC}) (i32.const 1) (i32.const 0)))
        (drop (call $send (i32.const {RESULTS}) (i32.const {4 * len(CASES) + 8})))))""")


def test_every_call_with_arguments_is_abused():
    assert {name for name, _, _ in CASES} == {name for name, n in CoreCalls.table().items() if n}


def test_hostile_arguments_get_error_codes_and_others_carry_on(tiny_engine):
    from symphony_os.engine.sampling import Sample

    with Runtime(tiny_engine) as runtime:
        # A well-behaved neighbour, through the same engine, before and after.
        kv = tiny_engine.session()
        good = kv.create()
        first = tiny_engine.pred(kv, good, [1, 5, 9], want=Sample()).token
        out = []
        proc = runtime.spawn(runtime.load(abusive_module(), "abuser"), on_output=out.append)
        proc.close_input()
        assert runtime.wait(proc, 60) == 0, proc.end_reason
        data = b"".join(out)
        got = struct.unpack(f"<{len(CASES) + 2}i", data)
        for (name, args, expected), code in zip(CASES, got):
            assert code == expected, f"{name}{tuple(args)} returned {code}, expected {int(expected)} ({expected.name})"
        assert got[-2:] == (21, 8)  # WASI: EFAULT for the wild iovec, EBADF for fd 9
        kv.truncate(good, 0)
        assert tiny_engine.pred(kv, good, [1, 5, 9], want=Sample()).token == first
        kv.close_all()
    assert tiny_engine.pool.stats().used == 0


@pytest.mark.parametrize("count", [300])
def test_too_many_preds_in_flight_is_a_limit(tiny_engine, count):
    module = wat(f"""(module
      (import "symphony" "kv_create" (func $kv_create (result i32)))
      (import "symphony" "kv_fork" (func $kv_fork (param i32) (result i32)))
      (import "symphony" "pred_submit" (func $submit (param i32 i32 i32 i32 i32 i32) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 1)
      (data (i32.const 16) "\\01\\00\\00\\00")
      (func (export "_start") (local $i i32) (local $r i32) (local $kv i32)
        (local.set $kv (call $kv_create))
        (block $out (loop $next
          (local.set $r (call $submit (call $kv_fork (local.get $kv)) (i32.const 16) (i32.const 0)
                                      (i32.const 1) (i32.const 2) (i32.const 0)))
          (br_if $out (i32.lt_s (local.get $r) (i32.const 0)))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $next (i32.lt_s (local.get $i) (i32.const {count})))))
        (i32.store (i32.const 0) (local.get $i))
        (i32.store (i32.const 4) (local.get $r))
        (drop (call $send (i32.const 0) (i32.const 8)))))""")
    with Runtime(tiny_engine) as runtime:
        out = []
        proc = runtime.spawn(runtime.load(module, "flood"), on_output=out.append)
        assert runtime.wait(proc, 60) == 0, proc.end_reason
    submitted, last = struct.unpack("<2i", b"".join(out))
    assert submitted == runtime.limits.preds_in_flight and last == E.LIMIT_EXCEEDED
    # The preds no batch started left the queue with the process: their forks' pages are free.
    assert len(tiny_engine.scheduler) == 0 and tiny_engine.pool.stats().used == 0


def test_memory_that_grows_between_calls_is_seen_whole(tiny_engine):
    module = wat('''(module
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 1)
      (func (export "_start")
        (drop (call $send (i32.const 65530) (i32.const 100)))  ;; beyond one page: refused
        (drop (memory.grow (i32.const 2)))
        (i32.store (i32.const 131072) (i32.const 0x21656e6f))  ;; "one!" in the third page
        (drop (call $send (i32.const 131072) (i32.const 4)))))''')
    with Runtime(tiny_engine) as runtime:
        out = []
        proc = runtime.spawn(runtime.load(module, "grow"), on_output=out.append)
        assert runtime.wait(proc, 30) == 0, proc.end_reason
    assert out == [b"one!"]


def test_greedy_each_into_a_short_buffer_is_buffer_too_small_and_the_ticket_stays(tiny_engine):
    module = wat("""(module
      (import "symphony" "kv_create" (func $kv_create (result i32)))
      (import "symphony" "kv_close" (func $kv_close (param i32) (result i32)))
      (import "symphony" "pred_submit" (func $submit (param i32 i32 i32 i32 i32 i32) (result i32)))
      (import "symphony" "pred_wait" (func $wait (param i32 i32 i32) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 1)
      (data (i32.const 16) "\\01\\00\\00\\00\\05\\00\\00\\00\\09\\00\\00\\00")
      (func (export "_start") (local $kv i32) (local $ticket i32)
        (local.set $kv (call $kv_create))
        (local.set $ticket (call $submit (local.get $kv) (i32.const 16) (i32.const 0) (i32.const 3)
                                         (i32.const 3) (i32.const 0)))
        (i32.store (i32.const 0) (call $wait (local.get $ticket) (i32.const 8) (i32.const 2)))
        (i32.store (i32.const 4) (call $wait (local.get $ticket) (i32.const 8) (i32.const 3)))
        (drop (call $kv_close (local.get $kv)))
        (drop (call $send (i32.const 0) (i32.const 20)))))""")
    with Runtime(tiny_engine) as runtime:
        out = []
        proc = runtime.spawn(runtime.load(module, "greedy-each"), on_output=out.append)
        assert runtime.wait(proc, 60) == 0, proc.end_reason
    too_small, count, *tokens = struct.unpack("<5i", b"".join(out))
    assert (too_small, count) == (E.BUFFER_TOO_SMALL, 3)
    kv = tiny_engine.session()
    assert tokens == tiny_engine.pred(kv, kv.create(), [1, 5, 9], want=GreedyEach()).tokens
    kv.close_all()


def test_one_fd_write_takes_at_most_a_mib_whatever_its_iovecs_say(tiny_engine):
    """64 iovecs over the whole of a 2 MiB memory asked the host for 128 MiB in one call, copied
    before the output limit applied (1,024 over 256 MiB: 256 GiB). One call now takes at most
    MAX_TEXT_BYTES, a partial write that nwritten reports; the output limit ends the process at
    the next call, and it ends killed even though its code then returns on its own."""
    module = wat(f'''(module
      (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 32)
      (func (export "_start") (local $i i32)
        (loop $iovecs  ;; 64 iovecs at 0, each the whole memory
          (i32.store (i32.mul (local.get $i) (i32.const 8)) (i32.const 0))
          (i32.store (i32.add (i32.mul (local.get $i) (i32.const 8)) (i32.const 4)) (i32.const {32 * PAGE}))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $iovecs (i32.lt_u (local.get $i) (i32.const 64))))
        (i32.store (i32.const 1024) (call $fd_write (i32.const 1) (i32.const 0) (i32.const 64) (i32.const 1028)))
        (drop (call $send (i32.const 1024) (i32.const 8)))  ;; errno, nwritten
        (i32.store (i32.const 1024) (call $fd_write (i32.const 1) (i32.const 0) (i32.const 64) (i32.const 1028)))
        (drop (call $send (i32.const 1024) (i32.const 4)))))''')
    with Runtime(tiny_engine) as runtime:
        out, log = [], []
        proc = runtime.spawn(runtime.load(module, "iovecs"), on_output=out.append, on_log=log.append,
                             limits=ProcessLimits(output_bytes=2 * MAX_TEXT_BYTES))
        assert runtime.wait(proc, 60) == EXIT_KILLED
    assert proc.end_reason == "killed: output limit 2 MiB exceeded"
    assert struct.unpack("<2i", out[0]) == (0, MAX_TEXT_BYTES)
    assert len(out) == 1  # the second write went over the limit: nothing after it reaches the user
    assert sum(len(part) for part in log) == MAX_TEXT_BYTES


def sleeper(timeout_ns: int, flags: int = 0) -> bytes:
    """Sleeps on WASI poll_oneoff (one monotonic clock subscription, userdata 7), then sends
    the call's errno, nevents and the event's userdata, error and type."""
    return wat(f'''(module
      (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 1)
      (func (export "_start")
        (i64.store (i32.const 0) (i64.const 7))     ;; userdata
        (i32.store8 (i32.const 8) (i32.const 0))    ;; a clock subscription
        (i32.store (i32.const 16) (i32.const 1))    ;; monotonic
        (i64.store (i32.const 24) (i64.const {timeout_ns}))
        (i32.store16 (i32.const 40) (i32.const {flags}))
        (i32.store (i32.const 1024) (call $poll (i32.const 0) (i32.const 256) (i32.const 1) (i32.const 1028)))
        (i64.store (i32.const 1032) (i64.load (i32.const 256)))        ;; the event's userdata
        (i32.store (i32.const 1040) (i32.load16_u (i32.const 264)))    ;; its error
        (i32.store (i32.const 1044) (i32.load8_u (i32.const 266)))     ;; its type
        (drop (call $send (i32.const 1024) (i32.const 24)))))''')


def test_a_sleeping_guest_waits_without_holding_the_others(tiny_engine):
    """wasmtime's poll_oneoff slept inside the host call, on the worker thread that runs every
    guest: the others stopped with it. The sleeper now waits on a timer, suspended: another
    guest runs to its end while it sleeps (for an hour: no machine is that slow), and a short
    sleep ends with its clock event after its time."""
    with Runtime(tiny_engine, workers=1) as runtime:
        out, other = [], []
        proc = runtime.spawn(runtime.load(sleeper(3600 * 10**9), "sleeper"))
        assert wait_for_state(proc, "blocked-on-sleep")
        quick = runtime.spawn(runtime.load(ECHO, "echo"), on_output=other.append)
        quick.deliver(b"hi")
        quick.close_input()
        assert runtime.wait(quick, 60) == 0 and other == [b"hi"]
        assert proc.state.value == "blocked-on-sleep"  # the echo ran while the sleeper slept
        runtime.kill(proc.pid, "killed by test")
        assert runtime.wait(proc, 60) == EXIT_KILLED
        started = time.monotonic()
        short = runtime.spawn(runtime.load(sleeper(200_000_000), "short"), on_output=out.append)
        assert runtime.wait(short, 60) == 0, short.end_reason
        assert time.monotonic() - started >= 0.2
    assert struct.unpack("<iiqii", out[0]) == (0, 1, 7, 0, 0)  # one clock event, userdata 7


def test_a_long_tokenize_waits_off_the_worker(tiny_engine, monkeypatch):
    """A MiB of text held the worker thread that runs every guest for 0.5-1.7 s while it was
    tokenized. Now the process waits for the engine's tokenizer thread, and the others run on:
    here that thread is held until another guest has run to its end on the only worker."""
    gate, tokenize = threading.Event(), tiny_engine.tokenize

    def held(text, add_special_tokens=True):
        if len(text) > 100_000:
            assert gate.wait(60), "the other guest never ran while the text was tokenized"
        return tokenize(text, add_special_tokens)

    monkeypatch.setattr(tiny_engine, "tokenize", held)
    mib = wat('''(module
      (import "symphony" "tokenize" (func $tokenize (param i32 i32 i32 i32 i32) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 17)
      (func (export "_start")
        (memory.fill (i32.const 0) (i32.const 97) (i32.const 1048576))  ;; "aaa..."
        (i32.store (i32.const 1048576) (call $tokenize (i32.const 0) (i32.const 1048576) (i32.const 0)
                                                        (i32.const 0) (i32.const 0)))
        (drop (call $send (i32.const 1048576) (i32.const 4)))))''')
    with Runtime(tiny_engine, workers=1) as runtime:
        out, other = [], []
        proc = runtime.spawn(runtime.load(mib, "mib"), on_output=out.append)
        assert wait_for_state(proc, "blocked-on-tokenize")
        quick = runtime.spawn(runtime.load(ECHO, "echo"), on_output=other.append)
        quick.deliver(b"hi")
        quick.close_input()
        try:
            assert runtime.wait(quick, 60) == 0 and other == [b"hi"]
        finally:
            gate.set()
        assert runtime.wait(proc, 60) == 0, proc.end_reason
    assert struct.unpack("<i", out[0])[0] == len(tokenize("a" * 2**20, add_special_tokens=False))
    assert proc.cpu_time_s > 0


def wait_for_state(proc, state: str, timeout_s: float = 60.0) -> bool:
    """Wait until `proc` is in `state` (True) or has ended (False)."""
    deadline = time.monotonic() + timeout_s
    while proc.state.value != state and not proc.ended.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.state.value == state


def test_a_guest_sleeping_for_ever_ends_at_its_wall_limit_and_leaves_no_timer(tiny_engine):
    """A timeout of 2^64 ns held the runtime for good (close() waited on it)."""
    with Runtime(tiny_engine, workers=1) as runtime:
        proc = runtime.spawn(runtime.load(sleeper(-1), "sleeper"), limits=ProcessLimits(wall_time_s=0.5))
        assert runtime.wait(proc, 60) == EXIT_KILLED
        assert proc.end_reason == "killed: wall time limit 0.5s exceeded"
        assert len(runtime.timers) == 0


def test_a_sleep_until_a_time_already_past_answers_at_once(tiny_engine):
    with Runtime(tiny_engine) as runtime:
        out = []
        proc = runtime.spawn(runtime.load(sleeper(1, flags=1), "sleeper"), on_output=out.append)  # absolute: 1 ns
        assert runtime.wait(proc, 60) == 0
    assert struct.unpack("<iiqii", out[0]) == (0, 1, 7, 0, 0)


def test_c_sleep_and_nanosleep_sleep(tiny_engine, tmp_path):
    program = build_c(ROOT / "tests" / "c_guests" / "sleep.c", tmp_path / "sleep.wasm")
    with Runtime(tiny_engine) as runtime:
        out = []
        proc = runtime.spawn(runtime.load(program), on_output=out.append)
        assert runtime.wait(proc, 60) == 0, (proc.end_reason, out)
    assert 300 <= int(out[0].split()[1]) < 3000


def test_wasi_random_get_fills_up_to_a_mib_and_refuses_more(tiny_engine):
    """wasmtime's random_get took up to 64 MiB a call (0.2 s of the worker's thread, no slice
    ends it); ours fills at most MAX_TEXT_BYTES (more is EINVAL: the call has no partial fill)."""
    module = wat(f'''(module
      (import "wasi_snapshot_preview1" "random_get" (func $random (param i32 i32) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 40)
      (func (export "_start")
        (i32.store (i32.const 0) (call $random (i32.const 16) (i32.const 32)))
        (i32.store (i32.const 4) (call $random (i32.const 64) (i32.const {MAX_TEXT_BYTES + 1})))
        (i32.store (i32.const 8) (call $random (i32.const {40 * PAGE - 8}) (i32.const 16)))
        (drop (call $send (i32.const 0) (i32.const 48)))))''')
    with Runtime(tiny_engine) as runtime:
        out = []
        proc = runtime.spawn(runtime.load(module, "random"), on_output=out.append)
        assert runtime.wait(proc, 60) == 0, proc.end_reason
    assert struct.unpack("<3i", out[0][:12]) == (0, 28, 21)  # ok, EINVAL, EFAULT
    assert out[0][16:48] != bytes(32)


def test_rust_thread_sleep_sleeps(tiny_engine):
    """Rust's std panics on any error from poll_oneoff: sleep must work, not be refused."""
    with Runtime(tiny_engine) as runtime:
        out = []
        proc = runtime.spawn(runtime.load(rust_test_guest("sleep")), on_output=out.append)
        assert runtime.wait(proc, 60) == 0, proc.end_reason
    assert 300 <= int(out[0]) < 3000


def test_poll_on_descriptors_answers_at_once(tiny_engine):
    """stdout is always ready to write; any descriptor but 0-2 is EBADF in its event."""
    module = wat('''(module
      (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 1)
      (func (export "_start")
        (i64.store (i32.const 0) (i64.const 1)) (i32.store8 (i32.const 8) (i32.const 2)) (i32.store (i32.const 16) (i32.const 1))
        (i64.store (i32.const 48) (i64.const 2)) (i32.store8 (i32.const 56) (i32.const 1)) (i32.store (i32.const 64) (i32.const 5))
        (i32.store (i32.const 1024) (call $poll (i32.const 0) (i32.const 256) (i32.const 2) (i32.const 1028)))
        (drop (call $send (i32.const 1024) (i32.const 8)))
        (drop (call $send (i32.const 256) (i32.const 64)))))''')
    with Runtime(tiny_engine) as runtime:
        out = []
        proc = runtime.spawn(runtime.load(module, "poll"), on_output=out.append)
        assert runtime.wait(proc, 60) == 0, proc.end_reason
    assert struct.unpack("<ii", out[0]) == (0, 2)
    events = [struct.unpack_from("<QHB5xQH6x", out[1], 32 * i) for i in range(2)]
    assert events == [(1, 0, 2, MAX_TEXT_BYTES, 0), (2, 8, 1, 0, 0)]


def test_a_sleep_that_waits_at_all_waits_a_millisecond(tiny_engine):
    """Each wait costs the host work no guest is charged for (the timer thread, a wake, a
    round): a loop of 1 ns sleeps took twice the CPU it paid for."""
    module = wat('''(module
      (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
      (memory (export "memory") 1)
      (func (export "_start") (local $i i32)
        (i32.store (i32.const 16) (i32.const 1))  ;; a relative monotonic clock subscription
        (i64.store (i32.const 24) (i64.const 1))  ;; of 1 ns
        (loop $naps
          (drop (call $poll (i32.const 0) (i32.const 256) (i32.const 1) (i32.const 512)))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $naps (i32.lt_u (local.get $i) (i32.const 50))))))''')
    with Runtime(tiny_engine) as runtime:
        started = time.monotonic()
        proc = runtime.spawn(runtime.load(module, "naps"))
        assert runtime.wait(proc, 60) == 0, proc.end_reason
        assert time.monotonic() - started >= 50 * MIN_SLEEP_S
