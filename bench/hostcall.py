"""The cost of running generation as LIP processes instead of Python calls.

1. Null model (no forward pass: the runner returns zero logits at once): the per-process cost
   of one suspend / batch / resume round, at 16, 256 and 1024 processes. Each process is a
   WAT guest doing one blocking `pred` per round (also: `pred_submit` + `pred_wait`). Measured
   in the steady state: the time from one full batch (every process in it) to the next, divided
   by the processes, median over the run's full batches; the table has the median of 7
   runs (the 2-core VM's noise moves one run by +-30%), taken repeat by repeat across all
   configurations so that the VM's slow phases fall on each alike. Two configurations: one thread, as
   `symphony run` runs (batches and guests inside `Runtime.wait`), and threads, as `symphony
   serve` runs (a worker thread for guests, a driver thread for batches).
2. Real model (the 50M-parameter random Llama of bench/engine.py): tokens/s of `hello`
   processes (lips/hello.c: full distribution to the guest, argmax and detokenize there) against
   the engine's Python API at the same batch sizes; outputs must match. Against two API loops:
   host greedy (the least work), and the API doing hello's work (the full distribution, its
   argmax, the new text per token). Each of the three runs 15 times in the
   order A B C C B A ...; the table has median tok/s, and as ratios the median of each repeat's
   paired ratio (its runs are back to back, so a slow phase of the VM, +-15% per run, slows
   both sides of a pair: the ratio of medians, also in the JSON, pairs runs from different
   phases). A second table has each path's host time per token outside the model's forward passes
   (sampling, softmax included: each path's own work): what the runtime's code decides, and
   steadier than the ratios; with the forward time the paths share (the same batches: the median
   over every run), it gives the ratios again, free of the noise in the forward passes.

    python bench/hostcall.py [--quick]

Prints a table and writes bench/results/hostcall.json.
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
import wasmtime

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from engine import BENCH_SHAPE, cpu_name, python_build  # noqa: E402  (bench/engine.py)

from symphony_os.engine.gc_tuning import tune_gc, untune_gc  # noqa: E402
from symphony_os.engine.loop import Engine  # noqa: E402
from symphony_os.engine.sampling import Distribution, Sample  # noqa: E402
from symphony_os.lip.runtime import Runtime  # noqa: E402
from symphony_os.model.random_model import build_random_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"

ROUNDS_GUEST = """(module
  (import "symphony" "kv_create" (func $kv_create (result i32)))
  (import "symphony" "pred" (func $pred (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "\\05\\00\\00\\00")
  (func (export "_start") (local $kv i32) (local $i i32)
    (local.set $kv (call $kv_create))
    (loop $round
      (drop (call $pred (local.get $kv) (i32.const 16) (i32.const 0) (i32.const 1) (i32.const 2) (i32.const 0)
                        (i32.const 0) (i32.const 0)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $round (i32.lt_s (local.get $i) (i32.const ROUNDS))))))"""
# The same round as two calls: a ticket, then a wait on it (how parallel branches use it).
SUBMIT_WAIT_GUEST = """(module
  (import "symphony" "kv_create" (func $kv_create (result i32)))
  (import "symphony" "pred_submit" (func $submit (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "symphony" "pred_wait" (func $wait (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "\\05\\00\\00\\00")
  (func (export "_start") (local $kv i32) (local $i i32)
    (local.set $kv (call $kv_create))
    (loop $round
      (drop (call $wait (call $submit (local.get $kv) (i32.const 16) (i32.const 0) (i32.const 1)
                                      (i32.const 2) (i32.const 0)) (i32.const 0) (i32.const 0)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $round (i32.lt_s (local.get $i) (i32.const ROUNDS))))))"""


class NullRunner:
    """Stands in for the model runner: zero logits, no forward pass."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def run(self, seqs):
        return torch.zeros(sum(s.wants_logits for s in seqs), self.vocab_size)


def null_model_rounds(model_dir: Path, processes: int, rounds: int, in_caller: bool, guest: str = ROUNDS_GUEST) -> dict:
    """Steady-state cost of a round: see the module docstring."""
    engine = Engine.from_path(model_dir, device="cpu", page_size=16,
                              num_pages=processes * (rounds // 16 + 2) + 16, max_batch_size=4096, token_budget=8192)
    engine.runner = NullRunner(engine.loaded.config.vocab_size)
    batch_starts: list[tuple[float, int]] = []  # (time, requests waiting) at each batch
    launch = engine.launch

    def timed_launch():
        batch_starts.append((time.perf_counter(), len(engine.scheduler)))
        return launch()

    engine.launch = timed_launch
    with Runtime(engine, drive_in_caller=in_caller) as runtime:
        program = runtime.load(wasmtime.wat2wasm(guest.replace("ROUNDS", str(rounds))), "rounds")
        started = time.perf_counter()
        procs = [runtime.spawn(program) for _ in range(processes)]
        for proc in procs:
            assert runtime.wait(proc, 600) == 0, proc.end_reason
        elapsed = time.perf_counter() - started
    full = [b[0] - a[0] for a, b in zip(batch_starts, batch_starts[1:]) if a[1] == b[1] == processes]
    stats = engine.stats()
    return dict(processes=processes, rounds=rounds, config="one thread" if in_caller else "threads",
                calls="pred" if guest is ROUNDS_GUEST else "pred_submit + pred_wait",
                full_batches=len(full), us_per_process_round=1e6 * statistics.median(full) / processes,
                us_per_process_round_best=1e6 * min(full) / processes, whole_run_s=elapsed,
                batches=stats.batches, mean_batch_size=stats.mean_batch_size)


WINDOW = 8  # SYM_STREAM_WINDOW (guest_sdk/c/symphony.h), as lips/hello.c streams


def _stream_start(engine: Engine, prompt: list[int]) -> list[int]:
    """sym_stream_start's (prefix, mark, sent): from the latest of the prompt's last WINDOW
    tokens whose decode does not begin with U+FFFD."""
    prefix = len(prompt)
    for k in range(len(prompt) - 1, max(-1, len(prompt) - 1 - WINDOW), -1):
        prefix = k
        if not engine.detokenize(prompt[k:]).startswith("\ufffd"):
            break
    return [prefix, prefix, len(engine.detokenize(prompt[prefix:]))]


def api_decode(engine: Engine, prompts: list[list[int]], new_tokens: int,
               like_hello: bool = False) -> tuple[float, list[list[int]]]:
    """Greedy decoding through the Python API. `like_hello` does hello's own work too: the full
    distribution per token, argmax of it, and the text it adds, decoded as hello streams it (from
    a recent token on, which moves up every WINDOW tokens to one that starts a character)."""
    kv = engine.session()
    handles = [kv.create() for _ in prompts]
    feeds, out, live = [list(p) for p in prompts], [[] for _ in prompts], set(range(len(prompts)))
    streams = [_stream_start(engine, p) for p in prompts]  # prefix, mark, sent
    eos = set(engine.loaded.eos_token_ids)
    started = time.perf_counter()
    for _ in range(new_tokens):
        want = Distribution() if like_hello else Sample()
        futures = {i: engine.submit(kv, handles[i], feeds[i], want=want) for i in live}
        engine.run_until_idle()
        for i, fut in futures.items():
            result = fut.result()
            token = int(result.probs.argmax()) if like_hello else result.token
            if like_hello:
                ids = prompts[i] + out[i] + [token]
                prefix, mark, sent = streams[i]
                text = engine.detokenize(ids[prefix:])
                settled = text.rstrip("\ufffd")
                settled[sent:]  # the new text, to stream
                sent = max(sent, len(settled))
                if len(settled) == len(text):
                    if len(ids) - prefix >= 2 * WINDOW:
                        prefix = mark
                        sent = len(engine.detokenize(ids[prefix:]))
                    mark = len(ids)
                streams[i] = [prefix, mark, sent]
            if token in eos:
                live.discard(i)
            else:
                out[i].append(token)
                feeds[i] = [token]
        if not live:
            break
    elapsed = time.perf_counter() - started
    kv.close_all()
    return elapsed, out


def lip_decode(engine: Engine, hello: Path, prompts: list[str], new_tokens: int) -> tuple[float, list[str]]:
    # As `symphony run` does: batches run on this (the main) thread, inside wait().
    with Runtime(engine, drive_in_caller=True) as runtime:
        program = runtime.load(hello)
        outputs = [[] for _ in prompts]
        started = time.perf_counter()
        procs = [runtime.spawn(program, [p, str(new_tokens)], on_output=outputs[i].append)
                 for i, p in enumerate(prompts)]
        for proc in procs:
            assert runtime.wait(proc, 3600) == 0, proc.end_reason
        elapsed = time.perf_counter() - started
    return elapsed, [b"".join(o).decode() for o in outputs]


def _quartiles(values) -> list[float]:
    """The first and third quartiles."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return [q1, q3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, tokens and repeats")
    args = parser.parse_args()
    rounds = 20 if args.quick else 40
    new_tokens = 16 if args.quick else 48
    repeats = 3 if args.quick else 7  # null-model runs per configuration
    # Real-model runs per path: the VM's noise moves paired runs by +-15% (bench/NOTES.md), so
    # it takes this many for the median ratio to resolve a few percent. (With 15, the paired
    # ratios' quartiles 3-4% either side of the median put its own standard error near 1.5%.)
    real_repeats = 3 if args.quick else 25
    hello = ROOT / "lips" / "hello.wasm"
    if not hello.exists():
        subprocess.run(["make", "-C", str(ROOT), "lips"], check=True)

    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_random_model(Path(tmp) / "tiny", vocab_size=256, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        # Repeat by repeat over every configuration (not all of one configuration's runs in a
        # row): the VM's slow and fast phases, which last seconds, fall on all of them alike.
        configs = [(in_caller, guest, n) for in_caller, guest in
                   ((True, ROUNDS_GUEST), (False, ROUNDS_GUEST), (True, SUBMIT_WAIT_GUEST)) for n in (16, 256, 1024)]
        null_runs = {config: [] for config in configs}
        for _ in range(repeats):
            for config in configs:
                in_caller, guest, n = config
                null_runs[config].append(null_model_rounds(tiny, n, rounds, in_caller, guest))
        null_rows = []
        for config, runs in null_runs.items():
            row = sorted(runs, key=lambda r: r["us_per_process_round"])[len(runs) // 2]  # the median run
            row["us_per_process_round_runs"] = [r["us_per_process_round"] for r in runs]
            null_rows.append(row)
            print(f"null model, {row['config']}, {row['calls']}, {row['processes']:>5} processes: "
                  f"{row['us_per_process_round']:.1f} us per process per round "
                  f"(best batch {row['us_per_process_round_best']:.1f})", flush=True)

        model_dir = build_random_model(Path(tmp) / "bench", seed=0, **BENCH_SHAPE)
        engine = Engine.from_path(model_dir, device="cpu", page_size=16, num_pages=4096, token_budget=4096)
        # The model's forward passes alone (ModelRunner.run: no sampling, which is each path's
        # own host work), timed for every path alike.
        model_s, run_model = [0.0], engine.runner.run

        def timed_run_model(seqs):
            started = time.perf_counter()
            try:
                return run_model(seqs)
            finally:
                model_s[0] += time.perf_counter() - started

        engine.runner.run = timed_run_model
        # The API loops under the GC tuning the runtime gives LIPs (gc_tuning.py): both paths alike.
        tune_gc()
        real_rows = []
        for batch in (1, 8, 32):
            torch.manual_seed(batch)
            id_prompts = [torch.randint(3, BENCH_SHAPE["vocab_size"], (32,)).tolist() for _ in range(batch)]
            text_prompts = [engine.detokenize(p) for p in id_prompts]
            ids = [engine.tokenize(t) for t in text_prompts]  # as hello tokenizes them (with BOS)
            api_decode(engine, ids, 2)  # warm up both paths at this batch size
            lip_decode(engine, hello, text_prompts, 2)
            runs = {"api": lambda: api_decode(engine, ids, new_tokens),
                    "same_work": lambda: api_decode(engine, ids, new_tokens, like_hello=True),
                    "lip": lambda: lip_decode(engine, hello, text_prompts, new_tokens)}
            times, outside, outputs = {name: [] for name in runs}, {name: [] for name in runs}, {}
            forward = []  # each run's forward passes: the same batches, the same work in every path
            for repeat in range(real_repeats):
                for name in (list(runs) if repeat % 2 == 0 else list(reversed(runs))):
                    model_before = model_s[0]
                    seconds, outputs[name] = runs[name]()
                    times[name].append(seconds)
                    forward.append(model_s[0] - model_before)
                    outside[name].append(seconds - forward[-1])
            api_out, lip_out = outputs["api"], outputs["lip"]
            same = sum(lip == engine.detokenize(p + o) + "\n" for lip, p, o in zip(lip_out, ids, api_out))
            tokens = sum(len(o) for o in api_out)
            api_s, same_work_s, lip_s = (statistics.median(times[name]) for name in ("api", "same_work", "lip"))
            # The paths run the same batches: with the forward time they share (the median of
            # all runs), their host times give the ratio the VM's noise hides from the others.
            shared_forward, host = statistics.median(forward), {name: statistics.median(outside[name]) for name in runs}
            # The ratios pair the runs of one repeat (back to back) and take the median of those:
            # a slow phase of the VM that spans a repeat cancels out. The JSON also has the ratios
            # of the medians and of the best runs (noise here only ever adds time).
            row = dict(batch=batch, tokens=tokens, repeats=real_repeats, api_tok_s=tokens / api_s,
                       lip_tok_s=tokens / lip_s, api_same_work_tok_s=tokens / same_work_s,
                       ratio=statistics.median(a / b for a, b in zip(times["api"], times["lip"])),
                       ratio_same_work=statistics.median(a / b for a, b in zip(times["same_work"], times["lip"])),
                       # The spread of the paired ratios (their quartiles): how far the VM's noise
                       # moves one pair, against the few percent the median is read for.
                       ratio_quartiles=_quartiles(a / b for a, b in zip(times["api"], times["lip"])),
                       ratio_same_work_quartiles=_quartiles(a / b for a, b in zip(times["same_work"], times["lip"])),
                       ratio_of_medians=api_s / lip_s, ratio_same_work_of_medians=same_work_s / lip_s,
                       ratio_of_best=min(times["api"]) / min(times["lip"]),
                       ratio_from_host_time=(shared_forward + host["api"]) / (shared_forward + host["lip"]),
                       ratio_same_work_from_host_time=(shared_forward + host["same_work"])
                       / (shared_forward + host["lip"]),
                       forward_us_per_token=1e6 * shared_forward / tokens,
                       ratio_same_work_of_best=min(times["same_work"]) / min(times["lip"]),
                       identical_outputs=f"{same}/{batch}",
                       seconds={name: times[name] for name in runs},
                       # Host time per token outside the model's forward passes (sampling included):
                       # the part of each path the runtime's code decides, steadier than the ratios.
                       us_per_token_outside_forward={name: 1e6 * host[name] / tokens for name in runs})
            real_rows.append(row)
            spent = row["us_per_token_outside_forward"]
            print(f"hello x{batch}: {row['lip_tok_s']:.1f} tok/s vs API {row['api_tok_s']:.1f} ({row['ratio']:.3f}), "
                  f"vs API doing hello's work {row['api_same_work_tok_s']:.1f} ({row['ratio_same_work']:.3f}), "
                  f"identical {row['identical_outputs']}; outside the forward pass, us per token: LIP "
                  f"{spent['lip']:.0f}, API {spent['api']:.0f}, API doing hello's work {spent['same_work']:.0f}",
                  flush=True)

        untune_gc()

    print("\nPer-process cost of one suspend/batch/resume round, null model, steady state (target <= 20 us at 1024)")
    print(f"{'config':>10} | {'guest calls':>23} | {'processes':>9} | {'us/process/round':>16} | {'best batch':>10} | "
          f"{'mean batch':>10}")
    for r in null_rows:
        print(f"{r['config']:>10} | {r['calls']:>23} | {r['processes']:>9} | {r['us_per_process_round']:>16.1f} | "
              f"{r['us_per_process_round_best']:>10.1f} | {r['mean_batch_size']:>10.0f}")
    print(f"\nhello processes vs the engine's Python API, 50M random Llama, float32 CPU, {new_tokens} new tokens, "
          f"median of {real_repeats}; ratios: median of the paired runs' (target ratio >= 0.95). 'API' is host "
          "greedy; 'API, hello's work' also takes the full distribution, its argmax and a detokenize per token, "
          "as hello does")
    print(f"{'batch':>5} | {'LIP tok/s':>9} | {'API tok/s':>9} | {'ratio (quartiles)':>23} | {'API, hello work':>15} | "
          f"{'ratio (quartiles)':>23} | identical")
    for r in real_rows:
        (q1, q3), (w1, w3) = r["ratio_quartiles"], r["ratio_same_work_quartiles"]
        print(f"{r['batch']:>5} | {r['lip_tok_s']:>9.1f} | {r['api_tok_s']:>9.1f} | "
              f"{r['ratio']:>5.3f} ({q1:.3f}-{q3:.3f}) | {r['api_same_work_tok_s']:>15.1f} | "
              f"{r['ratio_same_work']:>5.3f} ({w1:.3f}-{w3:.3f}) | {r['identical_outputs']}")
    print("\nHost time per token outside the model's forward passes (sampling included), us (median of the same "
          "runs), and the ratios it gives with the forward time the paths share")
    print(f"{'batch':>5} | {'forward':>7} | {'LIP':>6} | {'API':>6} | {'API, hello work':>15} | {'ratio':>5} | "
          f"{'ratio, hello work':>17}")
    for r in real_rows:
        spent = r["us_per_token_outside_forward"]
        print(f"{r['batch']:>5} | {r['forward_us_per_token']:>7.0f} | {spent['lip']:>6.0f} | {spent['api']:>6.0f} | "
              f"{spent['same_work']:>15.0f} | {r['ratio_from_host_time']:>5.3f} | "
              f"{r['ratio_same_work_from_host_time']:>17.3f}")
    RESULTS.mkdir(exist_ok=True)
    out = dict(benchmark="hostcall", device="cpu", cpu=cpu_name(), python=python_build(),
               torch_threads=torch.get_num_threads(), null_model=null_rows, hello_vs_api=real_rows,
               quick=args.quick, when=time.strftime("%Y-%m-%d %H:%M:%S"))
    (RESULTS / "hostcall.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / 'hostcall.json'}")


if __name__ == "__main__":
    main()
