"""Python bytecodes a LIP's round costs, counted: deterministic where this VM's timings are not
(paired runs of the same code move by 2x on a bad day, bench/NOTES.md stop 27).

The null model of bench/hostcall.py (no forward pass), one thread, N processes each making one
blocking `pred` a round (or `pred_submit` + `pred_wait`): every bytecode the host executes
between spawning them and their end is counted (`sys.settrace` opcode events), for runs of 10
and 30 rounds; the difference over 20 rounds and N processes is one process's round, startup
cancelled. `--by-function` also lists where they go.

    python bench/round_bytecodes.py [--processes 64] [--by-function] [--out FILE]

Prints a table and writes bench/results/round_bytecodes.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import wasmtime

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from hostcall import ROUNDS_GUEST, SUBMIT_WAIT_GUEST, NullRunner  # noqa: E402  (bench/hostcall.py)

from symphony_os.engine import Engine  # noqa: E402
from symphony_os.lip.runtime import Runtime  # noqa: E402
from symphony_os.model.random_model import build_random_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def count_bytecodes(model_dir: Path, processes: int, rounds: int, guest: str) -> collections.Counter:
    """Bytecodes executed, by function, while `processes` guests run `rounds` rounds."""
    engine = Engine.from_path(model_dir, device="cpu", page_size=16, num_pages=processes * (rounds // 16 + 2) + 16,
                              max_batch_size=4096, token_budget=8192)
    engine.runner = NullRunner(engine.loaded.config.vocab_size)
    counts: collections.Counter = collections.Counter()

    def tracer(frame, event, _arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts[f"{Path(code.co_filename).name}:{code.co_qualname}"] += 1
        return tracer

    with Runtime(engine, drive_in_caller=True) as runtime:
        program = runtime.load(wasmtime.wat2wasm(guest.replace("ROUNDS", str(rounds))), "rounds")
        procs = [runtime.spawn(program) for _ in range(processes)]
        sys.settrace(tracer)
        try:
            for proc in procs:
                assert runtime.wait(proc, 600) == 0, proc.end_reason
        finally:
            sys.settrace(None)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=64)
    parser.add_argument("--by-function", action="store_true", help="list each function's share of a round")
    parser.add_argument("--out", type=Path, default=RESULTS / "round_bytecodes.json", help="where the JSON goes")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_model(Path(tmp) / "tiny", vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        for calls, guest in (("pred", ROUNDS_GUEST), ("pred_submit + pred_wait", SUBMIT_WAIT_GUEST)):
            short, long = (count_bytecodes(model, args.processes, rounds, guest) for rounds in (10, 30))
            per_round = {name: (long[name] - short[name]) / (20 * args.processes) for name in set(long) | set(short)}
            total = sum(per_round.values())
            rows.append(dict(calls=calls, processes=args.processes, bytecodes_per_process_round=round(total, 1),
                             by_function={n: round(v, 1) for n, v in sorted(per_round.items(), key=lambda i: -i[1])
                                          if abs(v) >= 0.5}))
            print(f"{calls:>23}, {args.processes} processes: {total:.1f} bytecodes per process-round", flush=True)
            if args.by_function:
                for name, value in rows[-1]["by_function"].items():
                    print(f"    {value:8.1f}  {name}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(python=sys.version.split()[0], rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
