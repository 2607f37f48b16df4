"""Uploaded programs: validated, stored by sha256, compiled once, and listed per tenant.

The bytes live in `directory/<sha256>.wasm` (the directory 0700, the files 0600: tenants'
programs are theirs); the compiled module is kept in memory and shared by every tenant that
uploaded the same bytes. Each tenant sees only the programs it uploaded itself, under its own
names (its processes' argv[0] too), and its uploads count against its `max_upload_bytes` quota.
Sharing is visible in one way: bytes some tenant uploaded before are not compiled again, so
their upload answers sooner.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import wasmtime

from ..wasm.program import Program, load_program
from .tenants import QuotaExceeded


@dataclass(frozen=True)
class StoredProgram:
    """One tenant's entry for a program."""

    sha256: str
    name: str
    size: int
    uploaded_at: float

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "name": self.name, "size": self.size, "uploaded_at": self.uploaded_at}


class ProgramStore:
    def __init__(self, wasm_engine: wasmtime.Engine, directory: str | Path, compile_time_s: float | None = None):
        self.wasm_engine = wasm_engine
        self.compile_time_s = compile_time_s  # refuse modules that take longer to compile
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)  # one an older version made (or the operator) may be open
        self._compiled: dict[str, Program] = {}
        self._by_tenant: dict[str, dict[str, StoredProgram]] = {}
        self._reserved: dict[str, int] = {}  # bytes of uploads being compiled, per tenant
        self._lock = threading.Lock()

    def _used(self, tenant: str) -> int:
        return sum(p.size for p in self._by_tenant.get(tenant, {}).values()) + self._reserved.get(tenant, 0)

    def remaining(self, tenant: str, quota_bytes: int | None) -> int | None:
        """Bytes `tenant` may still upload (None: no quota), counting uploads in progress."""
        if quota_bytes is None:
            return None
        with self._lock:
            return max(0, quota_bytes - self._used(tenant))

    def add(self, tenant: str, data: bytes, name: str, quota_bytes: int | None) -> StoredProgram:
        """Validate, compile (once per distinct bytes) and record a program for `tenant`.
        Raises ProgramError (bad module) or QuotaExceeded. Compiling takes a while: call it
        off the event loop."""
        sha = hashlib.sha256(data).hexdigest()
        with self._lock:
            mine = self._by_tenant.setdefault(tenant, {})
            if sha in mine:
                return mine[sha]
            used = self._used(tenant)
            if quota_bytes is not None and used + len(data) > quota_bytes:
                raise QuotaExceeded(f"upload quota: {used} of {quota_bytes} bytes stored or being uploaded, this "
                                    f"program is {len(data)} bytes; delete programs first")
            # Reserved until recorded, so concurrent uploads cannot all pass the check above.
            self._reserved[tenant] = self._reserved.get(tenant, 0) + len(data)
            compiled = self._compiled.get(sha)
        try:
            if compiled is None:
                compiled = load_program(self.wasm_engine, data, name, compile_time_s=self.compile_time_s)
            # Written outside the lock (the event loop lists programs under it), put in place
            # with the record under it: a removal meanwhile cannot leave a record without a file.
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{sha}.", suffix=".tmp")  # 0600
            try:
                with open(fd, "wb") as file:
                    file.write(data)
                with self._lock:
                    os.replace(tmp, self.directory / f"{sha}.wasm")
                    self._compiled.setdefault(sha, compiled)
                    entry = StoredProgram(sha, name, len(data), time.time())
                    return self._by_tenant.setdefault(tenant, {}).setdefault(sha, entry)
            finally:
                Path(tmp).unlink(missing_ok=True)  # gone already unless the write failed
        finally:
            with self._lock:
                self._reserved[tenant] -= len(data)

    def list(self, tenant: str) -> list[StoredProgram]:
        with self._lock:
            return sorted(self._by_tenant.get(tenant, {}).values(), key=lambda p: p.uploaded_at)

    def get(self, tenant: str, sha: str) -> StoredProgram | None:
        with self._lock:
            return self._by_tenant.get(tenant, {}).get(sha)

    def program(self, tenant: str, sha: str) -> Program | None:
        """The compiled program, if `tenant` uploaded it, under the name `tenant` gave it (not
        that of whoever uploaded the same bytes first)."""
        with self._lock:
            entry = self._by_tenant.get(tenant, {}).get(sha)
            if entry is None:
                return None
            return dataclasses.replace(self._compiled[sha], name=entry.name)

    def remove(self, tenant: str, sha: str) -> bool:
        """Forget a tenant's program (running processes keep theirs)."""
        with self._lock:
            removed = self._by_tenant.get(tenant, {}).pop(sha, None) is not None
            if removed and not any(sha in mine for mine in self._by_tenant.values()):
                self._compiled.pop(sha, None)
                (self.directory / f"{sha}.wasm").unlink(missing_ok=True)
            return removed

