"""A real `symphony serve` app on a loopback port, for the server tests: uvicorn on a thread of
the test process, serving the stories260K model to seven tenants (alice, bob, carol and dave
without quotas, `tight` with small ones, `small` with room for a few short completions, `terse`
with little output per process), with a one-second grace period and input for a full inbox
waiting two seconds."""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import pytest
import uvicorn

from symphony_os.engine.loop import Engine
from symphony_os.server.app import ServerConfig, create_app
from symphony_os.server.tenants import Tenants

TOKENS = {name: f"token-of-{name}" for name in ("alice", "bob", "carol", "dave", "tight", "small", "terse")}
TIGHT_QUOTAS = dict(max_processes=1, max_kv_pages=2, max_kv_files=2, max_upload_bytes=4096, cpu_time_s=0.5)
SMALL_QUOTAS = dict(max_kv_pages=8, max_upload_bytes=400)
TERSE_QUOTAS = dict(output_bytes=4000)
QUOTAS = {"tight": TIGHT_QUOTAS, "small": SMALL_QUOTAS, "terse": TERSE_QUOTAS}
GRACE_S = 1.0
MAX_UPLOAD_BYTES = 1 << 20
INPUT_WAIT_S = 2.0  # a message for a full inbox waits this long (30 s by default)


@dataclass
class Served:
    url: str
    engine: Engine
    app: object


def tenants_toml() -> str:
    lines = []
    for name, token in TOKENS.items():
        lines += [f"[tenants.{name}]", f'token = "{token}"']
        lines += [f"{key} = {value}" for key, value in QUOTAS.get(name, {}).items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def served(stories_path, tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve")
    (directory / "tenants.toml").write_text(tenants_toml())
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=4096)
    config = ServerConfig(grace_s=GRACE_S, data_dir=directory / "programs", max_upload_bytes=MAX_UPLOAD_BYTES,
                          input_wait_s=INPUT_WAIT_S)
    app = create_app(engine, Tenants.from_file(directory / "tenants.toml"), config)
    with serving(app) as url:
        yield Served(url, engine, app)


@contextlib.contextmanager
def serving(app):
    """uvicorn serving `app` on a free loopback port, on a thread of its own; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)


def wait_until(condition, timeout_s: float = 30.0, interval_s: float = 0.05):
    """Poll `condition` until it is truthy (returns it) or the time is up (returns the last value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
