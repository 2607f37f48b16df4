"""Tenants of a shared server: who a bearer token belongs to, and what that tenant may use.

A tenants file (TOML) names each tenant, its token and its quotas; a quota left out is
unlimited (a per-process one: the server's default `ProcessLimits`, SECURITY.md):

    [tenants.alice]
    token = "a-long-random-secret"
    max_processes = 64          # running processes at once
    max_kv_pages = 4096         # KV pages its files may hold
    max_kv_files = 65536        # named KV files it may keep (left out: 65,536, not unlimited)
    max_upload_bytes = 67108864 # bytes of programs it may store
    cpu_time_s = 60.0           # CPU seconds one process may compute (host calls included)
    wall_time_s = 3600.0        # seconds one process may live, waiting included
    memory_bytes = 268435456    # linear memory of one process
    output_bytes = 67108864     # bytes one process may send (output and log)
    kv_pages_per_process = 1024 # KV pages one process's open files may hold

Counts and bytes are whole numbers, seconds may have fractions; none may be negative, NaN or
infinite. Per-process quotas become that process's `limits.ProcessLimits`. `max_kv_files` is the one
quota with a default when left out (kvfs.DEFAULT_MAX_NAMED_FILES): an empty named file holds
no page, so nothing else bounds how many a tenant keeps.

Without a file the server has one tenant, `default`, with no token and no quotas but the
named-file cap (a laptop).
"""
from __future__ import annotations

import hmac
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..lip.limits import ProcessLimits

DEFAULT_TENANT = "default"
_TENANT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
QUOTA_FIELDS = ("max_processes", "max_kv_pages", "max_kv_files", "max_upload_bytes", "cpu_time_s", "wall_time_s",
                "memory_bytes", "output_bytes", "kv_pages_per_process")
# Per-process quotas and the ProcessLimits field each one sets.
PROCESS_LIMIT_OF_QUOTA = {"cpu_time_s": "cpu_time_s", "wall_time_s": "wall_time_s", "memory_bytes": "memory_bytes",
                          "output_bytes": "output_bytes", "kv_pages_per_process": "kv_pages"}


class QuotaExceeded(Exception):
    """A tenant's quota would be exceeded; the message says which and by how much."""


class TenantsFileError(Exception):
    """The tenants file cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Quotas:
    """Per-tenant limits; None is unlimited (for max_kv_files: kvfs.DEFAULT_MAX_NAMED_FILES)."""

    max_processes: int | None = None
    max_kv_pages: int | None = None
    max_kv_files: int | None = None  # None: kvfs.DEFAULT_MAX_NAMED_FILES
    max_upload_bytes: int | None = None
    cpu_time_s: float | None = None
    wall_time_s: float | None = None
    memory_bytes: int | None = None
    output_bytes: int | None = None
    kv_pages_per_process: int | None = None

    def process_limits(self, base: ProcessLimits) -> ProcessLimits:
        """`base` (the server's defaults) with this tenant's per-process quotas applied."""
        limits = {}
        for quota, limit in PROCESS_LIMIT_OF_QUOTA.items():
            value = getattr(self, quota)
            if value is not None:
                limits[limit] = float(value) if limit.endswith("_s") else int(value)
        return replace(base, **limits)


MAX_QUOTA = 2**62  # wasmtime's limits and our counters are 64-bit


def _quota_problem(key: str, value) -> str | None:
    """What a quota's value must be, if `value` is not that (None: it is fine, or left out).
    Counts and bytes are whole numbers; times may have fractions. Not NaN nor infinite: a NaN
    compares false with everything, so `cpu_time_s = nan` let a process spin for ever."""
    if value is None:
        return None
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value <= MAX_QUOTA
    if key.endswith("_s"):
        return None if number else f"a number of seconds from 0 to {MAX_QUOTA}"
    return None if number and value == int(value) else f"a whole number from 0 to {MAX_QUOTA}"  # 64e6 is one


@dataclass(frozen=True)
class Tenant:
    name: str
    token: str | None = field(default=None, repr=False)
    quotas: Quotas = Quotas()


class Tenants:
    """Resolves bearer tokens to tenants."""

    def __init__(self, tenants: list[Tenant], open_access: bool = False):
        self.by_name = {t.name: t for t in tenants}
        self.open_access = open_access  # one tenant, no token needed

    @classmethod
    def single(cls, api_key: str | None = None) -> "Tenants":
        """One tenant, `default`, with no quotas: open to anyone, or, with `api_key` (vLLM's
        --api-key), to requests that bear it."""
        if api_key is None:
            return cls([Tenant(DEFAULT_TENANT)], open_access=True)
        if not api_key:
            raise TenantsFileError("an API key must not be empty")
        return cls([Tenant(DEFAULT_TENANT, api_key)])

    @classmethod
    def from_file(cls, path: str | Path) -> "Tenants":
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as error:
            raise TenantsFileError(f"cannot read {path}: {error.strerror}") from None
        except tomllib.TOMLDecodeError as error:
            raise TenantsFileError(f"{path}: not valid TOML: {error}") from None
        table = data.get("tenants")
        if not isinstance(table, dict) or not table:
            raise TenantsFileError(f"{path}: expected [tenants.NAME] tables with a token each")
        tenants, tokens = [], set()
        for name, entry in table.items():
            where = f"{path}: tenant {name!r}"
            if not _TENANT_NAME.match(name):
                raise TenantsFileError(f"{where}: a name is 1-64 letters, digits, '.', '_' or '-'")
            if not isinstance(entry, dict) or not isinstance(entry.get("token"), str) or len(entry["token"]) < 8:
                raise TenantsFileError(f"{where}: needs a token of at least 8 characters")
            unknown = set(entry) - {"token", *QUOTA_FIELDS}
            if unknown:
                raise TenantsFileError(f"{where}: unknown keys {sorted(unknown)} (quotas: {', '.join(QUOTA_FIELDS)})")
            for key in QUOTA_FIELDS:
                problem = _quota_problem(key, entry.get(key))
                if problem is not None:
                    raise TenantsFileError(f"{where}: {key} must be {problem}")
            if entry["token"] in tokens:
                raise TenantsFileError(f"{where}: its token is another tenant's too")
            tokens.add(entry["token"])
            quotas = Quotas(**{key: entry[key] if key.endswith("_s") else int(entry[key])
                               for key in QUOTA_FIELDS if key in entry})
            tenants.append(Tenant(name, entry["token"], quotas))
        return cls(tenants)

    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant a bearer token belongs to, or None."""
        if self.open_access:
            return self.by_name[DEFAULT_TENANT]
        if not token:
            return None
        for tenant in self.by_name.values():
            if hmac.compare_digest(tenant.token.encode(), token.encode()):
                return tenant
        return None
