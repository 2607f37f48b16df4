"""The C half of fiber.py is compiled on first use and cached; a cache anyone else could have
written to is never loaded from."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from symphony_os.wasm import native_build
from symphony_os.wasm.native_build import NativeBuildError, load_library


@pytest.fixture(autouse=True)
def no_symphony_cache(monkeypatch):
    """The tests here place the cache with XDG_CACHE_HOME, which $SYMPHONY_CACHE overrides."""
    monkeypatch.delenv("SYMPHONY_CACHE", raising=False)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return native_build.cache_dir()


def source(tmp_path: Path, answer: int) -> Path:
    path = tmp_path / "answer.c"
    path.write_text(f"int answer(void) {{ return {answer}; }}\n")
    return path


def test_a_source_is_compiled_once_and_then_loaded_from_the_cache(tmp_path, cache):
    assert load_library(source(tmp_path, 41)).answer() == 41
    (built,) = cache.glob("answer-*.so")
    assert cache.stat().st_mode & 0o777 == 0o700 and built.stat().st_mode & 0o077 == 0
    stamp = built.stat().st_mtime_ns
    assert load_library(source(tmp_path, 41)).answer() == 41
    assert built.stat().st_mtime_ns == stamp  # not rebuilt
    assert load_library(source(tmp_path, 42)).answer() == 42  # a changed source: a library of its own
    assert len(list(cache.glob("answer-*.so"))) == 2


def test_a_cached_library_others_could_have_written_is_rebuilt(tmp_path, cache):
    load_library(source(tmp_path, 7))
    (built,) = cache.glob("answer-*.so")
    _other(tmp_path, 666)
    (other,) = [path for path in cache.glob("answer-*.so") if path != built]
    os.replace(other, built)  # someone's library under our name...
    os.chmod(built, 0o722)  # ...in a file others may write
    assert load_library(source(tmp_path, 7)).answer() == 7
    assert built.stat().st_mode & 0o077 == 0


def test_a_cache_directory_open_to_others_is_not_used(tmp_path, cache):
    _build_elsewhere(tmp_path, 7)  # not here: this process would get its old library back
    (built,) = cache.glob("answer-*.so")
    _other(tmp_path, 666)
    (other,) = [path for path in cache.glob("answer-*.so") if path != built]
    os.replace(other, built)  # a planted library under the right name...
    os.chmod(cache, 0o777)  # ...in a directory anyone may write to
    assert load_library(source(tmp_path, 7)).answer() == 7  # built privately instead
    assert load_library(source(tmp_path, 7)).answer() == 7


def test_a_source_that_does_not_compile_says_why(tmp_path, cache):
    broken = tmp_path / "broken.c"
    broken.write_text("int broken(void) { return missing; }\n")
    with pytest.raises(NativeBuildError, match="missing"):
        load_library(broken)
    assert list(cache.iterdir()) == []  # no partial file left behind


def _other(tmp_path: Path, answer: int):
    """A library built from another source, into the same cache under the same stem."""
    directory = tmp_path / f"other-{answer}"
    directory.mkdir()
    return load_library(source(directory, answer))


def test_a_cached_library_with_a_second_link_is_rebuilt(tmp_path, cache):
    built = _build_elsewhere(tmp_path, 7)
    os.link(built, tmp_path / "second-link")  # someone else's name for the file: they may rewrite it
    os.unlink(built)
    os.link(_build_elsewhere(tmp_path / "other", 666, cache_of=tmp_path / "other-cache"), built)
    assert load_library(source(tmp_path, 7)).answer() == 7
    assert built.stat().st_nlink == 1


def test_a_cache_under_a_directory_others_may_write_is_not_used(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could swap the cache directory inside it for their own
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared / "cache"))
    name = _build_elsewhere(tmp_path, 7, cache_of=tmp_path / "trusted").name
    planted = shared / "cache" / "symphony" / "native" / name  # a library of 666 under 7's name,
    planted.parent.mkdir(mode=0o700, parents=True)  # in a directory that looks private
    for directory in (shared / "cache", shared / "cache" / "symphony"):
        os.chmod(directory, 0o700)
    shutil.copy(_build_elsewhere(tmp_path / "other", 666, cache_of=tmp_path / "other-cache"), planted)
    os.chmod(planted, 0o700)
    assert load_library(source(tmp_path, 7)).answer() == 7  # built privately instead


def test_the_directories_it_makes_are_private(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh" / "cache"))
    load_library(source(tmp_path, 7))
    for directory in (tmp_path / "fresh", tmp_path / "fresh" / "cache", tmp_path / "fresh" / "cache" / "symphony"):
        assert directory.stat().st_mode & 0o777 == 0o700


def test_without_a_home_directory_it_builds_privately(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("no home")))
    assert load_library(source(tmp_path, 5)).answer() == 5


def test_a_ziglang_module_in_the_working_directory_is_not_the_compiler(tmp_path, cache, monkeypatch):
    (tmp_path / "ziglang.py").write_text("import pathlib, sys\npathlib.Path(sys.argv[-1]).write_text('planted')\n")
    monkeypatch.chdir(tmp_path)
    assert load_library(source(tmp_path, 3)).answer() == 3


def _build_elsewhere(tmp_path: Path, answer: int, cache_of: Path | None = None) -> Path:
    """Build in another process (one that had loaded a path gets its old library back from
    it) and return the cached file."""
    tmp_path.mkdir(exist_ok=True)
    env = dict(os.environ, **({"XDG_CACHE_HOME": str(cache_of)} if cache_of else {}))
    path = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                           "from symphony_os.wasm import native_build; "
                           "print(native_build.load_library(Path(sys.argv[1]))._name)", str(source(tmp_path, answer))],
                          check=True, env=env, capture_output=True, text=True).stdout.strip()
    return Path(path)


def test_every_cache_of_symphony_is_under_one_root(tmp_path, monkeypatch):
    """$SYMPHONY_CACHE moved only the compiled components, and $XDG_CACHE_HOME moved only the
    native library and the built-in LIPs: one root now, for all three."""
    from symphony_os.server import builtin_lips
    from symphony_os.wasm import compile_cache

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert native_build.cache_root() == tmp_path / "home" / ".cache" / "symphony"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_build.cache_root() == tmp_path / "xdg" / "symphony"
    monkeypatch.setenv("SYMPHONY_CACHE", str(tmp_path / "mine"))
    root = tmp_path / "mine"
    assert native_build.cache_dir() == root / "native"
    assert compile_cache.default_cache_dir() == root / "components"
    assert builtin_lips.cache_dir().parent == root
