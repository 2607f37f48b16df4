"""bench/gpu.py at its tiny shape on the CPU: the script a lent GPU runs first must work before one
is lent. Both paths generate, the engine's distribution matches transformers', and the JSON has
every row, with the host's share of a step. No timing asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"


def test_gpu_bench_runs_at_a_tiny_shape_on_cpu(tmp_path):
    run = subprocess.run([sys.executable, str(BENCH), "--models", "tiny", "--device", "cpu", "--batches", "1,3",
                          "--prompt-len", "16", "--new-tokens", "4", "--hf-new-tokens", "4", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert "errors" not in results, results["errors"]
    (model,) = results["models"]
    assert model["check_vs_transformers"]["max_abs_prob_diff"] < 1e-3  # bf16, as on the GPU
    assert [row["batch"] for row in model["rows"]] == [1, 3]
    for row in model["rows"]:
        assert row["decode_tok_s"] > 0 and row["hf_decode_tok_s"] > 0 and row["roofline_tok_s"] > 0
        assert row["host_submit_us_per_seq"] > 0 and row["host_results_us_per_seq"] > 0
        # Greedy sequences may part at a bf16 near-tie of random weights: only the count's form.
        same, batch = map(int, row["same_greedy_tokens"].split("/"))
        assert batch == row["batch"] and 0 <= same <= batch
