"""The CI fuzz budget: a fixed, seeded number of hypothesis inputs for each fuzzer in
tests/fuzzing.py (host calls from a guest, module bytes on the upload path), then a short
coverage-guided run of each through atheris (tests/fuzz.py, which `make fuzz SECONDS=N` runs
for longer)."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import fuzzing
import pytest
from fuzzing import KNOWN_INPUTS, FuzzHost, call_sequence, encode, fuzz_settings, module_bytes
from hypothesis import example, given

HOSTCALL_INPUTS, MODULE_INPUTS = 1500, 1500
GUIDED_RUNS = 400
FUZZ = Path(__file__).resolve().parent / "fuzz.py"


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


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None,
                    reason="atheris (the dev extra's, Linux x86_64 wheels) is not installed")
@pytest.mark.parametrize("target", ["hostcalls", "modules"])
def test_coverage_guided_fuzzing_keeps_every_invariant(target, tmp_path):
    """libFuzzer keeps the inputs that reach new code of symphony_os and mutates them further;
    every input passes FuzzHost's checks (a broken one ends the run with exit code 1 and writes
    the input as crash-*). Seeded: the same inputs in every run."""
    run = subprocess.run([sys.executable, str(FUZZ), "--target", target, "--runs", str(GUIDED_RUNS), "--seed", "1",
                          "--artifacts", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0 and not list(tmp_path.glob("crash-*")), run.stderr[-4000:]
    assert f"Done {GUIDED_RUNS} runs" in run.stderr, run.stderr[-4000:]
    edges = [int(n) for n in re.findall(r"cov: (\d+)", run.stderr)]
    assert edges[-1] > edges[0], run.stderr[-4000:]  # the guidance found code the first inputs did not reach
    fuzzing.SUMMARY.append(f"coverage-guided {target} fuzzing: {GUIDED_RUNS} inputs, {edges[-1]} edges")
