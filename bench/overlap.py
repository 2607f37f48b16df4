"""Programs against prompts on one engine, measured on a CPU as a GPU would see them (issue 29).

The same greedy decoding two ways: N processes of a C LIP that asks for a host-sampled token
each step (bench/lips/complete_ids.c: `pred_submit` of kind sample, then `pred_wait`), as
`symphony run` runs them (one thread: the rounds and the batches), against the engine's Python
API doing the same (`Engine.submit` per sequence per step, `run_until_idle`). 32-token prompts,
48 new tokens per sequence, outputs checked identical.

1. Real model (a tiny random Llama with a 32k vocabulary): the host's time per generated token
   outside the model's forward passes, each path's own work (sampling included). On a GPU this
   is what the device waits for between passes.
2. A simulated device: the runner's forward pass does no work and is ready after a device time
   of `--device-ms` + `--device-us-per-seq` x the batch's sequences (by default 2.5 ms + 4 us,
   the shape of an H100 decode step for a ~1B model); its logits name a token that depends only
   on the sequence's last token and position, so both paths produce the same text. Like a
   GPU's, its pass is launched and completed apart (`launch`, then the logits' `result()`), so
   a host that has work to do meanwhile can do it (the runtime's batch driver resumes the
   decode lane's guests during the pass: engine/speculation.py); the API path's loop steps one
   batch at a time. Tokens/s of each path, and their ratio: how much of the host's work shows
   next to the device's.

Each measurement is the median of `--repeats` runs, the paths alternating (LIP, API, API,
LIP, ...); ratios are the median of the paired runs'.

    python bench/overlap.py [--quick] [--processes 1,8,32,128,256]

Prints two tables and writes bench/results/overlap.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from engine import cpu_name, python_build  # noqa: E402  (bench/engine.py)
from hostcall import api_decode as greedy_api_decode  # noqa: E402  (bench/hostcall.py)

from symphony_os.engine import Engine  # noqa: E402
from symphony_os.engine.gc_tuning import tune_gc, untune_gc  # noqa: E402
from symphony_os.lip.runtime import Runtime  # noqa: E402
from symphony_os.model.random_model import build_random_model  # noqa: E402
from symphony_os.wasm.native_build import ZIG_CC  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LIP = ROOT / "bench" / "lips" / "complete_ids"
SHAPE = dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
PROMPT_TOKENS, NEW_TOKENS = 32, 48


def build_lip() -> Path:
    wasm, source = LIP.with_suffix(".wasm"), LIP.with_suffix(".c")
    newest = max(source.stat().st_mtime, (LIP.parent / "bench_lip.h").stat().st_mtime)
    if not wasm.exists() or wasm.stat().st_mtime < newest:
        subprocess.run([*ZIG_CC, "--target=wasm32-wasi", "-O2", "-s", "-I", str(ROOT / "guest_sdk" / "c"), str(source),
                        "-o", str(wasm)], check=True)
    return wasm


class SimulatedDevice:
    """A model runner whose forward pass is a wait: ready `base_s + per_seq_s` x sequences after
    it starts. The row of a sequence names the token (last token x 31 + position x 7) mod
    (vocab - 3) + 3: the same on both paths, never one of the low special ids."""

    def __init__(self, vocab_size: int, base_s: float, per_seq_s: float):
        self.vocab_size, self.base_s, self.per_seq_s = vocab_size, base_s, per_seq_s
        self.device_s = 0.0  # the device time of every pass so far

    def run(self, seqs):
        return self.launch(seqs).result()

    def launch(self, seqs) -> "SimulatedPass":
        """The pass started: the host is free until it asks for the logits (Engine.launch)."""
        started = time.perf_counter()
        rows = [(s.tokens[-1], s.positions[-1]) for s in seqs if s.wants_logits]
        return SimulatedPass(self, rows, started, started + self.base_s + self.per_seq_s * len(seqs))


class SimulatedPass:
    """A SimulatedDevice pass under way: `result()` waits until the device is done (to 0.2 ms by
    sleeping, then spinning) and gives the logits."""

    def __init__(self, device: SimulatedDevice, rows: list[tuple[int, int]], started: float, ready: float):
        self.device, self.rows, self.started, self.ready = device, rows, started, ready

    def result(self):
        device = self.device
        logits = torch.zeros(len(self.rows), device.vocab_size)
        for i, (token, position) in enumerate(self.rows):
            logits[i, (token * 31 + position * 7) % (device.vocab_size - 3) + 3] = 1.0
        while True:
            left = self.ready - time.perf_counter()
            if left <= 0:
                break
            if left > 0.0002:
                time.sleep(min(left - 0.0002, 0.001))
        device.device_s += time.perf_counter() - self.started
        return logits


class TimedRunner:
    """The model runner, its forward passes timed (each path's sampling is its own work)."""

    def __init__(self, runner):
        self.runner, self.forward_s = runner, 0.0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, seqs):
        started = time.perf_counter()
        try:
            return self.runner.run(seqs)
        finally:
            self.forward_s += time.perf_counter() - started


def api_decode(engine: Engine, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """Greedy decoding through the Python API: a submit per sequence per step, then the batch."""
    return greedy_api_decode(engine, prompts, NEW_TOKENS)


def lip_decode(engine: Engine, program: Path, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """The same through N processes of complete_ids, as `symphony run` runs them (one thread)."""
    with Runtime(engine, drive_in_caller=True) as runtime:
        loaded = runtime.load(program)
        outputs = [[] for _ in prompts]
        started = time.perf_counter()
        procs = [runtime.spawn(loaded, [str(NEW_TOKENS), " ".join(map(str, p))], on_output=outputs[i].append)
                 for i, p in enumerate(prompts)]
        for proc in procs:
            assert runtime.wait(proc, 3600) == 0, proc.end_reason
        elapsed = time.perf_counter() - started
    return elapsed, [[int(t) for t in b"".join(o).split()] for o in outputs]


def measure(engine: Engine, program: Path, processes: int, repeats: int, timed) -> dict:
    """Each path's runs (alternating), with the device's or the forward passes' time of each."""
    torch.manual_seed(processes)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (PROMPT_TOKENS,)).tolist() for _ in range(processes)]
    api_decode(engine, prompts[:2])  # warm up both paths
    lip_decode(engine, program, prompts[:2])
    runs = {"lip": lambda: lip_decode(engine, program, prompts), "api": lambda: api_decode(engine, prompts)}
    wall, device, outputs = {"lip": [], "api": []}, {"lip": [], "api": []}, {}
    steps = {"lip": [], "api": []}  # each run's steady time a step: the median between two launches
    launches: list[float] = []
    launch = engine.launch

    def timed_launch():
        launches.append(time.perf_counter())
        return launch()

    engine.launch = timed_launch
    try:
        for repeat in range(repeats):
            for name in (("lip", "api") if repeat % 2 == 0 else ("api", "lip")):
                before = timed()
                launches.clear()
                seconds, outputs[name] = runs[name]()
                wall[name].append(seconds)
                device[name].append(timed() - before)
                # Past the prefill and the first decode steps, short of the last: every sequence decodes.
                middle = launches[4:-2]
                steps[name].append(statistics.median(b - a for a, b in zip(middle, middle[1:])))
    finally:
        del engine.launch
    tokens = sum(len(o) for o in outputs["api"])
    host_us = {name: [1e6 * (w - d) / tokens for w, d in zip(wall[name], device[name])] for name in wall}
    return dict(processes=processes, tokens=tokens, identical=outputs["lip"] == outputs["api"],
                lip_tok_s=tokens / statistics.median(wall["lip"]), api_tok_s=tokens / statistics.median(wall["api"]),
                ratio=statistics.median(a / b for a, b in zip(wall["api"], wall["lip"])),
                host_us_per_token={name: statistics.median(v) for name, v in host_us.items()},
                host_ratio=statistics.median(a / b for a, b in zip(host_us["lip"], host_us["api"])),
                ms_per_step={name: 1e3 * statistics.median(v) for name, v in steps.items()},
                step_ratio=statistics.median(a / b for a, b in zip(steps["api"], steps["lip"])),
                seconds=wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run a path, up to 32 processes")
    parser.add_argument("--processes", default="1,8,32,128,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device-ms", type=float, default=2.5)
    parser.add_argument("--device-us-per-seq", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "overlap.json")
    args = parser.parse_args()
    counts = [int(n) for n in args.processes.split(",")]
    repeats = args.repeats
    if args.quick:
        counts, repeats = [n for n in counts if n <= 32], 1
    program = build_lip()
    rows = {"real_model": [], "simulated_device": []}
    tune_gc()  # as the runtime runs LIPs: both paths alike
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_model(Path(tmp) / "model", seed=0, **SHAPE)
        engine = Engine.from_path(model_dir, device="cpu", page_size=16, num_pages=4096, token_budget=8192,
                                  max_batch_size=max(256, max(counts)))
        timed = TimedRunner(engine.runner)
        engine.runner = timed
        for n in counts:
            row = measure(engine, program, n, repeats, lambda: timed.forward_s)
            rows["real_model"].append(row)
            host = row["host_us_per_token"]
            print(f"real model, {n:>3} processes: host us per token outside the forward: LIP {host['lip']:.1f}, "
                  f"API {host['api']:.1f} ({row['host_ratio']:.2f}x); identical {row['identical']}", flush=True)
        device = SimulatedDevice(SHAPE["vocab_size"], args.device_ms / 1e3, args.device_us_per_seq / 1e6)
        engine.runner = device
        for n in counts:
            row = measure(engine, program, n, repeats, lambda: device.device_s)
            rows["simulated_device"].append(row)
            print(f"simulated device, {n:>3} processes: LIP {row['lip_tok_s']:.0f} tok/s, API {row['api_tok_s']:.0f} "
                  f"tok/s, ratio {row['ratio']:.3f}; identical {row['identical']}", flush=True)
    untune_gc()
    print(f"\nHost time per generated token outside the forward passes, us (tiny random Llama, vocab "
          f"{SHAPE['vocab_size']}, median of {repeats})")
    print(f"{'processes':>9} | {'LIP':>7} | {'API':>7} | {'LIP / API':>9} | identical")
    for r in rows["real_model"]:
        h = r["host_us_per_token"]
        print(f"{r['processes']:>9} | {h['lip']:>7.1f} | {h['api']:>7.1f} | {r['host_ratio']:>9.2f} | {r['identical']}")
    print(f"\nSimulated device ({args.device_ms} ms + {args.device_us_per_seq} us per sequence a pass): tokens/s "
          f"of whole runs (the processes' start included), and the steady time a decode step (ms; ratio API / LIP)")
    print(f"{'processes':>9} | {'LIP':>8} | {'API':>8} | {'LIP / API':>9} | {'LIP step':>8} | {'API step':>8} | "
          f"{'step ratio':>10} | identical")
    for r in rows["simulated_device"]:
        step = r["ms_per_step"]
        print(f"{r['processes']:>9} | {r['lip_tok_s']:>8.0f} | {r['api_tok_s']:>8.0f} | {r['ratio']:>9.3f} | "
              f"{step['lip']:>8.2f} | {step['api']:>8.2f} | {r['step_ratio']:>10.3f} | {r['identical']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(cpu=cpu_name(), python=python_build(), torch=torch.__version__,
                                        shape=SHAPE, prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS,
                                        repeats=repeats, device_ms=args.device_ms,
                                        device_us_per_seq=args.device_us_per_seq, **rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
