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
    # A round runs the guest's decode step to the engine and a batch: hundreds of bytecodes. Both
    # guests' steps take the decode lane (fiber_native.c): C answers them and resumes the guests,
    # Python only queues the preds, so the two-call guest costs what the one-call guest costs,
    # with no fast handler in Python and nothing of the system-call layer.
    for row in rows:
        assert 200 < row["bytecodes_per_process_round"]
        assert "process.py:submit_lane_requests" in row["by_function"]
        assert not any(name.startswith("process.py:Process._fast_pred") for name in row["by_function"])
    assert rows[0]["bytecodes_per_process_round"] == rows[1]["bytecodes_per_process_round"]
    assert not any("syscalls.py" in name for row in rows for name in row["by_function"])
