"""The cache of compiled components (symphony_os/wasm/compile_cache.py): a directory of our own,
files checked against their digest before they are loaded, and a bounded size."""
import gc
import hashlib
import os
import stat
import threading
import time
import uuid

import pytest
import wasmtime

from symphony_os.wasm import compile_limit
from symphony_os.wasm.compile_cache import CompileCache
from symphony_os.wasm.component import compile_component
from symphony_os.wasm.program import ProgramError, load_program


def component_bytes() -> bytes:
    """A small component no cache has seen (its export name is new)."""
    return bytes(wasmtime.wat2wasm(f'(component (core module (func (export "f{uuid.uuid4().hex}"))))'))


def test_cache_directory_is_private_and_tightened(tmp_path):
    fresh = tmp_path / "fresh"
    assert CompileCache.open(fresh) is not None
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    # Open to others, so anyone may have planted a compiled file with its digest: emptied.
    (loose / "planted.cwasm").write_bytes(b"code")
    (loose / "planted.sha256").write_text(hashlib.sha256(b"code").hexdigest())
    cache = CompileCache.open(loose)
    assert cache is not None and cache.load("planted") is None
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700 and not list(loose.iterdir())
    link = tmp_path / "link"
    link.symlink_to(fresh)
    assert CompileCache.open(link) is None
    not_a_directory = tmp_path / "file"
    not_a_directory.write_bytes(b"")
    assert CompileCache.open(not_a_directory) is None


def test_a_file_that_does_not_match_its_digest_is_never_loaded(tmp_path):
    cache = CompileCache.open(tmp_path)
    cache.store("key", b"compiled code")
    assert cache.load("key") == b"compiled code"
    (tmp_path / "key.cwasm").write_bytes(b"compiled c0de")
    assert cache.load("key") is None
    assert not list(tmp_path.iterdir())  # both files removed
    (tmp_path / "planted.cwasm").write_bytes(b"no digest of ours")
    assert cache.load("planted") is None


def test_only_regular_files_of_our_own_are_loaded(tmp_path):
    """Links are not followed, and a hard link (to a file another user could have made) or a
    file another user owns is not read, digest or not."""
    cache = CompileCache.open(tmp_path / "cache")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "code").write_bytes(b"code")
    (elsewhere / "digest").write_text(hashlib.sha256(b"code").hexdigest())
    (cache.directory / "sym.cwasm").symlink_to(elsewhere / "code")
    (cache.directory / "sym.sha256").symlink_to(elsewhere / "digest")
    assert cache.load("sym") is None
    os.link(elsewhere / "code", cache.directory / "hard.cwasm")
    os.link(elsewhere / "digest", cache.directory / "hard.sha256")
    assert cache.load("hard") is None
    if os.getuid() == 0:  # only root can give a file to another user
        cache.store("theirs", b"code")
        os.chown(cache.directory / "theirs.cwasm", 65534, 65534)
        assert cache.load("theirs") is None
    cache.store("ours", b"code")
    assert cache.load("ours") == b"code"
    cache.close()


def test_a_fifo_under_a_key_is_not_waited_on(tmp_path):
    """Opening a FIFO to read blocks until a writer comes: the compiling thread hung."""
    cache = CompileCache.open(tmp_path)
    os.mkfifo(tmp_path / "fifo.cwasm")
    os.mkfifo(tmp_path / "fifo.sha256")
    loaded = []
    thread = threading.Thread(target=lambda: loaded.append(cache.load("fifo")), daemon=True)
    thread.start()
    thread.join(10)
    assert loaded == [None]


def test_temporary_files_a_killed_writer_left_are_pruned(tmp_path):
    cache = CompileCache.open(tmp_path)
    old, new = tmp_path / ".a.cwasm.1234.partial", tmp_path / ".b.cwasm.5678.partial"
    old.write_bytes(b"half")
    new.write_bytes(b"being written")
    os.utime(old, (time.time() - 7200,) * 2)
    cache.store("key", b"code")
    assert not old.exists() and new.exists()


def test_cache_keeps_the_most_recently_used_within_its_size(tmp_path):
    cache = CompileCache.open(tmp_path, max_bytes=2500)
    for i, key in enumerate(["a", "b", "c"]):
        cache.store(key, bytes(1000))
        os.utime(tmp_path / f"{key}.cwasm", (1000 + i, 1000 + i))
    cache.store("d", bytes(1000))  # over 2500: the least recently used go
    assert sorted(path.name for path in tmp_path.glob("*.cwasm")) == ["c.cwasm", "d.cwasm"]
    assert not list(tmp_path.glob(".*partial"))


def test_compiled_component_is_cached_and_a_tampered_file_recompiled(tmp_path):
    engine = wasmtime.Engine()
    data = component_bytes()
    compile_component(engine, data, cache_dir=tmp_path)
    [compiled] = tmp_path.glob("*.cwasm")
    compiled.write_bytes(b"\x00" * 64)  # not ours any more: refused, compiled again
    assert compile_component(engine, data, cache_dir=tmp_path).type is not None
    assert compiled.read_bytes() != b"\x00" * 64


def test_component_compile_time_is_limited():
    with pytest.raises(ProgramError, match="compiling the component took over the limit"):
        load_program(wasmtime.Engine(), component_bytes(), compile_time_s=1e-3)


def test_bytes_whose_compile_kills_the_child_are_not_compiled_in_the_server(monkeypatch):
    """The child's outcome counted only as time: one that died (killed for memory, aborted in
    the compiler) let the server compile the same bytes itself, which would take it down too."""
    monkeypatch.setattr(compile_limit, "_COMPILE_PROBE", "import os; os.abort()")
    module = wasmtime.wat2wasm('(module (memory (export "memory") 1) (func (export "_start")))')
    for data in (bytes(module), component_bytes()):
        with pytest.raises(ProgramError, match=r"failed in a child process \(signal 6\): not compiled in the server"):
            load_program(wasmtime.Engine(), data, compile_time_s=30)


def test_bytes_wasmtime_refuses_still_say_why_under_a_compile_limit():
    with pytest.raises(ProgramError, match="invalid WebAssembly component"):
        load_program(wasmtime.Engine(), b"\x00asm\x0d\x00\x01\x00" + b"\x07" * 40, compile_time_s=30)


def test_a_directory_that_cannot_be_closed_to_others_is_not_used_and_its_descriptor_closed_once(tmp_path, monkeypatch):
    """Emptying an open directory failed (a read-only file system): the descriptor was closed,
    then closed again by the discarded cache, by then another file's."""
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    with monkeypatch.context() as patch:
        patch.setattr(os, "chmod", read_only)
        assert CompileCache.open(loose) is None
    with open(tmp_path / "other", "wb") as other:  # takes the number the directory had
        gc.collect()
        other.write(b"still open")
        other.flush()
