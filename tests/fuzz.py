"""`make fuzz SECONDS=N`: coverage-guided fuzzing of the host with atheris (libFuzzer for
Python), over the two surfaces of tests/fuzzing.py:

  hostcalls  sequences of host calls from the fuzz driver guest, as hypothesis draws them from
             libFuzzer's bytes (`fuzz_one_input`): a mutation that reaches new lines of
             symphony_os is kept and mutated further;
  modules    module bytes on the upload path, mutated by libFuzzer from real modules (seeds).

symphony_os's modules are instrumented for coverage (not its Triton kernels, nor torch and
the rest). Each input is checked as in tests/fuzzing.py (FuzzHost); a broken invariant stops
the run with its traceback, and libFuzzer writes the input to `crash-*` under --artifacts (make
it a regression test: KNOWN_INPUTS). libFuzzer prints `cov:` (edges reached) as it goes.

    python tests/fuzz.py --target hostcalls --seconds 60
    python tests/fuzz.py --target modules --runs 500 --seed 1     (what the suite runs)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))

with atheris.instrument_imports(include=["symphony_os"], exclude=["symphony_os.kernels"]):
    import fuzzing  # imports the parts of symphony_os the host runs: instrumented

TARGETS = ("hostcalls", "modules")


def hostcalls_target(host: fuzzing.FuzzHost):
    """libFuzzer's bytes -> a call sequence (hypothesis) -> the driver guest."""
    from hypothesis import given

    @fuzzing.fuzz_settings(1)
    @given(fuzzing.call_sequence)
    def run(calls):
        host.run_calls(fuzzing.encode(calls))

    for known in fuzzing.KNOWN_INPUTS:  # the inputs that once broke an invariant, first
        host.run_calls(fuzzing.encode(known))
    return run.hypothesis.fuzz_one_input


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=TARGETS, required=True)
    parser.add_argument("--seconds", type=int, default=0, help="stop after this long (0: no limit)")
    parser.add_argument("--runs", type=int, default=-1, help="stop after this many inputs (-1: no limit)")
    parser.add_argument("--seed", type=int, default=0, help="libFuzzer's random seed (0: a fresh one)")
    parser.add_argument("--artifacts", default=".", help="where a failing input is written")
    args = parser.parse_args()
    host = fuzzing.FuzzHost()
    corpus = tempfile.mkdtemp(prefix=f"symphony-fuzz-{args.target}-")
    if args.target == "hostcalls":
        test_one_input = hostcalls_target(host)
    else:
        for index, module in enumerate(fuzzing.valid_modules()):
            (Path(corpus) / f"seed-{index}.wasm").write_bytes(module)
        test_one_input = host.load
    libfuzzer = [sys.argv[0], corpus, f"-seed={args.seed}", f"-runs={args.runs}", f"-max_total_time={args.seconds}",
                 f"-artifact_prefix={Path(args.artifacts).resolve()}/", "-rss_limit_mb=0", "-timeout=120",
                 "-print_final_stats=1"]
    if args.target == "hostcalls":  # hypothesis's choices: a few KB give the longest sequences
        libfuzzer += ["-max_len=8192", "-len_control=0"]
    atheris.Setup(libfuzzer, test_one_input)
    atheris.Fuzz()  # libFuzzer ends the process when the runs or the time are spent
    return 0


if __name__ == "__main__":
    sys.exit(main())
