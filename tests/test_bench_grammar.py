"""bench/grammar.py runs at a small size: mask times and both decode rates, written as JSON."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_grammar_bench_measures_masks_and_both_decode_rates(tmp_path):
    out = tmp_path / "grammar.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "grammar.py"), "--quick", "--batches", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["masks"]["masks"] > 20 and 0 < result["masks"]["p50_us"] <= result["masks"]["p99_us"]
    [row] = result["decode"]
    assert row["batch"] == 1 and row["unconstrained_tok_s"] > 0 and row["constrained_tok_s"] > 0
