"""Fuzzing the host, shared by tests/test_fuzz.py (a short seeded budget in CI) and
tests/fuzz.py (`make fuzz SECONDS=N`).

(a) Host calls: `driver_module()` is a guest that `recv`s one message and decodes it into a
sequence of host calls with arbitrary arguments: records of 29 bytes, a call number (mod the
number of calls) and seven little-endian i32 arguments (each call takes the first ones it
needs). Hypothesis writes the messages; after each one `FuzzHost.check` verifies the host's
invariants: the process ended by exit or by a limit (never a host error), no host call failed
with INTERNAL, every KV page's refcount equals the files holding it, the free list holds
exactly the unreferenced pages, the process left no handle or ticket, and another tenant's file
is untouched.

(b) Module bytes: `module_bytes()` mutates valid modules (flips, cuts, splices) and makes up
headers; `FuzzHost.load` feeds them to the upload path (ProgramStore.add, which calls
program.load_program): each must compile or be refused with ProgramError, and one that compiles
runs under tight limits.
"""
from __future__ import annotations

import logging
import struct
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

from guests import lip, wat
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from symphony_os.engine.loop import Engine
from symphony_os.kv.kvfs import quota_account
from symphony_os.lip.core_abi import CoreCalls
from symphony_os.lip.limits import ProcessLimits
from symphony_os.lip.runtime import Runtime
from symphony_os.model.random_model import build_random_model
from symphony_os.server.program_store import ProgramStore
from symphony_os.wasm.program import ProgramError

CALLS = [*CoreCalls.table().items(), ("fd_write", 4), ("memory.grow", 1)]
ARGS = max(arity for _, arity in CALLS)  # every call in the driver takes this many (extra ones unused)
RECORD = struct.Struct(f"<B{ARGS}i")
INPUT_AT, INPUT_CAP, MEMORY_PAGES = 3 * 65536, 65536, 4
IDS, TEXT, SAMPLING = 1024, 2048, 4096
EXTREME_SAMPLING = SAMPLING + 48  # the second sampling record
EXTREMES = SAMPLING + 96  # four float bias values after the two sampling records
MAX_CALLS = 40
SUMMARY: list[str] = []  # lines for the end of the pytest run (conftest.py prints them)
FUZZ_LIMITS = ProcessLimits(cpu_time_s=2.0, wall_time_s=10.0, output_bytes=1 << 20, kv_handles=64, kv_pages=64,
                            memory_bytes=8 * 2**20)
TINY_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)


def driver_module() -> bytes:
    """The host-call fuzz driver (see the module docstring)."""
    imports = "\n".join(
        f'(import "symphony" "{name}" (func ${name} (param{" i32" * n}) (result i32)))'
        for name, n in CoreCalls.table().items())
    wrappers = []
    for index, (name, arity) in enumerate(CALLS):
        args = " ".join(f"(local.get {i})" for i in range(arity))
        call = "(memory.grow (i32.and (local.get 0) (i32.const 3)))" if name == "memory.grow" else f"(call ${name} {args})"
        wrappers.append(f"(func $w{index} (type $any) {call})")
    # Two sym_sampling records (48 bytes each): a plain one, and one at the edges of what is valid
    # (a vanishing temperature and top_p, the largest seed, biases at the float limit).
    sampling = struct.pack("<ffiiQiiiii4x", 0.8, 0.9, 5, 1, 7, IDS, 4, IDS, IDS, 2)
    sampling += struct.pack("<ffiiQiiiii4x", 1e-45, 1e-45, 1, 1, 2**64 - 1, IDS, 16, IDS, EXTREMES, 4)
    sampling += struct.pack("<4f", 3.4e38, -3.4e38, 3.4e38, 1e-45)
    ids = "".join(f"\\{i:02x}\\00\\00\\00" for i in range(1, 17))
    sampling = "".join(f"\\{b:02x}" for b in sampling)
    return wat(f"""(module
      {imports}
      (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
      (type $any (func (param{" i32" * ARGS}) (result i32)))
      (memory (export "memory") {MEMORY_PAGES})
      (data (i32.const {IDS}) "{ids}")
      (data (i32.const {TEXT}) "abc/def@bob/secret")
      (data (i32.const {SAMPLING}) "{sampling}")
      (table {len(CALLS)} funcref) (elem (i32.const 0) {" ".join(f"$w{i}" for i in range(len(CALLS)))})
      {" ".join(wrappers)}
      (func (export "_start") (local $p i32) (local $end i32)
        (local.set $end (call $recv (i32.const {INPUT_AT}) (i32.const {INPUT_CAP})))
        (br_if 0 (i32.lt_s (local.get $end) (i32.const 0)))
        (local.set $p (i32.const {INPUT_AT}))
        (local.set $end (i32.add (local.get $end) (i32.const {INPUT_AT})))
        (block $done (loop $next
          (br_if $done (i32.gt_u (i32.add (local.get $p) (i32.const {RECORD.size})) (local.get $end)))
          (drop (call_indirect (type $any)
            {" ".join(f"(i32.load offset={1 + 4 * i} (local.get $p))" for i in range(ARGS))}
            (i32.rem_u (i32.load8_u (local.get $p)) (i32.const {len(CALLS)}))))
          (local.set $p (i32.add (local.get $p) (i32.const {RECORD.size})))
          (br $next)))))""")


# Arguments: mostly plausible handles, tickets, lengths and pointers into the driver's data,
# with edges (negative, huge, just past memory) and anything at all.
_INTERESTING = [0, 1, 2, 3, 4, 5, 6, 8, 16, 17, 64, 255, 1024, -1, -2, -12, 2**31 - 1, -2**31, IDS, TEXT, TEXT + 4,
                TEXT + 7, SAMPLING, EXTREME_SAMPLING, 65535, 65536, MEMORY_PAGES * 65536 - 4, MEMORY_PAGES * 65536, 1 << 20]
argument = st.one_of(st.sampled_from(_INTERESTING), st.integers(0, 20), st.integers(-2**31, 2**31 - 1),
                     st.integers(0, MEMORY_PAGES * 65536))
# Plausible arguments by parameter name (CoreCalls' own signatures), so that sequences get past
# the argument checks into KVFS and the engine: handles and tickets are small numbers.
_small = st.one_of(st.sampled_from([1, 1, 1, 2, 2, 3]), st.integers(-1, 8))
_ids = st.one_of(st.sampled_from([IDS, IDS + 8, IDS + 60]), argument)  # 16 valid token ids, then zeros
_pointer = st.one_of(st.sampled_from([IDS, IDS + 8, TEXT, TEXT + 4, TEXT + 7, SAMPLING, 0, 8192]), argument)
_ROLES = {"kv": _small, "first": _small, "second": _small, "ticket": _small, "fd": st.integers(0, 3),
          "flags": st.integers(0, 8), "kind": st.integers(0, 4),
          "arg": st.sampled_from([0, 1, 3, SAMPLING, EXTREME_SAMPLING]),
          "start": st.integers(0, 20), "end": st.integers(0, 20), "length": st.integers(0, 20),
          "n": st.integers(1, 16), "cap": st.sampled_from([0, 4, 16, 256, 4096]), "keep_for_ms": st.integers(-1, 5),
          "priority": st.integers(-2, 2), "ids_ptr": _ids, "pos_ptr": st.sampled_from([0, 0, 0, IDS, IDS + 4, TEXT])}


def _role(parameter: str):
    if parameter in _ROLES:
        return _ROLES[parameter]
    if parameter.endswith("_ptr"):
        return _pointer
    if parameter.endswith("_len") or parameter.endswith("len"):
        return st.integers(0, 20)
    return argument


def _plausible(index: int):
    name, arity = CALLS[index]
    method = getattr(CoreCalls, name, None)
    names = method.__code__.co_varnames[2:2 + arity] if method is not None else ("n",) * arity
    return st.tuples(st.just(index), st.tuples(*[_role(p) for p in names], *[st.just(0)] * (ARGS - arity)).map(list))


_plausible_call = st.integers(0, len(CALLS) - 1).flatmap(_plausible)
host_call = st.one_of(st.tuples(st.integers(0, 255), st.lists(argument, min_size=ARGS, max_size=ARGS)),
                      _plausible_call, _plausible_call, _plausible_call)  # three in four plausible
call_sequence = st.lists(host_call, max_size=MAX_CALLS)


def _call(name: str, *args: int) -> tuple[int, list[int]]:
    return [n for n, _ in CALLS].index(name), [*args, *[0] * (ARGS - len(args))]


# Call sequences that once broke an invariant: the CI budget (test_fuzz.py) and `make fuzz` run
# them before the generated ones.
KNOWN_INPUTS = [
    # A sampled pred at the edges of the sampling record (a vanishing temperature, biases at
    # the float limit): the host's sampler raised on NaN, and the whole batch failed.
    [_call("kv_create"), _call("pred", 1, IDS, 0, 1, 2, EXTREME_SAMPLING, 0, 0),
     _call("pred_submit", 1, IDS, 0, 3, 2, EXTREME_SAMPLING), _call("pred_wait", 1, 0, 0)],
]


def fuzz_settings(max_examples: int, derandomize: bool = True) -> settings:
    """No deadline (a pred waits for a batch), no example database, no health checks (inputs are
    slow by design); derandomized: the CI budget runs the same inputs every time."""
    return settings(max_examples=max_examples, derandomize=derandomize, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def encode(calls) -> bytes:
    return b"".join(RECORD.pack(number, *args) for number, args in calls)


_VALID = {}


def valid_modules() -> list[bytes]:
    """Seeds for module mutation: a real C program, the fuzz driver, and small WAT modules."""
    if not _VALID:
        _VALID["hello"] = Path(lip("hello")).read_bytes()
        _VALID["driver"] = driver_module()
        _VALID["tiny"] = wat('(module (import "symphony" "send" (func $s (param i32 i32) (result i32))) '
                             '(memory (export "memory") 1) (data (i32.const 0) "hi") '
                             '(func (export "_start") (drop (call $s (i32.const 0) (i32.const 2)))))')
    return list(_VALID.values())


@st.composite
def module_bytes(draw) -> bytes:
    """Mutants of valid modules, and made-up bytes behind a real or broken header."""
    if draw(st.integers(0, 4)) == 0:
        header = draw(st.sampled_from([b"\x00asm\x01\x00\x00\x00", b"\x00asm\x0d\x00\x01\x00", b"\x00asm", b""]))
        return header + draw(st.binary(max_size=256))
    data = bytearray(draw(st.sampled_from(valid_modules())))
    for _ in range(draw(st.integers(1, 8))):
        kind, at = draw(st.integers(0, 3)), draw(st.integers(8, len(data) - 1))
        if kind == 0:  # flip a byte
            data[at] = draw(st.integers(0, 255))
        elif kind == 1:  # cut the tail
            del data[at:]
        elif kind == 2:  # insert bytes
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:  # an LEB128 size or count made huge
            data[at:at + 1] = b"\xff\xff\xff\xff\x0f"
        if len(data) <= 9:
            break
    return bytes(data)


INTERNAL_LOGGERS = ("symphony.syscalls", "symphony.component", "symphony.process")


class InternalErrors(logging.Handler):
    """Counts host-call failures that became INTERNAL (logged by syscalls.py, component.py, and
    process.py when finishing a blocking call: a pred whose batch failed)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class FuzzHost:
    """An engine on a tiny random Llama, a runtime, the compiled driver, and the checks."""

    def __init__(self, model_dir: Path | None = None):
        self._tmp = None
        if model_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="symphony-fuzz-")
            model_dir = build_random_model(Path(self._tmp.name), "llama", seed=0, init_std=0.2, **TINY_LLAMA)
        self.engine = Engine.from_path(model_dir, device="cpu", page_size=4, num_pages=256)
        self.runtime = Runtime(self.engine).start()
        self._programs = tempfile.TemporaryDirectory(prefix="symphony-fuzz-programs-")
        self.store = ProgramStore(self.runtime.wasm_engine, Path(self._programs.name))
        self.driver = self.runtime.load(driver_module(), "fuzz-driver")
        bob = self.engine.session("bob")
        secret = bob.open("secret", 1)
        self.engine.pred(bob, secret, [1, 2, 3, 4, 5, 6])
        bob.close(secret)
        self.errors = InternalErrors()
        for name in INTERNAL_LOGGERS:
            logging.getLogger(name).addHandler(self.errors)
        self.inputs = 0
        self.baseline = self.footprint()

    def close(self) -> None:
        for name in INTERNAL_LOGGERS:
            logging.getLogger(name).removeHandler(self.errors)
        self.runtime.close()
        self.engine.stop()
        self._programs.cleanup()
        if self._tmp is not None:
            self._tmp.cleanup()

    def footprint(self):
        stats = self.engine.pool.stats()
        return stats.used, stats.swapped, self.engine.kvfs.file_count

    def run_calls(self, message: bytes) -> None:
        """Run the driver on one message, then check every invariant."""
        self.inputs += 1
        process = self.runtime.spawn(self.driver, tenant="fuzz", limits=FUZZ_LIMITS)
        process.deliver(message)
        process.close_input()
        code = self.runtime.wait(process, 60)
        assert code is not None, "the driver did not end within 60 s"
        assert code == 0 or process.end_reason.startswith("killed: "), process.end_reason
        assert process.kv.open_handles == 0 and not process.syscalls.tickets
        self.settle()

    def load(self, data: bytes) -> None:
        """Feed bytes to the upload path; run what compiles under tight limits."""
        self.inputs += 1
        try:
            stored = self.store.add("fuzz", data, "mutant", None)
        except ProgramError as error:
            assert "\n" not in str(error), str(error)
            return
        program = self.store.program("fuzz", stored.sha256)
        self.store.remove("fuzz", stored.sha256)
        if program.is_component:
            return
        limits = replace(FUZZ_LIMITS, cpu_time_s=0.2, wall_time_s=2.0)
        process = self.runtime.spawn(program, ["Once", "3"], tenant="fuzz", limits=limits)
        process.close_input()
        assert self.runtime.wait(process, 60) is not None, "a mutant did not end within 60 s"
        assert process.kv.open_handles == 0 and not process.syscalls.tickets
        self.settle()

    def settle(self) -> None:
        """Wait for preds left in flight, remove the fuzz tenant's named files, check the pool."""
        self.engine_idle()
        fuzz = self.engine.kvfs.session("fuzz")
        for stat in fuzz.list():
            fuzz.remove(stat.name)
        assert not self.errors.records, [r.getMessage() for r in self.errors.records]
        self.check_pool()
        assert self.footprint() == self.baseline, (self.footprint(), self.baseline)
        secret = self.engine.kvfs.session("bob").stat("secret")
        assert secret.length == 6 and secret.open_handles == 0

    def engine_idle(self) -> None:
        import time
        deadline = time.monotonic() + 30
        while len(self.engine.scheduler) and time.monotonic() < deadline:
            time.sleep(0.005)

    def check_pool(self) -> None:
        """Each page's refcount is the number of file references to it; the free list holds
        exactly the unreferenced pages, once each."""
        kvfs, pool = self.engine.kvfs, self.engine.pool
        with kvfs.lock:
            held = Counter(p for f in kvfs._files.values() for p in f.pages if isinstance(p, int))
            for page in range(pool.num_pages):
                assert pool.refcount[page] == held.get(page, 0), (page, pool.refcount[page], held.get(page, 0))
            free = pool._free
            assert len(free) == len(set(free)) and set(free) == {p for p in range(pool.num_pages) if not held.get(p)}
            # What quotas charge each tenant: its distinct pages, plus the pages a file holds again.
            for account in {quota_account(f.owner) for f in kvfs._files.values()} | set(kvfs._held):
                files = [f for f in kvfs._files.values() if quota_account(f.owner) == account]
                charged = len({p for f in files for p in f.pages}) + sum(len(f.pages) - len(set(f.pages)) for f in files)
                assert kvfs.charged_pages(account) == charged, (account, kvfs.charged_pages(account), charged)
