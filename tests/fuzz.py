"""`make fuzz SECONDS=N`: both fuzzers of tests/fuzzing.py for N seconds in all (host calls two
thirds, module bytes one third), with fresh random seeds, measuring line coverage of symphony_os.
Prints inputs run, inputs/s and coverage; exits 1 on the first broken invariant, printing the
input (make it a regression test)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import coverage

sys.path.insert(0, str(Path(__file__).resolve().parent))


def fuzz(run_one, strategy, seconds: float) -> int:
    """Batches of hypothesis examples (each batch a new random seed) until the time is up."""
    from hypothesis import given

    from fuzzing import fuzz_settings

    deadline, count = time.monotonic() + seconds, 0

    @fuzz_settings(100, derandomize=False)
    @given(strategy)
    def batch(value):
        nonlocal count
        if time.monotonic() < deadline:
            run_one(value)
            count += 1

    while time.monotonic() < deadline:
        batch()
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    cov = coverage.Coverage(source=[str(root / "symphony_os")], data_file=None)
    cov.start()  # before symphony_os is imported, so its module-level lines count
    from fuzzing import KNOWN_INPUTS, FuzzHost, call_sequence, encode, module_bytes

    host = FuzzHost()
    try:
        started = time.monotonic()
        for known in KNOWN_INPUTS:
            host.run_calls(encode(known))
        calls = fuzz(lambda c: host.run_calls(encode(c)), call_sequence, args.seconds * 2 / 3)
        modules = fuzz(host.load, module_bytes(), max(0.0, args.seconds - (time.monotonic() - started)))
        elapsed = time.monotonic() - started
    finally:
        host.close()
        cov.stop()
    percent = cov.report(file=open("/dev/null", "w"))
    print(f"host-call fuzzing: {calls} inputs; module-bytes fuzzing: {modules} inputs")
    print(f"{calls + modules} inputs in {elapsed:.1f} s: {(calls + modules) / elapsed:.1f} inputs/s")
    print(f"line coverage of symphony_os: {percent:.1f}%")
    for name in ("hostcalls.py", "kvfs.py", "guest_memory.py", "program.py", "limits.py", "process.py"):
        analysis = cov.analysis2(str(root / "symphony_os" / name))
        statements, missing = len(analysis[1]), len(analysis[3])
        print(f"  {name}: {100 * (statements - missing) / max(statements, 1):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
