"""Shared libraries built from this package's C sources (fiber_native.c) with zig's clang (the
`ziglang` package, a dependency) the first time they are needed, and cached by the hash of the
source, the compiler flags and the platform.

The cache is the user's own (`native` in `cache_root()`: `$SYMPHONY_CACHE`, else
`$XDG_CACHE_HOME/symphony`, else `~/.cache/symphony`; mode 0700). What is loaded from it
runs as native code in the host, so a library is loaded only from a directory of this user's that
no one else may write to, on a path whose every directory is this user's or root's and writable
by no one else (or sticky, as /tmp is), and only if it is this user's own regular file, with one
link and writable by no one else; anything else is rebuilt in a private directory of its own."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from ..cache import cache_root

# No C library: the sources need none, and zig builds it in a tenth of a second without one.
# Baseline x86-64 (or the architecture's baseline): zig targets the building CPU by default (its
# AVX, say), and a cache may outlive the machine it was built on.
FLAGS = ("-O2", "-shared", "-fPIC", "-nostdlib", "-mcpu=baseline")

# zig's clang, isolated (`-I`): no `ziglang` module in the working directory or on PYTHONPATH
# stands in for it. builtin_lips.py, tests/guests.py and bench/paper.py compile with it too.
ZIG_CC = (sys.executable, "-I", "-m", "ziglang", "cc")


class NativeBuildError(Exception):
    """A C source of the package could not be compiled; the message has the compiler's output."""


def cache_dir() -> Path:
    return cache_root() / "native"


def load_library(source: Path) -> ctypes.CDLL:
    """The shared library built from `source` (compiled when it, the flags or the platform
    changed, or when the cache cannot be trusted). Raises NativeBuildError."""
    key = hashlib.sha256(source.read_bytes() + repr((FLAGS, platform.machine(), sys.platform)).encode())
    name = f"{source.stem}-{key.hexdigest()[:16]}.so"
    directory = _private_cache()
    if directory is not None:
        cached = directory / name
        if _trusted(cached):
            return ctypes.CDLL(str(cached))
        built = _compile(source, directory)
        os.replace(built, cached)  # atomic: a process building beside us loads one or the other
        return ctypes.CDLL(str(cached))
    with tempfile.TemporaryDirectory(prefix="symphony-native-") as private:  # no cache to trust
        return ctypes.CDLL(str(_compile(source, Path(private))))  # loaded, it may be deleted


def _private_cache() -> Path | None:
    """The cache directory (its real path), if it is (or can be made) this user's alone and no
    one else can replace it or a directory above it; else None."""
    try:
        directory = cache_dir()  # raises RuntimeError with no HOME and no passwd entry
        missing = [path for path in (directory, *directory.parents) if not os.path.lexists(path)]
        for path in reversed(missing):  # each made 0700 (makedirs gives parents the umask's)
            path.mkdir(mode=0o700, exist_ok=True)
        directory = Path(os.path.realpath(directory))
        return directory if _safe_ancestry(directory) else None
    except (OSError, RuntimeError):
        return None


def _safe_ancestry(directory: Path) -> bool:
    """Is `directory` (a real path) this user's, writable by no one else, under directories that
    are this user's or root's and writable by no one else unless sticky?"""
    uid = os.getuid()
    for depth, path in enumerate((directory, *directory.parents)):
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid not in (uid, 0) or (depth == 0 and info.st_uid != uid):
            return False
        if info.st_mode & 0o022 and (depth == 0 or not info.st_mode & stat.S_ISVTX):
            return False
    return True


def _trusted(path: Path) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and info.st_nlink == 1
            and not info.st_mode & 0o022)


def _compile(source: Path, directory: Path) -> Path:
    """Compile `source` into a new file in `directory`; its path."""
    handle, out = tempfile.mkstemp(prefix=f"{source.stem}-", suffix=".so.partial", dir=directory)
    os.close(handle)
    with tempfile.TemporaryDirectory(prefix="symphony-zig-") as zig_cache:  # zig's own, private
        env = dict(os.environ, ZIG_GLOBAL_CACHE_DIR=zig_cache, ZIG_LOCAL_CACHE_DIR=zig_cache)
        try:
            result = subprocess.run([*ZIG_CC, *FLAGS, str(source), "-o", out],
                                    capture_output=True, text=True, env=env, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as error:
            os.unlink(out)
            raise NativeBuildError(f"compiling {source} failed: {error}") from None
    if result.returncode != 0:
        os.unlink(out)
        raise NativeBuildError(f"compiling {source} failed (is the ziglang package installed?):\n"
                               f"{result.stderr.strip()}")
    os.chmod(out, 0o700)
    return Path(out)

