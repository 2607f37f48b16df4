"""bench/start_bytecodes.py runs at a small size and counts a process's start."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_start_bytecodes_counts_a_processs_start_to_its_prompts_pred(tmp_path):
    out = tmp_path / "start_bytecodes.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "start_bytecodes.py"), "--processes", "4", "--out",
                          str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    # Spawning, instantiating and running a guest to its first pred: thousands of bytecodes, the
    # process's own construction and the prompt's pred among them, and no Instance.exports (the
    # start looks up its two exports itself: fiber.instance_export).
    assert result["processes"] == 4 and 1000 < result["bytecodes_per_process"]
    names = " ".join(result["by_function"])
    assert "process.py" in names and "loop.py" in names and "_instance.py" not in names
