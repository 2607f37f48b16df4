"""Our own cache of compiled components (compiling an 18 MB Python component takes seconds;
loading the compiled file, milliseconds).

Deserializing compiled code is not safe for untrusted bytes (DESIGN.md section 4), so only
files this module wrote are loaded: the directory is ours alone (created 0700, refused when
another user owns it or others may write to it), each file is written under a unique temporary
name and renamed into place whole, and its sha256 is kept in a sidecar that is checked, over
the very bytes that are then deserialized, before every load. Each distinct upload adds a file
(~33 MB for a Python LIP), so the cache is bounded: past `max_bytes` the least recently used
files (by mtime, touched on every hit) are removed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger("symphony.compile_cache")

CACHE_DIR = Path(os.environ.get("SYMPHONY_CACHE", Path.home() / ".cache" / "symphony")) / "components"
MAX_CACHE_BYTES = 2 * 2**30
COMPILED, DIGEST = ".cwasm", ".sha256"


class CompileCache:
    """Compiled bytes by key, in a directory of our own; `open` returns None when the directory
    cannot be trusted or made (then nothing is cached, and every load compiles)."""

    def __init__(self, directory: Path, max_bytes: int = MAX_CACHE_BYTES):
        self.directory = directory
        self.max_bytes = max_bytes

    @classmethod
    def open(cls, directory: Path, max_bytes: int = MAX_CACHE_BYTES) -> "CompileCache | None":
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = directory.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                log.warning("not caching compiled components: %s is not a directory of this user", directory)
                return None
            if info.st_mode & 0o077:
                os.chmod(directory, 0o700)  # ours, but left open by an older version: close it
        except OSError as error:
            log.warning("not caching compiled components in %s: %s", directory, error)
            return None
        return cls(directory, max_bytes)

    def load(self, key: str) -> bytes | None:
        """The compiled bytes stored under `key`, if present and matching their digest."""
        path = self.directory / f"{key}{COMPILED}"
        try:
            data = path.read_bytes()
            expected = (self.directory / f"{key}{DIGEST}").read_text().strip()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != expected:
            log.warning("compiled component %s does not match its digest: removed", path.name)
            self._remove(key)
            return None
        try:
            os.utime(path)  # recently used: pruned last
        except OSError:
            pass
        return data

    def store(self, key: str, data: bytes) -> None:
        """Keep `data` under `key` (the digest first, so a file is never there without it),
        then prune the cache to `max_bytes`."""
        try:
            self._write(self.directory / f"{key}{DIGEST}", hashlib.sha256(data).hexdigest().encode())
            self._write(self.directory / f"{key}{COMPILED}", data)
        except OSError as error:
            log.warning("cannot cache the compiled component in %s: %s", self.directory, error)
            return
        self.prune()

    def _write(self, path: Path, data: bytes) -> None:
        # A unique temporary name per writer (two threads compiling the same bytes), renamed
        # into place only once written whole.
        fd, partial = tempfile.mkstemp(dir=self.directory, prefix=f".{path.name}.", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(partial, path)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise

    def prune(self) -> None:
        """Remove the least recently used compiled files until the rest fit in `max_bytes`."""
        entries = []
        for path in self.directory.glob(f"*{COMPILED}"):
            try:
                info = path.stat()
            except OSError:
                continue
            entries.append((info.st_mtime, info.st_size, path.name[:-len(COMPILED)]))
        total = sum(size for _, size, _ in entries)
        for _, size, key in sorted(entries):
            if total <= self.max_bytes:
                break
            self._remove(key)
            total -= size

    def _remove(self, key: str) -> None:
        for suffix in (COMPILED, DIGEST):
            (self.directory / f"{key}{suffix}").unlink(missing_ok=True)
