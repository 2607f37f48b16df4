"""Reads `wit/symphony.wit`, the source of truth of the guest interface: programs are validated
against it (core modules' imports: `core_signatures`; components': `component_signatures`),
and the host's call tables and the SDKs are checked against it by the tests."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

# Through the package's link to wit/ (an installed wheel holds a copy there): programs are checked
# against it at run time.
WIT_PATH = Path(__file__).resolve().parents[1] / "wit" / "symphony.wit"


@dataclass(frozen=True)
class WitFunction:
    interface: str
    name: str  # kebab-case, as in the WIT
    params: tuple[str, ...]
    has_result: bool

    @property
    def core_name(self) -> str:
        """The import name of the core-module ABI."""
        return self.name.replace("-", "_")


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", text), flags=re.S)


def _interfaces(path: Path) -> dict[str, str]:
    """Each interface's body, by name (comments removed)."""
    text = _strip_comments(path.read_text())
    return {match.group(1): match.group(2) for match in re.finditer(r"interface\s+([\w-]+)\s*\{(.*?)\n\}", text, re.S)}


def read_wit(path: Path = WIT_PATH) -> tuple[list[WitFunction], list[str]]:
    """The functions of every interface and the error-code cases, in order."""
    functions, errors = [], []
    for interface, body in _interfaces(path).items():
        for fn in re.finditer(r"([\w-]+)\s*:\s*func\(([^)]*)\)\s*(->\s*[^;]+)?;", body):
            params = tuple(p.split(":")[0].strip().lstrip("%") for p in fn.group(2).split(",") if p.strip())
            functions.append(WitFunction(interface, fn.group(1), params, fn.group(3) is not None))
        enum = re.search(r"enum\s+error-code\s*\{(.*?)\}", body, re.S)
        if enum:
            errors = [case.strip() for case in enum.group(1).split(",") if case.strip()]
    return functions, errors


@functools.cache
def core_signatures(path: Path = WIT_PATH) -> dict[str, int]:
    """The core-module ABI's call table: each import name of module `symphony` and its number of
    i32 parameters (each returns one i32)."""
    return {function.core_name: len(function.params) for function in read_wit(path)[0]}


# Through the package's link to guest_sdk/python/wit: an installed wheel holds a copy there.
COMPONENT_WIT_PATH = Path(__file__).resolve().parents[1] / "guest_sdk" / "python" / "wit" / "symphony.wit"
PRIMITIVES = frozenset({"bool", "s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64", "f32", "f64", "char", "string"})
# A named type's definition: its kind, name and body (none for `resource name;`).
TYPE_DEFINITION = re.compile(r"\b(enum|record|variant|flags|resource)\s+(%?[\w-]+)\s*(?:\{(.*?)\}|;)", re.S)


def split_top(text: str) -> list[str]:
    """`text` split at the commas outside angle brackets and parentheses, parts stripped, empty
    parts dropped (a trailing comma)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "<(":
            depth += 1
        elif char in ">)":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def component_interfaces(path: Path = COMPONENT_WIT_PATH) -> list[str]:
    """The interfaces of the component world, in order (types-only ones too)."""
    return list(_interfaces(path))


@functools.cache
def component_signatures(path: Path = COMPONENT_WIT_PATH) -> dict[str, str]:
    """The type of every function of the component interfaces (guest_sdk/python/wit), keyed
    `interface.name` (a resource's methods `interface.[method]resource.name`, with their `self`),
    as `(T, ...)` or `(T, ...) -> R` with every named type written out: `enum{a, b}`,
    `record{field: T}`, `variant{case, case(T)}`, `own<resource>`, `borrow<resource>` (the
    spelling of component.describe_func, which writes the types a component declares)."""
    interfaces = _interfaces(path)
    named: dict[str, dict[str, tuple[str, str]]] = {}  # interface -> type name -> (kind, body)
    for interface, body in interfaces.items():
        named[interface] = {name.lstrip("%"): (kind, inner) for kind, name, inner in TYPE_DEFINITION.findall(body)}
    signatures = {}
    for interface, body in interfaces.items():
        scope = dict(named[interface])
        for source, names in re.findall(r"\buse\s+([\w-]+)\.\{([^}]*)\}\s*;", body):
            for name in split_top(names):
                scope[name] = named[source][name]

        def expand(ty: str) -> str:
            ty = ty.strip().lstrip("%")
            if ty in PRIMITIVES or ty == "_":
                return ty
            if ty == "result":
                return "result<_, _>"
            generic = re.fullmatch(r"([\w-]+)\s*<(.*)>", ty, re.S)
            if generic and generic.group(1) in ("own", "borrow"):  # of a resource, by its name
                return f"{generic.group(1)}<{generic.group(2).strip().lstrip('%')}>"
            if generic:
                head, args = generic.group(1), [expand(arg) for arg in split_top(generic.group(2))]
                if head == "result" and len(args) == 1:
                    args.append("_")
                return f"{head}<{', '.join(args)}>"
            if ty not in scope:
                raise ValueError(f"{path}: interface {interface}: type {ty!r} is not one this reader knows "
                                 "(a primitive, list/option/result/tuple/own/borrow, or an enum, record, "
                                 "variant, flags or resource of the interface or its `use`)")
            kind, inner = scope[ty]
            if kind == "resource":
                return f"own<{ty}>"
            if kind == "record":
                fields = (field.split(":", 1) for field in split_top(inner))
                return "record{" + ", ".join(f"{n.strip().lstrip('%')}: {expand(t)}" for n, t in fields) + "}"
            if kind == "variant":
                cases = (re.fullmatch(r"%?([\w-]+)\s*(?:\((.*)\))?", case, re.S) for case in split_top(inner))
                return "variant{" + ", ".join(c.group(1) + (f"({expand(c.group(2))})" if c.group(2) else "")
                                              for c in cases) + "}"
            return f"{kind}{{{', '.join(name.lstrip('%') for name in split_top(inner))}}}"  # enum, flags

        def signature(params: str, result: str | None, this: str | None = None) -> str:
            types = ([f"borrow<{this}>"] if this else []) + [expand(p.split(":", 1)[1]) for p in split_top(params)]
            return f"({', '.join(types)})" + (f" -> {expand(result)}" if result else "")

        func = r"(%?[\w-]+)\s*:\s*func\(([^)]*)\)\s*(?:->\s*([^;]+))?;"
        for name, (kind, inner) in named[interface].items():
            if kind == "resource" and inner:
                for method, params, result in re.findall(func, inner):
                    key = f"{interface}.[method]{name}.{method.lstrip('%')}"
                    signatures[key] = signature(params, result, this=name)
        top_level = TYPE_DEFINITION.sub("", body)
        for name, params, result in re.findall(func, top_level):
            signatures[f"{interface}.{name.lstrip('%')}"] = signature(params, result)
    return signatures
