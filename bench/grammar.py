"""The grammar path (engine/grammar.py over llguidance), on the default model
(SmolLM2-135M-Instruct, a 49,152-token vocabulary; stories260K when its package is missing):

1. mask time per token: for each JSON schema of a set, a matcher decodes a document (each
   step: the mask of allowed tokens, then one allowed token, chosen by a seeded draw), and every
   mask's time is kept; p50, p99 and max over all of them.
2. constrained against unconstrained decoding on the same engine: B sequences, greedy, the same
   number of tokens each (the grammar a regex that allows any text of letters and spaces, so
   that neither side stops early; a counted repetition, [a-zA-Z ]{0,100000}, took ~500 us a mask
   where the star takes ~2), tokens/s with and without the grammar, alternated, the best
   of three each.

    python bench/grammar.py [--quick] [--batches 1,8]

Prints a table and writes bench/results/grammar.json.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from engine import cpu_name  # noqa: E402  (bench/engine.py)

from symphony_os.engine import Engine  # noqa: E402
from symphony_os.engine.grammar import GrammarKind, allowed_tokens, bitmask_words  # noqa: E402
from symphony_os.engine.sampling import Sample  # noqa: E402
from symphony_os.model.loader import instruct_model_path  # noqa: E402

RESULTS = ROOT / "bench" / "results"
STORIES = ROOT.parent / "shared" / "models" / "stories260K"
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "additionalProperties": False, "required": ["name", "pet"],
     "properties": {"name": {"type": "string", "maxLength": 12},
                    "pet": {"type": "object", "required": ["kind", "age"],
                            "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "age": {"type": "integer"}}}}},
    {"type": "object", "required": ["tags", "done"],
     "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 5},
                    "done": {"type": "boolean"}, "score": {"type": "number"}}},
    {"type": "array", "items": {"type": "object", "required": ["id", "city"],
                                "properties": {"id": {"type": "integer"},
                                               "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]},
                                               "note": {"type": "string", "maxLength": 20}}},
     "minItems": 1, "maxItems": 4},
]


def mask_times(engine: Engine, steps: int, seed: int = 0) -> list[float]:
    """Seconds per mask, over documents decoded under each schema by seeded draws."""
    rng = random.Random(seed)
    vocab = engine.loaded.config.vocab_size
    times = []
    for schema in SCHEMAS:
        grammar = engine.grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))
        mask = torch.empty(bitmask_words(vocab), dtype=torch.int32)
        for _ in range(steps):
            if grammar.stopped:
                break
            started = time.perf_counter()
            grammar.allowed_bitmask(mask)
            times.append(time.perf_counter() - started)
            allowed = allowed_tokens(mask, vocab).nonzero().flatten().tolist()
            eos = set(engine.loaded.eos_token_ids)
            choices = [token for token in allowed if token not in eos] or allowed
            grammar.consume(rng.choice(choices))
    return times


def decode_rate(engine: Engine, batch: int, tokens: int, constrained: bool) -> float:
    """Tokens/s of `batch` greedy sequences of `tokens` new tokens each."""
    session = engine.session()
    prompt = engine.tokenize("Once upon a time", add_special_tokens=False)
    handles = [session.create() for _ in range(batch)]
    wants = [Sample(grammar=engine.grammar(GrammarKind.REGEX, "[a-zA-Z ]*")) if constrained else Sample()
             for _ in range(batch)]
    last = [f.token for f in [engine.pred(session, h, prompt, want=w) for h, w in zip(handles, wants)]]
    started = time.perf_counter()
    for _ in range(tokens - 1):
        futures = [engine.submit(session, h, [t], want=w) for h, t, w in zip(handles, last, wants)]
        engine.run_until_idle()
        last = [f.result().token for f in futures]
    elapsed = time.perf_counter() - started
    session.close_all()
    return batch * (tokens - 1) / elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and tokens (a test's run)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--out", type=Path, default=RESULTS / "grammar.json")
    args = parser.parse_args()
    model = instruct_model_path() or STORIES
    engine = Engine.from_path(model, device="cpu", page_size=16, num_pages=512)
    steps, tokens = (40, 8) if args.quick else (200, 48)
    times = mask_times(engine, steps)
    masks = {"masks": len(times), "p50_us": 1e6 * percentile(times, 0.5), "p99_us": 1e6 * percentile(times, 0.99),
             "max_us": 1e6 * max(times)}
    rows = []
    decode_rate(engine, 1, 4, constrained=True)  # warm: the model's first passes, llguidance's tokenizer
    for batch in (int(b) for b in args.batches.split(",")):
        # Alternated, best of three each: this VM's timings drift (bench/NOTES.md).
        free, held = [], []
        for _ in range(3):
            free.append(decode_rate(engine, batch, tokens, constrained=False))
            held.append(decode_rate(engine, batch, tokens, constrained=True))
        rows.append({"batch": batch, "unconstrained_tok_s": max(free), "constrained_tok_s": max(held),
                     "ratio": max(held) / max(free)})
    print(f"mask time per token, {engine.loaded.name} (vocab {engine.loaded.config.vocab_size}), "
          f"{len(SCHEMAS)} JSON schemas, {masks['masks']} masks: p50 {masks['p50_us']:.0f} us, "
          f"p99 {masks['p99_us']:.0f} us, max {masks['max_us']:.0f} us")
    print("batch | unconstrained tok/s | constrained tok/s | ratio")
    for row in rows:
        print(f"{row['batch']:5d} | {row['unconstrained_tok_s']:19.1f} | {row['constrained_tok_s']:17.1f} | "
              f"{row['ratio']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": engine.loaded.name, "cpu": cpu_name(), "quick": args.quick,
                                    "masks": masks, "decode": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
