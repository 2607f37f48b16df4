"""The C half of fiber.py is compiled on first use and cached; a cache anyone else could have
written to is never loaded from."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from symphony_os import native_build
from symphony_os.native_build import NativeBuildError, load_library


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
    # Built in another process: one that had loaded this path would get its old library back.
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                    "from symphony_os.native_build import load_library; load_library(Path(sys.argv[1]))",
                    str(source(tmp_path, 7))], check=True)
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
