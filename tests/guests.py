"""Building guest programs for tests: the C examples in lips/ (with zig's wasm32-wasi clang, as
`make lips` does) and WAT modules written inline."""
from __future__ import annotations

import subprocess
from pathlib import Path

import wasmtime

from symphony_os.wasm.native_build import ZIG_CC

ROOT = Path(__file__).resolve().parent.parent
SDK = ROOT / "guest_sdk" / "c"


def build_c(source: Path, out: Path, simd: bool = True) -> Path:
    """Compile a C LIP (with wasm SIMD, as `make lips` does, unless `simd` is off); reuses `out`
    when it is newer than the source and the SDK header."""
    headers = [SDK / "symphony.h", *source.parent.glob("*.h")]  # lips/gallery.h and friends
    newest_input = max(path.stat().st_mtime for path in [source, *headers])
    if not out.exists() or out.stat().st_mtime < newest_input:
        subprocess.run([*ZIG_CC, "--target=wasm32-wasi", "-O2", "-s",
                        *(["-msimd128"] if simd else []), f"-I{SDK}", str(source), "-o", str(out)], check=True)
    return out


def lip(name: str) -> Path:
    """lips/NAME.wasm, built from lips/NAME.c when missing or stale."""
    return build_c(ROOT / "lips" / f"{name}.c", ROOT / "lips" / f"{name}.wasm")


def wat(text: str) -> bytes:
    return bytes(wasmtime.wat2wasm(text))


def echo_guest(spin: int = 0) -> bytes:
    """A module that sends back each message it receives until its input closes (messages up
    to 1 KiB); with `spin`, it first counts to that many, so that messages queue up unread."""
    computing = f"""(loop $spin (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $spin (i32.lt_u (local.get $i) (i32.const {spin}))))""" if spin else ""
    return wat(f'''(module
  (import "symphony" "recv" (func $recv (param i32 i32) (result i32)))
  (import "symphony" "send" (func $send (param i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start") (local $n i32) {"(local $i i32)" if spin else ""}
    {computing}
    (block $done (loop $next
      (local.set $n (call $recv (i32.const 0) (i32.const 1024)))
      (br_if $done (i32.lt_s (local.get $n) (i32.const 0)))
      (drop (call $send (i32.const 0) (local.get $n)))
      (br $next)))))''')


ECHO = echo_guest()


def build_with_make(program: Path, toolchain: str) -> Path:
    """A Rust or AssemblyScript program (lips/rust/, lips/as/, tests/rust_guests/, tests/as_guests/)
    built through `make` (which installs the toolchain: Debian's rustc, or asc from npm); skips,
    saying why, only when that install fails."""
    result = subprocess.run(["make", "-s", str(program.relative_to(ROOT))], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        if "apt-get" in result.stderr + result.stdout or "npm" in result.stderr + result.stdout:
            import pytest
            pytest.skip(f"cannot install the {toolchain} toolchain here: {result.stderr.strip()[-300:]}")
        raise RuntimeError(f"building {program} failed:\n{result.stdout}\n{result.stderr}")
    return program


RUST, ASSEMBLYSCRIPT = "Rust (rustc + libstd-rust-dev-wasm32)", "AssemblyScript (npm assemblyscript)"


def rust_lip(name: str) -> Path:
    return build_with_make(ROOT / "lips" / "rust" / f"{name}.wasm", RUST)


def as_lip(name: str) -> Path:
    return build_with_make(ROOT / "lips" / "as" / f"{name}.wasm", ASSEMBLYSCRIPT)


def rust_test_guest(name: str) -> Path:
    """tests/rust_guests/NAME.wasm (a test's own program), as rust_lip."""
    return build_with_make(ROOT / "tests" / "rust_guests" / f"{name}.wasm", RUST)


def as_test_guest(name: str) -> Path:
    """tests/as_guests/NAME.wasm (a test's own program), as as_lip."""
    return build_with_make(ROOT / "tests" / "as_guests" / f"{name}.wasm", ASSEMBLYSCRIPT)
