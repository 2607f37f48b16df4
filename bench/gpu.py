"""Decode and prefill throughput on a GPU: Llama-3-8B- and 1B-shaped models with random bf16
weights built on the device, against transformers' `generate` on the same weights (the
Hugging Face model's parameters are views of ours) in the same run, and against the HBM roofline.

    python bench/gpu.py [--models 8b,1b] [--batches 1,8,32,128,256] [--out DIR]

Per model and batch size B: B random prompts of --prompt-len tokens, greedy, --new-tokens new
tokens each through the engine (`Engine.submit` per sequence per step, as a LIP drives it).
Prefill throughput is B * prompt-len over the time to the first token; decode throughput counts
the remaining tokens over the remaining time. "forward" is the engine's own forward + sampling
time (EngineStats.forward_s); the rest of a step is host work, split per sequence into the
bench's submits, the engine's own bookkeeping and the bench's reading of the results.

Roofline: a decode step reads each weight once (of the embedding table only the batch's rows)
and every sequence's cached K/V; its floor is those bytes over the device-to-device bandwidth
measured here (a large copy_, counting the bytes read plus the bytes written).

transformers runs `generate` (DynamicCache, sdpa) with at most --hf-new-tokens new tokens
(--hf-new-tokens-8b-large for the 8B at batch >= 128, where it is slow); its decode slows as its
cache grows, so fewer steps flatter it a little. Prints a table; writes gpu-<device>.json.
`--models tiny --device cpu` checks the script without a GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from symphony_os.engine.gc_tuning import tune_gc, untune_gc
from symphony_os.engine.loop import Engine
from symphony_os.engine.sampling import Distribution
from symphony_os.model.decoder import DecoderModel, ModelConfig, rope_inv_freq
from symphony_os.model.loader import LoadedModel

RESULTS = Path(__file__).resolve().parent / "results"

SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=1024, tie_word_embeddings=False),
}
PAGE_SIZE = 16


def copy_bandwidth(device: torch.device, nbytes: int = 2**31) -> float:
    """Device-to-device bytes per second of a large copy_, reads plus writes, median of 10."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start = time.perf_counter()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            elapsed = begin.elapsed_time(end) / 1e3
        else:
            dst.copy_(src)
            elapsed = time.perf_counter() - start
        if i >= 3:
            times.append(elapsed)
    assert torch.equal(dst[:4096], src[:4096])
    return 2 * nbytes / statistics.median(times)


def build_models(shape: dict, device: torch.device):
    """A random bf16 Llama built on `device`: (transformers' model, our LoadedModel) sharing
    the weights. Our fused q/k/v and gate/up matrices are concatenated once; transformers'
    projections then become views of them."""
    config = LlamaConfig(**shape, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf = hf.to(device).eval()  # a no-op where transformers honoured the device context
    cfg = ModelConfig.from_hf(config)
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    weights = {"embed": hf.model.embed_tokens.weight.data, "norm": hf.model.norm.weight.data,
               "lm_head": hf.lm_head.weight.data}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            for proj, view in zip((attn.q_proj, attn.k_proj, attn.v_proj), qkv.split([q_size, kv_size, kv_size])):
                proj.weight = torch.nn.Parameter(view, requires_grad=False)
            for proj, view in zip((mlp.gate_proj, mlp.up_proj), gate_up.chunk(2)):
                proj.weight = torch.nn.Parameter(view, requires_grad=False)
            weights.update({
                f"layers.{i}.input_norm": layer.input_layernorm.weight.data, f"layers.{i}.qkv": qkv,
                f"layers.{i}.o": attn.o_proj.weight.data, f"layers.{i}.post_norm": layer.post_attention_layernorm.weight.data,
                f"layers.{i}.gate_up": gate_up, f"layers.{i}.down": mlp.down_proj.weight.data,
            })
    model = DecoderModel(cfg, weights, *rope_inv_freq(config))
    loaded = LoadedModel(name="random-llama", path=Path("."), model=model, config=cfg, tokenizer=None,
                         eos_token_ids=(), bos_token_id=None)
    return hf, loaded


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(engine: Engine, prompts: torch.Tensor, new_tokens: int):
    """(seconds to the first token, seconds for the rest, forward seconds of the rest, tokens,
    {submit_s, results_s}: of the rest, the bench's own submits and reading of the results)."""
    kv = engine.session()
    handles = [kv.create() for _ in range(len(prompts))]
    feeds = prompts.tolist()
    out: list[list[int]] = [[] for _ in feeds]
    sync(engine.pool.device)
    start = time.perf_counter()
    first = forward_before = submit_s = results_s = 0.0
    for step in range(new_tokens):
        if step == 1:
            first = time.perf_counter() - start
            forward_before = engine.stats().forward_s
        submitting = time.perf_counter()
        futures = [engine.submit(kv, h, f) for h, f in zip(handles, feeds)]
        stepping = time.perf_counter()
        engine.run_until_idle()
        reading = time.perf_counter()
        for i, future in enumerate(futures):
            out[i].append(future.result().token)
            feeds[i] = [out[i][-1]]
        if step >= 1:
            submit_s += stepping - submitting
            results_s += time.perf_counter() - reading
    total = time.perf_counter() - start
    forward = engine.stats().forward_s - forward_before
    kv.close_all()
    return first, total - first, forward, out, dict(submit_s=submit_s, results_s=results_s)


def run_transformers(hf, prompts: torch.Tensor, new_tokens: int, device: torch.device):
    """(seconds for `generate` of 1 token, seconds for the rest, tokens)."""
    ids = prompts.to(device)

    def generate(n):
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        sync(device)
        return time.perf_counter() - start, out

    first, _ = generate(1)
    total, out = generate(new_tokens)
    return first, total - first, out[:, prompts.shape[1]:].tolist()


def check_against_transformers(engine: Engine, hf, prompt: list[int], device: torch.device) -> dict:
    """Next-token distributions of one prompt from both models."""
    kv = engine.session()
    ours = engine.pred(kv, kv.create(), prompt, want=Distribution()).probs
    kv.close_all()
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt], device=device)).logits[0, -1].float().softmax(-1).cpu()
    return dict(max_abs_prob_diff=float((ours - theirs).abs().max()), same_argmax=bool(ours.argmax() == theirs.argmax()))


def profile_decode_step(engine: Engine, prompts: torch.Tensor, path: Path) -> dict:
    """Kernel times of one eager decode step (graphs off), summed by kind, into `path`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    kv = engine.session()
    handles = [kv.create() for _ in range(len(prompts))]
    prefills = [engine.submit(kv, h, p) for h, p in zip(handles, prompts.tolist())]
    engine.run_until_idle()
    feeds = [[f.result().token] for f in prefills]
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            futures = [engine.submit(kv, h, f) for h, f in zip(handles, feeds)]
            engine.run_until_idle()
            for future in futures:
                future.result()
    finally:
        engine.runner.graphs = graphs
        kv.close_all()
    kinds: dict[str, float] = {}
    launches = 0
    for event in prof.key_averages():
        if event.device_type != DeviceType.CUDA:
            continue
        name = event.key.lower()
        kind = ("gemm" if any(s in name for s in ("gemm", "gemv", "nvjet", "cutlass", "xmma")) else
                "attention" if "decode_kernel" in name or "combine_splits" in name else
                "sampling" if "sample" in name or "process_logits" in name else "other")
        kinds[kind] = kinds.get(kind, 0.0) + event.self_device_time_total / 1e3
        launches += event.count
    path.write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
    return dict(batch=len(prompts), kernel_ms_by_kind=kinds, kernel_ms=sum(kinds.values()), kernel_launches=launches)


def profile_host(engine: Engine, prompts: torch.Tensor, path: Path, steps: int = 5) -> None:
    """cProfile of `steps` decode steps (graphs on), the functions with the most own time, into `path`."""
    import cProfile
    import io
    import pstats

    kv = engine.session()
    handles = [kv.create() for _ in range(len(prompts))]
    prefills = [engine.submit(kv, h, p) for h, p in zip(handles, prompts.tolist())]
    engine.run_until_idle()
    feeds = [[f.result().token] for f in prefills]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        futures = [engine.submit(kv, h, f) for h, f in zip(handles, feeds)]
        engine.run_until_idle()
        feeds = [[f.result().token] for f in futures]
    profiler.disable()
    kv.close_all()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    path.write_text(text.getvalue())


def bench_model(name: str, args, device: torch.device, bandwidth: float, out_dir: Path) -> dict:
    shape = SHAPES[name]
    started = time.perf_counter()
    hf, loaded = build_models(shape, device)
    cfg = loaded.config
    weight_bytes = 2 * (cfg.num_params - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size))
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    batches = [int(b) for b in args.batches.split(",")]
    pages_per_seq = -(-(args.prompt_len + args.new_tokens + 1) // PAGE_SIZE)
    engine = Engine(loaded, page_size=PAGE_SIZE, num_pages=max(batches) * pages_per_seq + 64,
                    token_budget=args.token_budget, max_batch_size=max(batches))
    print(f"{name}: {cfg.num_params / 1e9:.2f}B params built in {time.perf_counter() - started:.1f} s; "
          f"attention {engine.backend.name}, graphs {'on' if engine.runner.graphs else 'off'}", flush=True)
    generator = torch.Generator().manual_seed(1)
    check = check_against_transformers(engine, hf, torch.randint(3, cfg.vocab_size, (args.prompt_len,),
                                                                  generator=generator).tolist(), device)
    # As a serving process runs (gc_tuning.py): what is built is frozen out of the cyclic GC, whose
    # full collections over these objects otherwise land inside timed steps (both paths alike).
    tune_gc()
    rows = []
    for batch in batches:
        prompts = torch.randint(3, cfg.vocab_size, (batch, args.prompt_len), generator=generator)
        hf_new_tokens = min(args.new_tokens, args.hf_new_tokens_8b_large if name == "8b" and batch >= 128
                            else args.hf_new_tokens)
        # Warm-ups on the measured prompts: Triton specializes kernels on integer arguments equal to
        # 1 or divisible by 16 (a page table's width among them), so shorter prompts left a compile
        # (0.8 s) inside the timed prefill. The engine's warm-up also captures this size's graph.
        run_engine(engine, prompts, 2)
        first, rest, forward, ours, host = run_engine(engine, prompts, args.new_tokens)
        run_transformers(hf, prompts, 2, device)
        hf_first, hf_rest, theirs = run_transformers(hf, prompts, hf_new_tokens, device)
        decode_steps = args.new_tokens - 1
        mean_context = args.prompt_len + args.new_tokens / 2  # decode step s sees prompt + s tokens
        step_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token
        roofline = batch / (step_bytes / bandwidth)
        row = dict(
            batch=batch,
            decode_tok_s=batch * decode_steps / rest,
            forward_tok_s=batch * decode_steps / forward,
            hf_decode_tok_s=batch * (hf_new_tokens - 1) / hf_rest,
            roofline_tok_s=roofline,
            prefill_tok_s=batch * args.prompt_len / first,
            hf_prefill_tok_s=batch * args.prompt_len / hf_first,
            hf_new_tokens=hf_new_tokens,
            step_ms=1e3 * rest / decode_steps,
            forward_step_ms=1e3 * forward / decode_steps,
            roofline_step_ms=1e3 * step_bytes / bandwidth,
            # The step outside the forward, per sequence: the bench's submits, the engine's own
            # bookkeeping (schedule, reserve slots, finish) and the bench's reading of the results.
            host_submit_us_per_seq=1e6 * host["submit_s"] / (batch * decode_steps),
            host_engine_us_per_seq=1e6 * (rest - forward - host["submit_s"] - host["results_s"]) / (batch * decode_steps),
            host_results_us_per_seq=1e6 * host["results_s"] / (batch * decode_steps),
            same_greedy_tokens=f"{sum(a[:hf_new_tokens] == b for a, b in zip(ours, theirs))}/{batch}",
        )
        row.update(roofline_fraction=row["decode_tok_s"] / roofline,
                   forward_roofline_fraction=row["forward_tok_s"] / roofline,
                   decode_ratio_to_hf=row["decode_tok_s"] / row["hf_decode_tok_s"],
                   prefill_ratio_to_hf=row["prefill_tok_s"] / row["hf_prefill_tok_s"])
        rows.append(row)
        print(f"  batch {batch}: decode {row['decode_tok_s']:.0f} tok/s ({row['roofline_fraction']:.0%} of roofline "
              f"{roofline:.0f}; forward alone {row['forward_roofline_fraction']:.0%}), "
              f"transformers {row['hf_decode_tok_s']:.0f} ({row['decode_ratio_to_hf']:.2f}x); "
              f"prefill {row['prefill_tok_s']:.0f} vs {row['hf_prefill_tok_s']:.0f} tok/s; host per sequence "
              f"{row['host_submit_us_per_seq']:.1f} submit + {row['host_engine_us_per_seq']:.1f} engine + "
              f"{row['host_results_us_per_seq']:.1f} results us", flush=True)
    profiles = []
    if name in args.profile.split(",") and device.type == "cuda":
        for batch in (1, 128):
            if batch <= max(batches):
                prompts = torch.randint(3, cfg.vocab_size, (batch, args.prompt_len), generator=generator)
                profiles.append(profile_decode_step(engine, prompts, out_dir / f"profile-{name}-b{batch}.txt"))
                if batch == 128:
                    profile_host(engine, prompts, out_dir / f"host-profile-{name}-b{batch}.txt")
    untune_gc()
    result = dict(model=name, shape=shape, params=cfg.num_params, weight_bytes_per_step=weight_bytes,
                  kv_bytes_per_token=kv_bytes_per_token, check_vs_transformers=check,
                  captured_graph_sizes=engine.runner.graphs.captured_sizes if engine.runner.graphs else [],
                  eager_step_profiles=profiles, rows=rows, seconds=time.perf_counter() - started)
    del engine, loaded, hf
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def print_table(results: dict) -> None:
    header = (f"{'model':>5} {'batch':>5} | {'decode tok/s':>12} | {'roofline':>8} | {'frac':>5} | {'fwd frac':>8} | "
              f"{'hf decode':>9} | {'x hf':>5} | {'prefill tok/s':>13} | {'hf prefill':>10} | {'x hf':>5} | same")
    print(f"\n{results['device_name']}: copy bandwidth {results['copy_bandwidth_gb_s']:.0f} GB/s; prompt "
          f"{results['prompt_len']}, {results['new_tokens']} new tokens, greedy, bf16")
    print(header)
    print("-" * len(header))
    for model in results["models"]:
        for r in model["rows"]:
            print(f"{model['model']:>5} {r['batch']:>5} | {r['decode_tok_s']:>12.0f} | {r['roofline_tok_s']:>8.0f} | "
                  f"{r['roofline_fraction']:>5.0%} | {r['forward_roofline_fraction']:>8.0%} | {r['hf_decode_tok_s']:>9.0f} | "
                  f"{r['decode_ratio_to_hf']:>5.2f} | {r['prefill_tok_s']:>13.0f} | {r['hf_prefill_tok_s']:>10.0f} | "
                  f"{r['prefill_ratio_to_hf']:>5.2f} | {r['same_greedy_tokens']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="8b,1b")
    parser.add_argument("--batches", default="1,8,32,128,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-new-tokens", type=int, default=32)
    parser.add_argument("--hf-new-tokens-8b-large", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--profile", default="", help="models (e.g. 8b) to profile at batch 1 and 128: kernel "
                        "times of one eager decode step, and the host's own time over a few steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = copy_bandwidth(device, 2**31 if device.type == "cuda" else 2**26)
    print(f"{device_name}: device-to-device copy {bandwidth / 1e9:.0f} GB/s", flush=True)
    import transformers
    import triton
    results = dict(benchmark="gpu", device_name=device_name, copy_bandwidth_gb_s=bandwidth / 1e9,
                   torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                   prompt_len=args.prompt_len, new_tokens=args.new_tokens, page_size=PAGE_SIZE, models=[],
                   when=time.strftime("%Y-%m-%d %H:%M:%S"))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-{device_name.replace(' ', '_')}.json"
    for name in args.models.split(","):
        try:
            results["models"].append(bench_model(name, args, device, bandwidth, args.out))
        except Exception as error:  # record it and go on to the next model
            traceback.print_exc()
            results.setdefault("errors", {})[name] = repr(error)
        path.write_text(json.dumps(results, indent=2) + "\n")  # after each model: a later failure keeps it
    print_table(results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
