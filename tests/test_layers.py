"""The package's layering, read from its source with `ast`: each folder of symphony_os is a
layer that imports only the layers below it (README's layout), and no module imports itself
back through others (no cycles). Every import counts: at module level, inside a function, and
under `if TYPE_CHECKING:` alike."""
from __future__ import annotations

import ast
from pathlib import Path

import symphony_os

PACKAGE = Path(symphony_os.__file__).resolve().parent
# Layer -> the layers it may import besides itself. The error table is everyone's, the user's
# cache (cache.py) everyone's who keeps things there; wasm and kv
# know no engine; the model knows the pool; the engine knows kv and the model; LIPs know the
# engine, kv and wasm; the server knows the LIP runtime and what is under it; the client speaks
# HTTP and knows none of it; the command line knows everything.
MAY_IMPORT = {
    "errors": set(),
    "cache": set(),
    "kernels": set(),
    "wasm": {"errors", "cache"},
    "kv": {"errors"},
    "model": {"errors", "cache", "kv", "kernels"},
    "engine": {"errors", "kv", "model", "kernels"},
    "lip": {"errors", "engine", "kv", "wasm"},
    "server": {"errors", "cache", "lip", "engine", "kv", "model", "wasm"},
    "client": {"errors"},
    "cli": {"errors", "cache", "kernels", "wasm", "kv", "model", "engine", "lip", "server", "client"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    return module.split(".")[0]


def imports_of(path: Path) -> set[str]:
    """The symphony_os modules `path` imports (names under symphony_os, without the prefix)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.split(".")[0] == "symphony_os":
                target = node.module.partition(".")[2]
            else:
                continue
            for alias in node.names:  # `from . import x` names a module; `from .x import y` a name in x
                candidate = f"{target}.{alias.name}" if target else alias.name
                found.add(candidate if _is_module(candidate) else target)
        elif isinstance(node, ast.Import):
            found |= {a.name.partition(".")[2] for a in node.names if a.name.split(".")[0] == "symphony_os"}
    return {name for name in found if name and name != here}


def _is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_is_in_a_known_layer():
    assert {layer_of(m) for m in graph()} - {""} <= set(MAY_IMPORT)


def test_imports_point_only_down_the_layers():
    upward = sorted(f"{module} imports {target}" for module, targets in graph().items() for target in targets
                    if layer_of(target) != layer_of(module) and layer_of(target) not in MAY_IMPORT[layer_of(module)])
    assert not upward, "\n".join(upward)


def test_no_module_imports_itself_back():
    imports, cycles = graph(), []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(imports.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(imports):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)
