"""The hostile-guest corpus: small WAT programs that each attack the host one way, and what the
host must answer. tests/test_hostile.py runs every kind next to well-behaved neighbours."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable

from guests import wat
from test_hostcall_abuse import CASES as ABUSE_CASES
from test_hostcall_abuse import abusive_module

from symphony_os.errors import ErrorCode as E
from symphony_os.lip.core_abi import CoreCalls

RESULTS = 60000  # where a guest stores the i32s it reports (inside its first page)
IDS = 1024  # 16 token ids (1, 2, ... 16)
TEXT = 2048  # a path or text, per kind


def imports() -> str:
    calls = "\n".join(
        f'(import "symphony" "{name}" (func ${name} (param {" i32" * n}) (result i32)))' if n else
        f'(import "symphony" "{name}" (func ${name} (result i32)))' for name, n in CoreCalls.table().items())
    return calls + '\n(import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))'


def report(*exprs: str) -> str:
    """Store each i32 expression in the results area, then send them all."""
    stores = "".join(f"(i32.store (i32.const {RESULTS + 4 * i}) {e})" for i, e in enumerate(exprs))
    return stores + f"(drop (call $send (i32.const {RESULTS}) (i32.const {4 * len(exprs)})))"


def guest(body: str, memory: str = '(memory (export "memory") 1)', data: str = "", extra: str = "") -> bytes:
    ids = "".join(f"\\{i:02x}\\00\\00\\00" for i in range(1, 17))
    return wat(f"""(module {imports()} {memory}
      (data (i32.const {IDS}) "{ids}") {data} {extra}
      (func (export "_start") (local $i i32) (local $r i32) (local $h i32) {body}))""")


def loop_until_error(call: str) -> str:
    """Repeat `call` (an i32 expression) until it returns < 0, counting successes in $i;
    the error lands in $r."""
    return f"""(block $b (loop $l (local.set $r {call})
        (br_if $b (i32.lt_s (local.get $r) (i32.const 0)))
        (local.set $i (i32.add (local.get $i) (i32.const 1))) (br $l)))"""


def pred(handle: str, n: int = 16) -> str:
    """Submit n tokens (sampled) and wait: the token, or an error."""
    return (f"(call $pred_wait (call $pred_submit {handle} (i32.const {IDS}) (i32.const 0) (i32.const {n}) "
            "(i32.const 2) (i32.const 0)) (i32.const 0) (i32.const 0))")


# Prefill 16 tokens, then merge the file with itself until refused (18 times at most): reports
# the merges that succeeded, the error, and the length of the last file made.
SELF_MERGE = ("(local.set $h (call $kv_create)) (drop " + pred("(local.get $h)") + ")" + loop_until_error(
    "(call $kv_merge (local.get $h) (local.get $h))").replace(
    "(br $l)", "(local.set $h (local.get $r)) (br_if $l (i32.lt_s (local.get $i) (i32.const 18)))")
    + report("(local.get $i)", "(local.get $r)", "(call $kv_len (local.get $h))"))


def kv_open_probe(name: bytes) -> bytes:
    escaped = "".join(f"\\{b:02x}" for b in name)
    return guest(report(f"(call $kv_open (i32.const {TEXT}) (i32.const {len(name)}) (i32.const 1))"),
                 memory='(memory (export "memory") 1)', data=f'(data (i32.const {TEXT}) "{escaped}")')


def slow_to_compile(locals_: int = 16000) -> bytes:
    """A small module (160 KB) that takes cranelift seconds (2.8 s here, 0.3 s for 4000 locals):
    locals carried around a loop (register allocation is superlinear in them)."""
    body = "".join(f"(local.set {i} (i32.add (local.get {i}) (local.get {(i + 1) % locals_})))" for i in range(locals_))
    return wat(f"""(module (memory (export "memory") 1)
      (func $work (param i32) (local {" i32" * locals_}) (loop $l {body} (br_if $l (local.get 0))))
      (func (export "_start")))""")


def overflowing_sampler(temperature: float, bias: float) -> bytes:
    """Eight sampled preds of one token under a sym_sampling that overflows a naive sampler
    (logits / temperature = inf, and inf - inf is NaN; that once failed every pred in the
    batch), with tokens 5 and 6 biased by `bias`, then eight greedy ones on a second file. Sends
    how many sampled preds gave a token, the last sampled token and the last greedy one."""
    record = struct.pack("<ffiiQiiiii4x", temperature, 1.0, 0, 0, 0, 0, 0, TEXT + 64, TEXT + 72, 2 if bias else 0)
    data = record + bytes(64 - len(record)) + struct.pack("<2i2f", 5, 6, bias, bias)
    escaped = "".join(f"\\{b:02x}" for b in data)

    def eight_preds(sampling: int, then: str) -> str:  # $r: the last result; `then` runs after each success
        return f"""(local.set $h (call $kv_create)) (i32.store (i32.const 96) (i32.const 0))
            (loop $l (local.set $r (call $pred (local.get $h) (i32.const {IDS}) (i32.const 0) (i32.const 1)
                                         (i32.const 2) (i32.const {sampling}) (i32.const 0) (i32.const 0)))
              (if (i32.ge_s (local.get $r) (i32.const 0)) (then {then}))
              (i32.store (i32.const 96) (i32.add (i32.load (i32.const 96)) (i32.const 1)))
              (br_if $l (i32.lt_s (i32.load (i32.const 96)) (i32.const 8))))"""

    return guest(eight_preds(TEXT, "(local.set $i (i32.add (local.get $i) (i32.const 1)))")
                 + "(i32.store (i32.const 100) (local.get $r))" + eight_preds(0, "")
                 + report("(local.get $i)", "(i32.load (i32.const 100))", "(local.get $r)"),
                 data=f'(data (i32.const {TEXT}) "{escaped}")')


def codes(*expected: int) -> Callable[[list[int]], bool]:
    return lambda got: got == [int(c) for c in expected]


@dataclass
class Hostile:
    """One kind of attack. `module` builds the bytes; the host must refuse to load them
    (`refused`: a regex of the ProgramError) or run them to `exit_code` with an end reason
    matching `reason`, the i32s the guest sends passing `sends`. `limits` override the
    corpus's tight per-process limits; `tenant` runs it as another tenant."""

    module: Callable[[], bytes]
    refused: str | None = None
    exit_code: int | None = None
    reason: str = ""
    sends: Callable[[list[int]], bool] | None = None
    limits: dict = field(default_factory=dict)
    tenant: str = "mallory"
    compile_time_s: float | None = None


EXIT_TRAPPED, EXIT_KILLED = 134, 137
SPIN = "(loop $spin (br $spin))"

CORPUS: dict[str, Hostile] = {
    # ---- CPU, memory, stack, time ----
    "infinite loop": Hostile(lambda: guest(SPIN), exit_code=EXIT_KILLED, reason=r"^killed: cpu time limit 1s exceeded$"),
    "memory bomb": Hostile(lambda: guest("""(block $b (loop $l
        (br_if $b (i32.eq (memory.grow (i32.const 16)) (i32.const -1))) (br $l))) unreachable"""),
        exit_code=EXIT_TRAPPED, reason=r"(?s)^trapped: .*unreachable.*\(memory near its limit of 16 MiB\)$"),
    "stack bomb": Hostile(lambda: guest("(drop (call $down (i32.const 0)))", extra="""(func $down (param i32) (result i32)
        (i32.add (call $down (i32.add (local.get 0) (i32.const 1))) (i32.const 1)))"""),
        exit_code=EXIT_KILLED, reason=r"^killed: wasm stack limit 1 MiB exceeded$"),
    "tokenizer bomb": Hostile(lambda: guest(f"""(loop $l (drop (call $tokenize (i32.const 0) (i32.const {1 << 20})
        (i32.const 0) (i32.const 0) (i32.const 0))) (br $l))""", memory='(memory (export "memory") 17)'),
        exit_code=EXIT_KILLED, reason=r"^killed: cpu time limit 1s exceeded$"),
    "recv never answered": Hostile(lambda: guest("(drop (call $recv (i32.const 0) (i32.const 64)))"),
                                   exit_code=EXIT_KILLED, reason=r"^killed: wall time limit 0.5s exceeded$",
                                   limits=dict(wall_time_s=0.5)),
    "start function that blocks": Hostile(lambda: guest("", extra="""(start $s)
        (func $s (drop (call $recv (i32.const 0) (i32.const 64))))"""),
        exit_code=EXIT_KILLED, reason=r"^killed: wall time limit 0.5s exceeded$", limits=dict(wall_time_s=0.5)),
    "start function that traps": Hostile(lambda: guest("", extra="(start $s) (func $s unreachable)"),
                                         exit_code=EXIT_TRAPPED, reason=r"(?s)^failed to start: .*unreachable"),
    # ---- declared sizes ----
    "huge declared memory": Hostile(lambda: guest("", memory='(memory (export "memory") 60000)'),
                                    exit_code=EXIT_TRAPPED, reason=r"(?s)^failed to start: .*memory"),
    "huge declared table": Hostile(lambda: guest("", extra="(table 10000000 funcref)"),
                                   exit_code=EXIT_TRAPPED, reason=r"(?s)^failed to start: .*table"),
    "too many tables": Hostile(lambda: guest("", extra="(table 1 funcref)" * 100),
                               exit_code=EXIT_TRAPPED, reason=r"(?s)^failed to start: .*table"),
    "too many memories": Hostile(lambda: guest("", extra="(memory 1)" * 20),
                                 exit_code=EXIT_TRAPPED, reason=r"(?s)^failed to start: .*memor"),
    # ---- output ----
    "output flood": Hostile(lambda: guest("(loop $l (drop (call $send (i32.const 0) (i32.const 65536))) (br $l))"),
                            exit_code=EXIT_KILLED, reason=r"^killed: output limit 1 MiB exceeded$"),
    "log flood": Hostile(lambda: guest("""(i32.store (i32.const 16) (i32.const 0)) (i32.store (i32.const 20) (i32.const 65536))
        (loop $l (drop (call $fd_write (i32.const 1) (i32.const 16) (i32.const 1) (i32.const 8))) (br $l))"""),
        exit_code=EXIT_KILLED, reason=r"^killed: output limit 1 MiB exceeded$"),
    # ---- host-call volume ----
    "host-call flood": Hostile(lambda: guest(f"""(loop $l (if (i32.eq (call $kv_len (i32.const 99)) (i32.const {E.LIMIT_EXCEEDED}))
        (then (local.set $r (i32.add (local.get $r) (i32.const 1)))))
        (local.set $i (i32.add (local.get $i) (i32.const 1))) (br_if $l (i32.lt_s (local.get $i) (i32.const 5000))))
        (if (i32.eqz (local.get $r)) (then unreachable))"""),  # its reports would be refused too: it exits 0
        exit_code=0, limits=dict(hostcalls_per_s=1000)),
    "preds in flight flood": Hostile(lambda: guest(
        "(local.set $h (call $kv_create))" + loop_until_error(
            f"(call $pred_submit (call $kv_fork (local.get $h)) (i32.const {IDS}) (i32.const 0) (i32.const 1) "
            "(i32.const 2) (i32.const 0))") + report("(local.get $i)", "(local.get $r)")),
        exit_code=0, sends=codes(8, E.LIMIT_EXCEEDED), limits=dict(preds_in_flight=8, kv_pages=None)),
    # ---- KV resources ----
    "fork bomb": Hostile(lambda: guest("(local.set $h (call $kv_create))" + loop_until_error("(call $kv_fork (local.get $h))")
                                       + report("(local.get $i)", "(local.get $r)")),
                         exit_code=0, sends=codes(63, E.LIMIT_EXCEEDED)),
    "KV pages per process": Hostile(lambda: guest("(local.set $h (call $kv_create))" + loop_until_error(
        f"(call $pred_submit (local.get $h) (i32.const {IDS}) (i32.const 0) (i32.const 16) (i32.const 2) (i32.const 0))")
        .replace("(br $l)", "(drop (call $pred_wait (local.get $r) (i32.const 0) (i32.const 0))) (br $l)")
        + report("(local.get $i)", "(local.get $r)")), exit_code=0, sends=codes(8, E.LIMIT_EXCEEDED)),
    # Preds queued and not yet run count too (before, eight of 128 tokens each on one file went
    # through a limit of 8 pages: 64 pages).
    "KV pages per process, preds queued before waiting": Hostile(lambda: guest(
        "(local.set $h (call $kv_create))" + loop_until_error(
            f"(call $pred_submit (local.get $h) (i32.const {IDS}) (i32.const 0) (i32.const 16) (i32.const 2) (i32.const 0))")
        + report("(local.get $i)", "(local.get $r)")), exit_code=0, sends=codes(8, E.LIMIT_EXCEEDED)),
    "KV pages per tenant": Hostile(lambda: guest("(local.set $h (call $kv_create))" + loop_until_error(pred("(local.get $h)"))
                                                 + report("(local.get $i)", "(local.get $r)")),
                                   exit_code=0, sends=codes(2, E.LIMIT_EXCEEDED), tenant="quota-tenant",
                                   limits=dict(kv_pages=None)),
    # A file merged with itself holds its pages twice: 18 merges made 4,194,304 tokens of one
    # page (quotas counted distinct pages), and every batch it joined attended over all of them.
    "self-merge under a page quota": Hostile(lambda: guest(SELF_MERGE), exit_code=0,
                                             sends=codes(1, E.LIMIT_EXCEEDED, 32), tenant="quota-tenant",
                                             limits=dict(kv_pages=None)),
    "self-merge past the model's context": Hostile(lambda: guest(SELF_MERGE), exit_code=0,
                                                   sends=codes(5, E.LIMIT_EXCEEDED, 512), limits=dict(kv_pages=None)),
    "traps holding files and preds": Hostile(lambda: guest(f"""(local.set $h (call $kv_create))
        (drop {pred("(local.get $h)")})
        (drop (call $pred_submit (call $kv_fork (local.get $h)) (i32.const {IDS}) (i32.const 0) (i32.const 16)
                                 (i32.const 0) (i32.const 0)))
        (drop (call $kv_extract (local.get $h) (i32.const 3) (i32.const 9))) unreachable"""),
        exit_code=EXIT_TRAPPED, reason=r"(?s)^trapped: .*unreachable"),
    "use after close": Hostile(lambda: guest("(local.set $h (call $kv_create)) (drop (call $kv_close (local.get $h)))" + report(
        "(call $kv_len (local.get $h))", pred("(local.get $h)"), "(call $kv_fork (local.get $h))",
        "(call $kv_truncate (local.get $h) (i32.const 0))")),
        exit_code=0, sends=codes(E.BAD_HANDLE, E.BAD_HANDLE, E.BAD_HANDLE, E.BAD_HANDLE)),
    "double close": Hostile(lambda: guest("(local.set $h (call $kv_create))" + report(
        "(call $kv_close (local.get $h))", "(call $kv_close (local.get $h))")), exit_code=0, sends=codes(0, E.BAD_HANDLE)),
    "handle guessing": Hostile(lambda: guest("""(local.set $h (i32.const -100)) (loop $l
        (if (i32.ge_s (call $kv_len (local.get $h)) (i32.const 0)) (then (local.set $i (i32.add (local.get $i) (i32.const 1)))))
        (if (i32.ne (call $pred_wait (local.get $h) (i32.const 0) (i32.const 0)) (i32.const -2))
          (then (local.set $i (i32.add (local.get $i) (i32.const 1)))))
        (local.set $h (i32.add (local.get $h) (i32.const 1))) (br_if $l (i32.lt_s (local.get $h) (i32.const 3000))))"""
        + report("(local.get $i)")), exit_code=0, sends=codes(0)),
    "KV name with ..": Hostile(lambda: kv_open_probe(b"a/../../b"), exit_code=0, sends=codes(E.INVALID_ARGUMENT)),
    "KV name with /": Hostile(lambda: kv_open_probe(b"/etc//passwd"), exit_code=0, sends=codes(E.INVALID_ARGUMENT)),
    "KV name with NUL": Hostile(lambda: kv_open_probe(b"a\0b"), exit_code=0, sends=codes(E.INVALID_ARGUMENT)),
    "KV name of 10 KB": Hostile(lambda: kv_open_probe(b"a" * 10240), exit_code=0, sends=codes(E.INVALID_ARGUMENT)),
    "KV name not UTF-8": Hostile(lambda: kv_open_probe(b"\xff\xfe"), exit_code=0, sends=codes(E.BAD_POINTER)),
    "another tenant's file": Hostile(lambda: guest(report(*[
        f"(call ${call} (i32.const {TEXT + offset}) (i32.const {length}){flags})" for call, offset, length, flags in [
            ("kv_open", 0, 11, " (i32.const 4)"), ("kv_open", 0, 11, " (i32.const 1)"), ("kv_remove", 0, 11, ""),
            ("kv_open", 5, 6, " (i32.const 0)"), ("kv_open", 16, 14, " (i32.const 4)")]]),
        data=f'(data (i32.const {TEXT}) "@bob/secret")(data (i32.const {TEXT + 16}) "@bob/../secret")'),
        exit_code=0, sends=codes(E.FILE_NOT_FOUND, E.FILE_NOT_FOUND, E.PERMISSION_DENIED, E.FILE_NOT_FOUND,
                                 E.INVALID_ARGUMENT)),
    "wild pointers on every call": Hostile(abusive_module, exit_code=0,
                                           sends=lambda got: got[:len(ABUSE_CASES)] == [int(c[2]) for c in ABUSE_CASES]),
    "sampling at a vanishing temperature": Hostile(lambda: overflowing_sampler(1e-45, 0.0), exit_code=0,
                                                   sends=lambda got: got[0] == 8 and got[1] == got[2]),
    "logit bias at the float limit": Hostile(lambda: overflowing_sampler(1e-5, 3.4e38), exit_code=0,
                                             sends=lambda got: got[0] == 8 and got[1] in (5, 6)),
    # 100: the corpus host's named-file quota for mallory (test_hostile.host); it removes them all.
    "named-file flood": Hostile(lambda: guest(f"""(block $b (loop $l
          (call $name (local.get $i))
          (local.set $r (call $kv_open (i32.const {TEXT}) (i32.const 4) (i32.const 1)))
          (br_if $b (i32.lt_s (local.get $r) (i32.const 0)))
          (drop (call $kv_close (local.get $r)))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $l (i32.lt_s (local.get $i) (i32.const 4096)))))
        (loop $rm (if (i32.lt_s (local.get $h) (local.get $i)) (then
          (call $name (local.get $h)) (drop (call $kv_remove (i32.const {TEXT}) (i32.const 4)))
          (local.set $h (i32.add (local.get $h) (i32.const 1))) (br $rm))))""" + report("(local.get $i)", "(local.get $r)"),
        extra=f"""(func $name (param $n i32) (i32.store8 (i32.const {TEXT}) (i32.const 110))
          (i32.store8 (i32.const {TEXT + 1}) (i32.add (i32.const 97) (i32.and (local.get $n) (i32.const 15))))
          (i32.store8 (i32.const {TEXT + 2}) (i32.add (i32.const 97) (i32.and (i32.shr_u (local.get $n) (i32.const 4)) (i32.const 15))))
          (i32.store8 (i32.const {TEXT + 3}) (i32.add (i32.const 97) (i32.shr_u (local.get $n) (i32.const 8)))))"""),
        exit_code=0, sends=codes(100, E.LIMIT_EXCEEDED)),
    "positions out of order": Hostile(lambda: guest("""(local.set $h (call $kv_create))
        (i32.store (i32.const 64) (i32.const 5)) (i32.store (i32.const 68) (i32.const 3))
        (i32.store (i32.const 72) (i32.const -4))""" + report(
        f"(call $pred_wait (call $pred_submit (local.get $h) (i32.const {IDS}) (i32.const 64) (i32.const 2) (i32.const 2) "
        "(i32.const 0)) (i32.const 0) (i32.const 0))",
        f"(call $pred_wait (call $pred_submit (local.get $h) (i32.const {IDS}) (i32.const 72) (i32.const 1) (i32.const 2) "
        "(i32.const 0)) (i32.const 0) (i32.const 0))")),
        exit_code=0, sends=codes(E.POSITION_ERROR, E.POSITION_ERROR)),
    # ---- refused before running ----
    "unknown import": Hostile(lambda: wat('(module (import "env" "system" (func)) (memory (export "memory") 1) '
                                          '(func (export "_start")))'), refused="unknown import env.system"),
    "invalid bytes": Hostile(lambda: b"\x00asm\x01\x00\x00\x00\x01\xff\xff\xff\xff\x0f", refused="invalid WebAssembly"),
    # Found by the module fuzzer (make fuzz): it used to kill a worker thread.
    "_start with parameters": Hostile(lambda: wat('(module (memory (export "memory") 1) '
                                                  '(func (export "_start") (param i32 i32)))'),
                                      refused="_start must take no parameters"),
    "oversized module": Hostile(lambda: b"\x00asm\x01\x00\x00\x00" + bytes(64 * 2**20), refused="the limit is"),
    "slow to compile": Hostile(slow_to_compile, refused="compiling the module took over the limit of 0.3 s",
                               compile_time_s=0.3),
}


def sent_i32s(output: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(output) // 4}i", output[: len(output) // 4 * 4]))
