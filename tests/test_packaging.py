"""An installed wheel runs without the checkout beside it: everything the package reads at run
time (the default model, the built-in LIPs' sources, the C SDK header they include, the
component WIT) ships inside it."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from click.testing import CliRunner
from test_python_sdk import python_lip

from symphony_os.cli import main

ROOT = Path(__file__).resolve().parent.parent

# Runs the installed copy, from a directory outside the checkout; fails if the checkout's was imported.
INSTALLED = """
import sys
from pathlib import Path
import symphony_os
site = Path(sys.argv.pop(1))
assert Path(symphony_os.__file__).is_relative_to(site), f"imported {symphony_os.__file__}, not the wheel's"
"""
RUN = INSTALLED + """
from symphony_os.cli import main
main()
"""
COMPLETE = INSTALLED + """
from fastapi.testclient import TestClient
from symphony_os.engine.loop import Engine
from symphony_os.model.loader import default_model_path
from symphony_os.server.app import create_app
engine = Engine.from_path(default_model_path(), device="cpu", num_pages=256)
with TestClient(create_app(engine), base_url="http://localhost") as client:  # an open server answers its own names
    response = client.post("/v1/completions", json={"model": engine.loaded.name, "prompt": "def main():",
                                                     "max_tokens": 8})
assert response.status_code == 200, response.text
print(response.json()["choices"][0]["text"])
"""


def _source_copy(directory: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore) copied to `directory`, links
    as links: a build in the checkout itself would ship what an earlier build left in build/."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source, target = ROOT / name, directory / name
        if source.is_symlink() or source.is_file():  # a deleted file git still lists is skipped
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)
    return directory


def test_an_installed_wheel_runs_python_lips_and_serves_completions(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(_source_copy(tmp_path / "source"))], check=True, capture_output=True)
    site = tmp_path / "site"
    with zipfile.ZipFile(next(wheels.glob("symphony_os-*.whl"))) as wheel:
        wheel.extractall(site)
    # The wheel's package ahead of the checkout's; a fresh cache, so the built-in LIP is compiled
    # here (zig keeps its own: its wasi-libc build takes ~20 s).
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    env = {**os.environ, "PYTHONPATH": str(site), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "ZIG_GLOBAL_CACHE_DIR": os.environ.get("ZIG_GLOBAL_CACHE_DIR", str(cache / "zig"))}
    env.pop("SYMPHONY_MODEL", None)

    lip = str(python_lip("hello"))
    installed = subprocess.run([sys.executable, "-c", RUN, str(site), "run", lip, "--", "Once upon a time", "8"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    in_checkout = CliRunner().invoke(main, ["run", lip, "--", "Once upon a time", "8"])
    assert in_checkout.exit_code == 0, in_checkout.output
    assert installed.stdout == in_checkout.output and installed.stdout.strip()

    served = subprocess.run([sys.executable, "-c", COMPLETE, str(site)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert served.returncode == 0, served.stderr
    assert served.stdout.strip()
