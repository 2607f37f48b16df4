"""Programs: a LIP's WebAssembly module, validated and compiled once, ready to launch.

A program is a WASI preview-1 command: it exports `_start` and `memory`, and imports only
from `symphony` (the calls of wit/symphony.wit, each with its exact signature) and
`wasi_snapshot_preview1`. Or it is a component (a Python LIP, guest_sdk/python), told apart by
its binary header and checked by `component.py` against the component world's WIT. Anything else is refused here, with one line
saying what is wrong, before any process runs.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import wasmtime
import wasmtime.component

from .compile_limit import compile_refusal
from .component import CompileRefused, check_component, compile_component, printable
from .wit import core_signatures

WASM_MAGIC = b"\x00asm"
CORE_VERSION = b"\x01\x00\x00\x00"
COMPONENT_VERSION = b"\x0d\x00\x01\x00"
MAX_MODULE_BYTES = 64 * 2**20
WASI_MODULE = "wasi_snapshot_preview1"


class ProgramError(Exception):
    """The bytes are not a program Symphony can run; the message says why, in one line."""


@dataclass(frozen=True)
class Program:
    name: str
    sha256: str
    size: int
    module: wasmtime.Module | wasmtime.component.Component

    @property
    def is_component(self) -> bool:
        return isinstance(self.module, wasmtime.component.Component)


def _check_header(data: bytes) -> None:
    if len(data) < 8 or data[:4] != WASM_MAGIC:
        raise ProgramError("not a WebAssembly module (no \\0asm magic number)")
    if data[4:8] not in (CORE_VERSION, COMPONENT_VERSION):
        raise ProgramError(f"unsupported WebAssembly binary version {data[4:8].hex()} "
                           "(neither a core module nor a component)")


def _check_interface(module: wasmtime.Module) -> None:
    table = core_signatures()
    for imp in module.imports:
        where = printable(f"{imp.module}.{imp.name}")
        if imp.module == WASI_MODULE:
            continue
        if imp.module != "symphony":
            raise ProgramError(f"unknown import {where}: only 'symphony' and '{WASI_MODULE}' are provided")
        if imp.name not in table:
            raise ProgramError(f"unknown import {where}: no such system call (see wit/symphony.wit)")
        kind = imp.type
        expected = [str(wasmtime.ValType.i32())] * table[imp.name]
        if (not isinstance(kind, wasmtime.FuncType) or [str(t) for t in kind.params] != expected
                or [str(t) for t in kind.results] != [str(wasmtime.ValType.i32())]):
            raise ProgramError(f"import {where} has the wrong signature: expected "
                               f"({', '.join(['i32'] * table[imp.name])}) -> i32")
    exports = {exp.name: exp.type for exp in module.exports}
    start = exports.get("_start")
    if not isinstance(start, wasmtime.FuncType):
        raise ProgramError("the module exports no _start function (build it as a WASI command)")
    if list(start.params) or list(start.results):
        raise ProgramError("the module's _start must take no parameters and return nothing (a WASI command)")
    if not isinstance(exports.get("memory"), wasmtime.MemoryType):
        raise ProgramError("the module exports no memory")


def load_program(engine: wasmtime.Engine, data: bytes, name: str = "program",
                 compile_time_s: float | None = None) -> Program:
    """Validate and compile untrusted bytes. With `compile_time_s`, a module or component whose
    compilation takes longer, or crashes its compiler, is refused (compiled first in a child
    process: compile_limit.compile_refusal)."""
    if len(data) > MAX_MODULE_BYTES:
        raise ProgramError(f"module is {len(data)} bytes; the limit is {MAX_MODULE_BYTES}")
    _check_header(data)
    if data[4:8] == COMPONENT_VERSION:
        return _load_component(engine, data, name, compile_time_s)
    try:
        wasmtime.Module.validate(engine, data)
        refusal = compile_refusal(data, compile_time_s) if compile_time_s is not None else None
        if refusal is not None:
            raise ProgramError(refusal)
        module = wasmtime.Module(engine, data)
    except wasmtime.WasmtimeError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else "invalid module"
        raise ProgramError(f"invalid WebAssembly: {first_line}") from None
    _check_interface(module)
    return Program(name=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data), module=module)


def _load_component(engine: wasmtime.Engine, data: bytes, name: str, compile_time_s: float | None) -> Program:
    try:
        component = compile_component(engine, data, compile_time_s=compile_time_s)
    except CompileRefused as error:
        raise ProgramError(str(error)) from None
    except wasmtime.WasmtimeError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else "invalid component"
        raise ProgramError(f"invalid WebAssembly component: {first_line}") from None
    problem = check_component(component, engine)
    if problem is not None:
        raise ProgramError(problem)
    return Program(name=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data), module=component)


def load_program_file(engine: wasmtime.Engine, path: str | Path) -> Program:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ProgramError(f"cannot read {path}: {error.strerror}") from None
    return load_program(engine, data, name=path.stem)
