"""Python bytecodes a process's start costs, counted (deterministic where this VM's timings are
not): N processes of bench/lips/complete_ids are spawned and driven, with no batch run, until
every one has queued its prompt's pred; every bytecode the host executes meanwhile is counted
(`sys.settrace` opcode events) and divided by N. `--by-function` lists where they go. The
wall time of the same phase, untraced, is printed beside it (median of 5; this VM's timings
move by 1.5x within an hour: compare runs of one hour only).

    python bench/start_bytecodes.py [--processes 128] [--by-function] [--out FILE]

Writes bench/results/start_bytecodes.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from overlap import NEW_TOKENS, PROMPT_TOKENS, SHAPE, SimulatedDevice, build_lip  # noqa: E402

from symphony_os.engine import Engine  # noqa: E402
from symphony_os.engine.gc_tuning import tune_gc, untune_gc  # noqa: E402
from symphony_os.lip.runtime import Runtime  # noqa: E402
from symphony_os.model.random_model import build_random_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def start(engine: Engine, runtime: Runtime, program, prompts: list[list[int]], trace=None) -> float:
    """Spawn a process per prompt and run rounds until each queued its prompt's pred; the
    seconds it took. The processes are killed afterwards (untraced, untimed)."""
    worker = runtime.workers[0]
    started = time.perf_counter()
    if trace is not None:
        sys.settrace(trace)
    try:
        procs = [runtime.spawn(program, [str(NEW_TOKENS), " ".join(map(str, p))]) for p in prompts]
        while len(engine.scheduler) < len(prompts):
            if not worker.run_ready():
                raise RuntimeError("the processes stopped before queueing their prompts")
    finally:
        sys.settrace(None)
    seconds = time.perf_counter() - started
    for proc in procs:
        proc.kill("measured")
    while not all(proc.ended.is_set() for proc in procs):
        worker.run_ready()
    for proc in procs:
        runtime.wait(proc, 60)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=128)
    parser.add_argument("--by-function", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "start_bytecodes.json")
    args = parser.parse_args()
    n = args.processes
    tune_gc()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_model(Path(tmp) / "model", seed=0, **SHAPE)
        engine = Engine.from_path(model_dir, device="cpu", page_size=16, num_pages=4096, token_budget=8192,
                                  max_batch_size=max(256, n))
        engine.runner = SimulatedDevice(SHAPE["vocab_size"], 2.5e-3, 4e-6)  # (no batch runs: never called)
        torch.manual_seed(n)
        prompts = [torch.randint(3, SHAPE["vocab_size"], (PROMPT_TOKENS,)).tolist() for _ in range(n)]
        with Runtime(engine, drive_in_caller=True) as runtime:
            program = runtime.load(build_lip())
            for _ in range(2):  # warm: the linker's fast shapes, the caches
                start(engine, runtime, program, prompts)
            seconds = statistics.median(start(engine, runtime, program, prompts) for _ in range(5))
            counts: collections.Counter = collections.Counter()

            def trace(frame, event, _arg):
                frame.f_trace_opcodes = True
                if event == "opcode":
                    code = frame.f_code
                    counts[(code.co_filename.rpartition("/")[2], code.co_name, code.co_firstlineno)] += 1
                return trace

            start(engine, runtime, program, prompts, trace)
    untune_gc()
    total = sum(counts.values()) / n
    print(f"start of {n} processes (spawn, instantiate, run to the prompt's pred): {total:,.0f} bytecodes a "
          f"process; {1e6 * seconds / n:.0f} us a process untraced")
    if args.by_function:
        for (file, name, line), count in counts.most_common(30):
            print(f"{count / n:>8.1f}  {file}:{line} {name}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(processes=n, bytecodes_per_process=total, us_per_process=1e6 * seconds / n,
                                        by_function={f"{f}:{l} {name}": c / n for (f, name, l), c in
                                                     counts.most_common(30)}), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
