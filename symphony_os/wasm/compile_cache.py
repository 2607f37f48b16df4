"""Our own cache of compiled components (compiling an 18 MB Python component takes seconds;
loading the compiled file, milliseconds).

Deserializing compiled code is not safe for untrusted bytes (wasmtime: `deserialize` trusts its input), so only
files this process's user wrote are loaded:
- the directory is ours alone: created 0700, refused when another user owns it or it is a
  link; one found open to others (an older version, a umask of 0) is closed and emptied, as
  anyone could have written into it;
- it is opened once and every file is reached through that descriptor (a directory swapped in
  meanwhile is not followed), without following links;
- a file is read only if it is a regular file of ours with no second link (a file another
  user planted, or a hard link to one, is not), from the descriptor that was checked;
- each file is written under a unique temporary name and renamed into place whole, and its
  sha256 is kept in a sidecar that is checked, over the very bytes that are then deserialized,
  before every load.
Each distinct upload adds a file (~33 MB for a Python LIP), so the cache is bounded: past
`max_bytes` the least recently used files (by mtime, touched on every hit) are removed, and so
are temporary files a killed writer left.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import stat
import time
from pathlib import Path

from .native_build import cache_root

log = logging.getLogger("symphony.compile_cache")


def default_cache_dir() -> Path | None:
    """Compiled components' place in the user's Symphony cache (native_build.cache_root), or
    None (no cache) where the user has none: no home directory and no cache variable."""
    try:
        return cache_root() / "components"
    except RuntimeError:
        return None


CACHE_DIR = default_cache_dir()
MAX_CACHE_BYTES = 2 * 2**30
COMPILED, DIGEST, PARTIAL = ".cwasm", ".sha256", ".partial"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_NOCTTY = getattr(os, "O_NOCTTY", 0)


class CompileCache:
    """Compiled bytes by key, in a directory of our own; `open` returns None when the directory
    cannot be trusted or made (then nothing is cached, and every load compiles). `close()`
    releases the directory's descriptor."""

    def __init__(self, directory: Path, dir_fd: int, max_bytes: int = MAX_CACHE_BYTES):
        self.directory = directory
        self.max_bytes = max_bytes
        self._fd = dir_fd

    @classmethod
    def open(cls, directory: Path, max_bytes: int = MAX_CACHE_BYTES) -> "CompileCache | None":
        fd = None
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(directory, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
            info = os.fstat(fd)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                log.warning("not caching compiled components: %s is not a directory of this user", directory)
                os.close(fd)
                return None
            if info.st_mode & 0o077:  # ours, but open to others: close it, then drop what is in it
                os.chmod(fd, 0o700)
                log.warning("%s was open to other users: closed, and its files removed", directory)
                _remove_all(fd)
        except OSError as error:
            if fd is not None:
                os.close(fd)
            log.warning("not caching compiled components in %s: %s", directory, error)
            return None
        return cls(directory, fd, max_bytes)  # it owns the descriptor from here on

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.close()

    def _read(self, name: str) -> bytes | None:
        """The bytes of `name` if it is a regular file of ours with no other link, else None.
        Opened without blocking (a FIFO planted under the name would wait for a writer);
        no link is fine too (renamed over or pruned since it was opened: still our file)."""
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _NOCTTY, dir_fd=self._fd)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_nlink > 1:
                log.warning("compiled component file %s is not this user's own: ignored", name)
                return None
            return file.read()

    def load(self, key: str) -> bytes | None:
        """The compiled bytes stored under `key`, if present, ours and matching their digest."""
        data, expected = self._read(f"{key}{COMPILED}"), self._read(f"{key}{DIGEST}")
        if data is None or expected is None:
            return None
        if hashlib.sha256(data).hexdigest() != expected.decode("ascii", "replace").strip():
            log.warning("compiled component %s%s does not match its digest: removed", key, COMPILED)
            self._remove(key)
            return None
        try:
            os.utime(f"{key}{COMPILED}", dir_fd=self._fd, follow_symlinks=False)  # recently used: pruned last
        except OSError:
            pass
        return data

    def store(self, key: str, data: bytes) -> None:
        """Keep `data` under `key` (the digest first, so a file is never there without it),
        then prune the cache to `max_bytes`."""
        try:
            self._write(f"{key}{DIGEST}", hashlib.sha256(data).hexdigest().encode())
            self._write(f"{key}{COMPILED}", data)
        except OSError as error:
            log.warning("cannot cache the compiled component in %s: %s", self.directory, error)
            return
        self.prune()

    def _write(self, name: str, data: bytes) -> None:
        # A unique temporary name per writer (two threads compiling the same bytes), renamed
        # into place only once written whole.
        partial = f".{name}.{secrets.token_hex(8)}{PARTIAL}"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=self._fd)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(partial, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except BaseException:
            self._unlink(partial)
            raise

    def _entries(self) -> list[tuple[str, os.stat_result]]:
        entries = []
        for name in os.listdir(self._fd):
            try:
                entries.append((name, os.stat(name, dir_fd=self._fd, follow_symlinks=False)))
            except OSError:
                continue
        return entries

    def prune(self) -> None:
        """Remove the least recently used compiled files until the rest fit in `max_bytes`, and
        temporary files older than an hour (a writer killed midway leaves one)."""
        entries, stale_before = [], time.time() - 3600
        for name, info in self._entries():
            if name.endswith(COMPILED):
                entries.append((info.st_mtime, info.st_size, name[:-len(COMPILED)]))
            elif name.endswith(PARTIAL) and info.st_mtime < stale_before:
                self._unlink(name)
        total = sum(size for _, size, _ in entries)
        for _, size, key in sorted(entries):
            if total <= self.max_bytes:
                break
            self._remove(key)
            total -= size

    def _remove(self, key: str) -> None:
        for suffix in (COMPILED, DIGEST):
            self._unlink(f"{key}{suffix}")

    def _unlink(self, name: str) -> None:
        _unlink(self._fd, name)


def _remove_all(dir_fd: int) -> None:
    for name in os.listdir(dir_fd):
        _unlink(dir_fd, name)


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as error:  # a directory someone made in it while it was open, say
        log.warning("cannot remove %s from the compile cache: %s", name, error)
