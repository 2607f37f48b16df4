"""The CI fuzz budget: a fixed, seeded number of hypothesis inputs for each fuzzer in
tests/fuzzing.py (host calls from a guest, module bytes on the upload path). `make fuzz
SECONDS=N` (tests/fuzz.py) runs the same fuzzers for longer and reports coverage."""
import pytest
from hypothesis import example, given

import fuzzing
from fuzzing import KNOWN_INPUTS, FuzzHost, call_sequence, encode, fuzz_settings, module_bytes

HOSTCALL_INPUTS, MODULE_INPUTS = 1500, 1500


@pytest.fixture(scope="module")
def fuzz_host():
    host = FuzzHost()
    yield host
    host.close()


def test_host_call_fuzzing_keeps_every_invariant(fuzz_host):
    start = fuzz_host.inputs

    @fuzz_settings(HOSTCALL_INPUTS)
    @given(call_sequence)
    def run(calls):
        fuzz_host.run_calls(encode(calls))

    for known in KNOWN_INPUTS:
        run = example(known)(run)
    run()
    fuzzing.SUMMARY.append(f"host-call fuzzing: {fuzz_host.inputs - start} inputs")


def test_module_bytes_fuzzing_compiles_or_refuses_with_one_line(fuzz_host):
    start = fuzz_host.inputs

    @fuzz_settings(MODULE_INPUTS)
    @given(module_bytes())
    def run(data):
        fuzz_host.load(data)

    run()
    fuzzing.SUMMARY.append(f"module-bytes fuzzing: {fuzz_host.inputs - start} inputs")
