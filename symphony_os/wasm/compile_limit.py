"""The compile-time limit: untrusted bytes are compiled first in a child process killed at a
deadline, since wasmtime's compiler cannot be interrupted and some small modules take
superlinear time; bytes whose compile kills that child are refused too."""
from __future__ import annotations

import subprocess
import sys

# Compiles stdin (a core module, or a component with argv[2] == "1") with an engine like the
# runtime's (epoch checks, fuel) and exits 0 if it compiled.
_COMPILE_PROBE = """
import sys, wasmtime, wasmtime.component
config = wasmtime.Config()
config.epoch_interruption = True
config.consume_fuel = sys.argv[1] == "1"
compile = wasmtime.component.Component if sys.argv[2] == "1" else wasmtime.Module
try:
    compile(wasmtime.Engine(config), sys.stdin.buffer.read())
except wasmtime.WasmtimeError:
    sys.exit(3)
"""
_REFUSED_BY_WASMTIME = 3  # the probe's exit code when wasmtime refused the bytes with an error


def compile_refusal(data: bytes, timeout_s: float, consume_fuel: bool = False, component: bool = False) -> str | None:
    """Why `data` (a core module, or a component) must not be compiled in this process, in one
    line, or None. Compiled first in a child process, killed at the deadline: wasmtime's
    compiler cannot be interrupted, and some small modules take superlinear time (measured:
    29 KB of loop-carried locals took 0.46 s). A child that died (killed for memory, or
    aborted) refuses the bytes too: compiled here, they would take the server down with it.
    Only the outcome is used: the caller compiles the bytes itself once they pass (bytes
    wasmtime refused with an error pass, and the caller's compile says why)."""
    what = "component" if component else "module"
    try:
        done = subprocess.run([sys.executable, "-c", _COMPILE_PROBE, "1" if consume_fuel else "0",
                               "1" if component else "0"], input=data, timeout=timeout_s, capture_output=True)
    except subprocess.TimeoutExpired:
        return f"compiling the {what} took over the limit of {timeout_s:g} s"
    if done.returncode in (0, _REFUSED_BY_WASMTIME):
        return None
    how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
    return f"compiling the {what} failed in a child process ({how}): not compiled in the server"
