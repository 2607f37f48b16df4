"""Components (Python LIPs built with componentize-py): compiled through a cache of our own,
and checked against the component world before anything runs (guest_sdk/python/wit).

A component may import only our interfaces and WASI preview 2, each of our functions with the
exact type the WIT gives it, and must export `run: func() -> s32`. The types matter: our host
functions are dynamically typed (wasmtime links any type to them), and a value read or written
as another type than the guest's crashed the host.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import wasmtime
import wasmtime.component as wc

from .compile_cache import CACHE_DIR, CompileCache
from .compile_limit import compile_refusal
from .wit import component_interfaces, component_signatures

PACKAGE, PACKAGE_VERSION = "symphony:component", "0.1.0"
RUN_EXPORT = "run"
# What wasmtime's WASI preview 2 linker provides (no wasi:http). The process's WASI context has no
# preopened directories and no network: these imports link, and a file or socket call fails.
WASI_PACKAGES = frozenset({"wasi:cli", "wasi:clocks", "wasi:filesystem", "wasi:io", "wasi:random", "wasi:sockets"})


def printable(name: str) -> str:
    """A guest-chosen name as it may appear in a one-line message: control characters escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)


def _engine_fingerprint(engine: wasmtime.Engine) -> str:
    """Compiled code depends on the engine's configuration: cache files are per engine config.
    A tiny module serialized by this engine carries its wasmtime version and config hash."""
    probe = wasmtime.Module(engine, b"\x00asm\x01\x00\x00\x00").serialize()
    return hashlib.sha256(bytes(probe)).hexdigest()[:16]


class CompileRefused(Exception):
    """Compiling the component took over the time limit it was given, or crashed the compiler."""


def compile_component(engine: wasmtime.Engine, data: bytes, cache_dir: Path | None = CACHE_DIR,
                      compile_time_s: float | None = None) -> wc.Component:
    """Compile component bytes, through a cache of our own compiled files (compile_cache.py)
    keyed by the bytes' sha256 and the engine's configuration. With `compile_time_s`, bytes not
    in the cache are first compiled in a child process killed at that deadline
    (compile_limit.compile_refusal): CompileRefused if it was reached, or the child died."""
    cache = CompileCache.open(cache_dir) if cache_dir is not None else None
    try:
        key = f"{_engine_fingerprint(engine)}-{hashlib.sha256(data).hexdigest()}"
        compiled = cache.load(key) if cache is not None else None
        if compiled is not None:
            try:
                return wc.Component.deserialize(engine, compiled)  # the bytes whose digest was checked
            except wasmtime.WasmtimeError:
                pass  # written by another wasmtime: compile again
        refusal = compile_refusal(data, compile_time_s, component=True) if compile_time_s is not None else None
        if refusal is not None:
            raise CompileRefused(refusal)
        component = wc.Component(engine, data)
        if cache is not None:
            cache.store(key, component.serialize())
        return component
    finally:
        if cache is not None:
            cache.close()


def check_component(component: wc.Component, engine: wasmtime.Engine) -> str | None:
    """Why a component cannot run here (one line), or None: it may import only our interfaces
    and WASI, each of our functions with the type guest_sdk/python/wit gives it, and must
    export `run: func() -> s32`. The types matter: our host functions are dynamically typed
    (wasmtime links any type to them), and a value read or written as another type than the
    guest's crashed the host."""
    ty = component.type
    for name, item in ty.imports(engine).items():
        if not (name.startswith(f"{PACKAGE}/") or name.split("/", 1)[0] in WASI_PACKAGES):
            return (f"unknown import {printable(name)}: only {PACKAGE}/* ({PACKAGE_VERSION}) and "
                    f"{', '.join(sorted(WASI_PACKAGES))} are provided")
        if name.startswith(f"{PACKAGE}/"):
            if name.split("/", 1)[1] not in {f"{interface}@{PACKAGE_VERSION}" for interface in component_interfaces()}:
                return f"unknown import {printable(name)}: no such interface (see guest_sdk/python/wit/symphony.wit)"
            if not isinstance(item.ty, wc.ComponentInstanceType):
                return f"import {printable(name)} must be an instance (of the interface's functions)"
            problem = _check_interface(name.split("/", 1)[1].split("@")[0], item.ty, engine)
            if problem is not None:
                return problem
    run = ty.exports(engine).get(RUN_EXPORT)
    run = run.ty if run is not None else None
    if not (isinstance(run, wc.FuncType) and not run.params and isinstance(run.result, wc.S32)):
        return f"the component exports no `{RUN_EXPORT}: func() -> s32` (build it with the lip-python world)"
    return None


def _check_interface(interface: str, instance: wc.ComponentInstanceType, engine: wasmtime.Engine) -> str | None:
    """Why the functions a component imports from one of our interfaces do not match the WIT."""
    expected = component_signatures()
    items = {name: item.ty for name, item in instance.exports(engine).items()}
    resources = [(ty, name) for name, ty in items.items() if isinstance(ty, wc.ResourceType)]
    for name, ty in items.items():
        qualified = f"{interface}.{name}"
        if not isinstance(ty, wc.FuncType):
            if isinstance(ty, (wc.ResourceType, wc.ValType)):
                continue  # types (error-code, sampling, ...) matter where a function uses them
            return f"import {printable(qualified)} is a {type(ty).__name__}: an interface holds functions and types"
        if qualified not in expected:
            return f"unknown import {printable(qualified)}: no such function in {PACKAGE}/{interface}"
        declared = describe_func(ty, resources)
        if declared != expected[qualified]:
            return (f"import {printable(qualified)} is declared as {printable(declared)[:300]}; "
                    f"the host provides {expected[qualified][:300]}")
    return None


def describe_func(ty: wc.FuncType, resources: list[tuple[wc.ResourceType, str]]) -> str:
    """A function type in wit.component_signatures' spelling; a resource by the name its
    instance exports it under (`resources`), else `?`."""
    params = ", ".join(describe(param, resources) for _, param in ty.params)
    result = ty.result
    return f"({params})" + (f" -> {describe(result, resources)}" if result is not None else "")


def describe(ty, resources: list[tuple[wc.ResourceType, str]]) -> str:
    """A component value type in WIT's syntax, named types written out (see describe_func)."""
    def inner(t) -> str:
        return "_" if t is None else describe(t, resources)

    if isinstance(ty, wc.ListType):
        return f"list<{inner(ty.element)}>"
    if isinstance(ty, wc.OptionType):
        return f"option<{inner(ty.payload)}>"
    if isinstance(ty, wc.ResultType):
        return f"result<{inner(ty.ok)}, {inner(ty.err)}>"
    if isinstance(ty, wc.TupleType):
        return f"tuple<{', '.join(inner(t) for t in ty.elements)}>"
    if isinstance(ty, wc.RecordType):
        return "record{" + ", ".join(f"{name}: {inner(t)}" for name, t in ty.fields) + "}"
    if isinstance(ty, wc.VariantType):
        return "variant{" + ", ".join(name + ("" if t is None else f"({inner(t)})") for name, t in ty.cases) + "}"
    if isinstance(ty, wc.EnumType):
        return "enum{" + ", ".join(ty.names) + "}"
    if isinstance(ty, wc.FlagsType):
        return "flags{" + ", ".join(ty.names) + "}"
    if isinstance(ty, (wc.OwnType, wc.BorrowType)):
        name = next((name for resource, name in resources if resource == ty.ty), "?")
        return f"{'own' if isinstance(ty, wc.OwnType) else 'borrow'}<{name}>"
    return type(ty).__name__.lower()  # the primitives: S32 is s32, String string
