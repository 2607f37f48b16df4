"""Every kind of hostile guest in tests/hostile.py, each next to well-behaved neighbours: the
host survives, the neighbours print byte for byte what they print alone, the offender ends (or
is refused) with the right reason, and it leaves no KV page, file, handle or ticket behind."""
import re
from dataclasses import replace

import pytest
from guests import lip, wat
from hostile import CORPUS, sent_i32s
from served import wait_until

from symphony_os.engine.loop import Engine
from symphony_os.lip.limits import ProcessLimits
from symphony_os.lip.process import EXIT_KILLED
from symphony_os.lip.runtime import Runtime
from symphony_os.wasm.program import ProgramError

# The corpus runs under tight limits, so that each kind hits its limit quickly.
TIGHT = ProcessLimits(cpu_time_s=1.0, memory_bytes=16 * 2**20, output_bytes=2**20, kv_handles=64, kv_pages=8)
NEIGHBOUR_ARGS = [["Once upon a time", "8"], ["Tom went to the", "8"]]


@pytest.fixture(scope="module")
def host(stories_path):
    """A runtime over stories260K; bob owns a named KV file `secret` (not shared); tenant
    `quota-tenant` may hold 2 KV pages, and mallory (the offenders' tenant) 100 named files."""
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=512)
    engine.kvfs.page_quota["quota-tenant"] = 2
    engine.kvfs.file_quota["mallory"] = 100  # the "named-file flood" kind's
    bob = engine.session("bob")
    secret = bob.open("secret", 1)
    engine.pred(bob, secret, engine.tokenize("The secret is 42"))
    bob.close(secret)
    with Runtime(engine) as runtime:
        hello = runtime.load(lip("hello"))
        alone = [run_neighbour(runtime, hello, args) for args in NEIGHBOUR_ARGS]
        yield runtime, hello, alone
    engine.stop()


def run_neighbour(runtime, program, args):
    out = []
    process = runtime.spawn(program, args, on_output=out.append)
    assert runtime.wait(process, 120) == 0, process.end_reason
    return b"".join(out)


def footprint(engine):
    """What the KV system holds: pages in use, swapped pages, files."""
    stats = engine.pool.stats()
    return stats.used, stats.swapped, engine.kvfs.file_count


def test_the_corpus_has_at_least_25_kinds():
    assert len(CORPUS) >= 25


@pytest.mark.parametrize("kind", list(CORPUS))
def test_hostile_guest(host, kind):
    runtime, hello, alone = host
    case = CORPUS[kind]
    engine = runtime.engine
    before = footprint(engine)
    outputs = [[] for _ in NEIGHBOUR_ARGS]
    neighbours = [runtime.spawn(hello, args, on_output=out.append) for args, out in zip(NEIGHBOUR_ARGS, outputs)]
    data = case.module()
    if case.refused is not None:
        with pytest.raises(ProgramError, match=case.refused) as refused:
            runtime.load(data, "hostile", compile_time_s=case.compile_time_s)
        assert "\n" not in str(refused.value)
    else:
        sent = []
        offender = runtime.spawn(runtime.load(data, "hostile"), tenant=case.tenant, on_output=sent.append,
                                 limits=replace(TIGHT, **case.limits))
        code = runtime.wait(offender, 60)
        assert code == case.exit_code and re.search(case.reason, offender.end_reason or ""), \
            (code, offender.end_reason, offender.log[-3:])
        if case.sends is not None:
            got = sent_i32s(b"".join(sent))
            assert case.sends(got), got
        assert offender.kv.open_handles == 0 and not offender.syscalls.tickets
    for process, out, expected in zip(neighbours, outputs, alone):
        assert runtime.wait(process, 120) == 0, process.end_reason
        assert b"".join(out) == expected
    # Preds an offender left in flight finish in a later batch, then free their files.
    assert wait_until(lambda: footprint(engine) == before, timeout_s=30), (footprint(engine), before)
    secret = engine.kvfs.session("bob").stat("secret")
    assert secret.length == len(engine.tokenize("The secret is 42")) and secret.owner == "bob"


def test_fuel_limit_stops_a_spinning_guest(tiny_engine):
    spin = wat('(module (memory (export "memory") 1) (func (export "_start") (loop $l (br $l))))')
    with Runtime(tiny_engine, limits=ProcessLimits(fuel=1_000_000)) as runtime:
        process = runtime.spawn(runtime.load(spin, "spin"))
        assert runtime.wait(process, 30) == EXIT_KILLED
    assert process.end_reason == "killed: fuel limit 1000000 exhausted"


def test_per_process_limits_cannot_change_engine_settings(tiny_engine):
    with Runtime(tiny_engine) as runtime:
        program = runtime.load(wat('(module (memory (export "memory") 1) (func (export "_start")))'))
        with pytest.raises(ValueError, match="fuel"):
            runtime.spawn(program, limits=ProcessLimits(fuel=10))


def test_a_second_linear_memory_is_refused_so_memory_bytes_is_the_total(tiny_engine):
    """wasmtime limits each memory to memory_bytes; one memory per process keeps that the total."""
    module = wat('(module (memory 1) (memory (export "memory") 1) (func (export "_start")))')
    with Runtime(tiny_engine) as runtime:
        process = runtime.spawn(runtime.load(module, "two-memories"))
        assert runtime.wait(process, 30) != 0
    assert process.end_reason.startswith("failed to start")
