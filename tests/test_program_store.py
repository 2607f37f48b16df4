"""Uploaded programs (symphony_os/server/program_store.py): shared compiled code, tenants' own names,
private files."""
import hashlib
import stat

from guests import wat

from symphony_os.lip.runtime import Runtime
from symphony_os.server.program_store import ProgramStore

# Sends its argv[0] (WASI args_get; run it with one argument: argv[1] marks argv[0]'s end).
ARGV0 = wat('''(module
  (import "wasi_snapshot_preview1" "args_sizes_get" (func $sizes (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_get" (func $get (param i32 i32) (result i32)))
  (import "symphony" "send" (func $send (param i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start") (local $p i32)
    (drop (call $sizes (i32.const 0) (i32.const 4)))
    (drop (call $get (i32.const 16) (i32.const 1024)))
    (local.set $p (i32.load (i32.const 16)))
    (drop (call $send (local.get $p) (i32.sub (i32.load (i32.const 20)) (i32.add (local.get $p) (i32.const 1)))))))''')


def test_each_tenant_runs_shared_bytes_under_its_own_name(tiny_engine, tmp_path):
    """The compiled module is shared, but not the first uploader's name: bob's process of the
    bytes alice uploaded as 'alice-secret' saw that name as its argv[0]."""
    with Runtime(tiny_engine) as runtime:
        store = ProgramStore(runtime.wasm_engine, tmp_path / "programs")
        alice = store.add("alice", ARGV0, "alice-secret", None)
        bob = store.add("bob", ARGV0, "bobs-name", None)
        assert alice.sha256 == bob.sha256 and bob.name == "bobs-name"
        out = []
        process = runtime.spawn(store.program("bob", bob.sha256), ["x"], tenant="bob", on_output=out.append)
        assert runtime.wait(process, 30) == 0, process.end_reason
    assert out == [b"bobs-name"]
    assert store.program("alice", alice.sha256).name == "alice-secret"


def test_stored_programs_are_readable_by_this_user_only(tiny_engine, tmp_path):
    """Also in a directory an older version left open, over a file it left 0644."""
    directory = tmp_path / "programs"
    directory.mkdir(mode=0o755)
    with Runtime(tiny_engine) as runtime:
        store = ProgramStore(runtime.wasm_engine, directory)
        (directory / f"{hashlib.sha256(ARGV0).hexdigest()}.wasm").write_bytes(ARGV0)
        entry = store.add("alice", ARGV0, "argv0", None)
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((store.directory / f"{entry.sha256}.wasm").stat().st_mode) == 0o600
    assert store.remove("alice", entry.sha256)
    assert not list(store.directory.iterdir())
