"""bench/overlap.py runs at a small size: both measurements, both paths, identical outputs."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_overlap_measures_both_paths_on_the_model_and_the_simulated_device(tmp_path):
    out = tmp_path / "overlap.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "overlap.py"), "--processes", "1,3", "--repeats", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    for part in ("real_model", "simulated_device"):
        assert [row["processes"] for row in result[part]] == [1, 3]
        for row in result[part]:
            assert row["identical"] and row["tokens"] > 0 and row["lip_tok_s"] > 0 and row["api_tok_s"] > 0
            assert set(row["host_us_per_token"]) == {"lip", "api"}
