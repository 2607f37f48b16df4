"""bench/round_bytecodes.py runs at a small size and counts a round for both kinds of guest."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_round_bytecodes_counts_a_round_of_each_guest(tmp_path):
    out = tmp_path / "round_bytecodes.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "round_bytecodes.py"), "--processes", "4", "--out",
                          str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["calls"] for row in rows] == ["pred", "pred_submit + pred_wait"]
    # A round runs the guest's call through the runtime, the system call and a batch: hundreds of
    # bytecodes, and the two-call guest more than the one-call guest.
    assert 200 < rows[0]["bytecodes_per_process_round"] < rows[1]["bytecodes_per_process_round"]
    # Both guests' decode steps take the fast way (lip/process.py), not the system-call layer.
    assert "process.py:Process._fast_pred" in rows[0]["by_function"]
    assert {"process.py:Process._fast_pred_submit", "process.py:Process._fast_pred_wait"} <= set(rows[1]["by_function"])
    assert not any("syscalls.py" in name for row in rows for name in row["by_function"])
