"""Building guest programs for tests: the C examples in lips/ (with zig's wasm32-wasi clang, as
`make lips` does) and WAT modules written inline."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import wasmtime

ROOT = Path(__file__).resolve().parent.parent
SDK = ROOT / "guest_sdk" / "c"


def build_c(source: Path, out: Path) -> Path:
    """Compile a C LIP; reuses `out` when it is newer than the source and the SDK header."""
    newest_input = max(source.stat().st_mtime, (SDK / "symphony.h").stat().st_mtime)
    if not out.exists() or out.stat().st_mtime < newest_input:
        subprocess.run([sys.executable, "-m", "ziglang", "cc", "--target=wasm32-wasi", "-O2", "-s",
                        f"-I{SDK}", str(source), "-o", str(out)], check=True)
    return out


def lip(name: str) -> Path:
    """lips/NAME.wasm, built from lips/NAME.c when missing or stale."""
    return build_c(ROOT / "lips" / f"{name}.c", ROOT / "lips" / f"{name}.wasm")


def wat(text: str) -> bytes:
    return bytes(wasmtime.wat2wasm(text))
