"""Decode and prefill throughput of Symphony's engine against transformers' `generate`, on the
same random ~50M-parameter Llama, in one run.

    python bench/engine.py [--quick] [--batches 1,8,32] [--device cpu]

Each side does the same work per batch size: B prompts of --prompt-len random tokens, greedy,
--new-tokens new tokens each. Prefill time is the time to the first new token; decode
throughput counts the remaining tokens over the remaining time. Prints a table and writes
bench/results/engine-<device>.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from symphony_os.engine.gc_tuning import tune_gc
from symphony_os.engine.loop import Engine
from symphony_os.model.loader import load_model
from symphony_os.model.random_model import build_random_model

RESULTS = Path(__file__).resolve().parent / "results"

BENCH_SHAPE = dict(vocab_size=24576, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                   tie_word_embeddings=False)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for results taken on more than one kind of VM."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def python_build() -> str:
    """The interpreter the results were taken with, and whether its libpython is a shared
    library (pyenv's default build: shared, no PGO; Debian's python3.11: static, PGO+LTO, and
    10% faster on the LIP round, bench/NOTES.md)."""
    try:  # what this process mapped (sysconfig's Py_ENABLE_SHARED is 1 for Debian's static binary too)
        linkage = "shared" if "libpython" in Path("/proc/self/maps").read_text() else "static"
    except OSError:
        linkage = "unknown"
    return f"{platform.python_implementation()} {platform.python_version()}, {sys.executable}, {linkage} libpython"


def make_model(directory: Path, dtype: torch.dtype) -> None:
    build_random_model(directory, "llama", seed=0, dtype=dtype, **BENCH_SHAPE)


def run_engine(engine: Engine, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """Seconds to the first token, seconds for the rest, and the generated tokens."""
    kv = engine.session()
    handles = [kv.create() for _ in range(len(prompts))]
    feeds = prompts.tolist()
    out: list[list[int]] = [[] for _ in feeds]
    start = time.perf_counter()
    first = 0.0
    for step in range(new_tokens):
        futures = [engine.submit(kv, h, f) for h, f in zip(handles, feeds)]
        engine.run_until_idle()
        for i, fut in enumerate(futures):
            out[i].append(fut.result().token)
            feeds[i] = [out[i][-1]]
        if step == 0:
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    kv.close_all()
    return first, total - first, out


def run_transformers(model, prompts: torch.Tensor, new_tokens: int, device) -> tuple[float, float, list[list[int]]]:
    ids = prompts.to(device)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def generate(n):
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out

    first, _ = generate(1)
    total, out = generate(new_tokens)
    return first, total - first, out[:, prompts.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--quick", action="store_true", help="fewer new tokens")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens = 16
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    batches = [int(b) for b in args.batches.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), dtype)
        loaded = load_model(tmp, dtype=dtype, device=str(device))
        reference = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
    engine = Engine(loaded, page_size=16, num_pages=(max(batches) * (args.prompt_len + args.new_tokens)) // 16 + 64,
                    token_budget=4096, max_batch_size=512)
    params = loaded.config.num_params

    tune_gc()  # as a serving process runs (gc_tuning.py); both paths alike
    rows = []
    torch.manual_seed(1)
    for batch in batches:
        prompts = torch.randint(3, BENCH_SHAPE["vocab_size"], (batch, args.prompt_len))
        # Warm both up once at this batch size (allocator, kernels), then measure.
        run_engine(engine, prompts, 2)
        run_transformers(reference, prompts, 2, device)
        e_first, e_rest, e_out = run_engine(engine, prompts, args.new_tokens)
        t_first, t_rest, t_out = run_transformers(reference, prompts, args.new_tokens, device)
        decode_tokens = batch * (args.new_tokens - 1)
        prefill_tokens = batch * args.prompt_len
        same = sum(a == b for a, b in zip(e_out, t_out))
        row = dict(
            batch=batch,
            engine_decode_tok_s=decode_tokens / e_rest, transformers_decode_tok_s=decode_tokens / t_rest,
            engine_prefill_tok_s=prefill_tokens / e_first, transformers_prefill_tok_s=prefill_tokens / t_first,
            sequences_with_identical_tokens=f"{same}/{batch}",
        )
        row["decode_ratio"] = row["engine_decode_tok_s"] / row["transformers_decode_tok_s"]
        row["prefill_ratio"] = row["engine_prefill_tok_s"] / row["transformers_prefill_tok_s"]
        rows.append(row)
        print(f"batch {batch}: decode {row['engine_decode_tok_s']:.0f} vs {row['transformers_decode_tok_s']:.0f} tok/s "
              f"({row['decode_ratio']:.2f}x), prefill {row['prefill_ratio']:.2f}x", flush=True)

    header = f"{'batch':>5} | {'decode tok/s':>12} | {'hf decode':>9} | {'ratio':>5} | {'prefill tok/s':>13} | {'hf prefill':>10} | {'ratio':>5} | same tokens"
    print(f"\nSymphony engine vs transformers generate: {params / 1e6:.1f}M-param Llama, {dtype}, {device}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['batch']:>5} | {r['engine_decode_tok_s']:>12.1f} | {r['transformers_decode_tok_s']:>9.1f} | "
              f"{r['decode_ratio']:>5.2f} | {r['engine_prefill_tok_s']:>13.1f} | {r['transformers_prefill_tok_s']:>10.1f} | "
              f"{r['prefill_ratio']:>5.2f} | {r['sequences_with_identical_tokens']}")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    out = dict(
        benchmark="engine", device=str(device), device_name=device_name, python=python_build(),
        torch_threads=torch.get_num_threads(),
        dtype=str(dtype), params=params, shape=BENCH_SHAPE, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        attention_backend=engine.backend.name, rows=rows,
        when=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    RESULTS.mkdir(exist_ok=True)
    name = "engine-cpu.json" if device.type == "cpu" else f"engine-{device_name.replace(' ', '_')}.json"
    (RESULTS / name).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
