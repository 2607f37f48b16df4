"""The server's built-in LIPs (builtin/*.c here), compiled with zig's wasm32-wasi clang
(the `ziglang` package) the first time they are needed, and cached by the hash of their source
and the C SDK header."""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from ..wasm.native_build import ZIG_CC, cache_root

SOURCES = Path(__file__).resolve().parent / "builtin"
# Through the package's link to guest_sdk/c: an installed wheel holds a copy there.
SDK = Path(__file__).resolve().parents[1] / "guest_sdk" / "c"


class BuiltinBuildError(Exception):
    """A built-in LIP could not be compiled; the message has the compiler's output."""


def cache_dir() -> Path:
    return cache_root() / "builtin"


def builtin_lip(name: str) -> Path:
    """The compiled module of built-in LIP `name` (compiling it when its inputs changed)."""
    source = SOURCES / f"{name}.c"
    header = SDK / "symphony.h"
    digest = hashlib.sha256(source.read_bytes() + header.read_bytes()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{digest}.wasm"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    result = subprocess.run([*ZIG_CC, "--target=wasm32-wasi", "-O2", "-s",
                             f"-I{SDK}", str(source), "-o", str(tmp)], capture_output=True, text=True)
    if result.returncode != 0:
        raise BuiltinBuildError(f"compiling {source} failed:\n{result.stderr.strip()}")
    tmp.replace(out)
    return out
