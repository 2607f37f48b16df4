"""Tools a LIP may call inside the server (the `tool` system call), registered by the operator.

A tool is a function from one UTF-8 string to another. Only what the operator registers in a
`ToolRegistry` can be called; a LIP names the tool and passes its input, and gets the output in
its own memory, with no round trip to its client. Tools run on the calling process's worker
thread, so a registered tool must be quick (the built-ins take microseconds).

The built-ins: `calculator` (arithmetic, parsed with `ast`, never evaluated as Python) and
`docs` (lookup in a local table of short documentation entries).
"""
from __future__ import annotations

import ast
import math
import operator
from collections import deque
from typing import Callable

from ..errors import InvalidArgument, Unsupported

Tool = Callable[[str], str]

MAX_TOOL_INPUT_BYTES = 4096
MAX_CALC_NODES = 64
MAX_POWER_EXPONENT = 64
MAX_INT_BITS = 512  # every intermediate integer stays below 2**512: no memory blow-up
RECENT_CALLS_KEPT = 1000


class ToolRegistry:
    """The tools of one runtime, by name. `call` raises `Unsupported` for a name nobody
    registered and `InvalidArgument` for input the tool refuses."""

    def __init__(self, tools: dict[str, Tool] | None = None):
        self._tools: dict[str, Tool] = dict(tools or {})
        # (name, input) of the latest calls, for the operator: bounded, a server runs for long
        self.calls: deque[tuple[str, str]] = deque(maxlen=RECENT_CALLS_KEPT)

    def register(self, name: str, tool: Tool) -> None:
        self._tools[name] = tool

    def names(self) -> list[str]:
        return sorted(self._tools)

    def call(self, name: str, text: str) -> str:
        tool = self._tools.get(name)
        if tool is None:
            raise Unsupported(f"no tool named {name!r} (the operator registered: {', '.join(self.names())})")
        if len(text.encode()) > MAX_TOOL_INPUT_BYTES:
            raise InvalidArgument(f"tool input is limited to {MAX_TOOL_INPUT_BYTES} bytes")
        self.calls.append((name, text))
        return tool(text)


# ---- the calculator ----

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate arithmetic: numbers, + - * / // % ** and parentheses, on real numbers. Anything
    else (names, calls, attributes, complex results, integers past MAX_INT_BITS) is refused
    with InvalidArgument: the tree is walked, never handed to `eval`."""
    if len(expression.encode()) > MAX_TOOL_INPUT_BYTES:
        raise InvalidArgument(f"calculator: the expression is limited to {MAX_TOOL_INPUT_BYTES} bytes")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: a NUL byte
        raise InvalidArgument(f"calculator: cannot parse {expression[:40]!r}") from None
    except (RecursionError, MemoryError):  # thousands of nested unary signs or parentheses
        raise InvalidArgument("calculator: the expression is nested too deeply") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_CALC_NODES:
        raise InvalidArgument("calculator: expression too long")

    def checked(result: float | int | complex) -> float | int:
        if isinstance(result, complex):  # a negative number to a fractional power
            raise InvalidArgument("calculator: the result is not a real number")
        if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
            raise InvalidArgument(f"calculator: integers are limited to {MAX_INT_BITS} bits")
        return result

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return checked(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER_EXPONENT:
                raise InvalidArgument(f"calculator: exponents are limited to {MAX_POWER_EXPONENT}")
            return checked(_BINARY[type(node.op)](left, right))
        raise InvalidArgument(f"calculator: only numbers and + - * / // % ** are allowed, not {ast.dump(node)[:40]}")

    try:
        result = value(tree.body)
    except ZeroDivisionError:
        raise InvalidArgument("calculator: division by zero") from None
    except (OverflowError, MemoryError):
        raise InvalidArgument("calculator: the result is too large") from None
    except InvalidArgument:  # value()'s own refusals, which say why (InvalidArgument is a ValueError)
        raise
    except (RecursionError, TypeError, ValueError) as error:
        raise InvalidArgument(f"calculator: cannot evaluate ({type(error).__name__})") from None
    if isinstance(result, float):
        if not math.isfinite(result):
            raise InvalidArgument("calculator: the result is not finite")
        if result.is_integer():
            result = int(result)
    return str(result)


# ---- documentation lookup ----

DOCS = {
    "pred": "pred appends tokens to a KV file and returns the next-token distribution, its top-k, or a sampled token.",
    "kv_fork": "kv_fork makes a new KV file sharing the pages of another, copy-on-write.",
    "kv_hint": "kv_hint sets eviction hints on a KV file: pinned, drop on close, keep for N ms, priority.",
    "tool": "tool calls an operator-registered tool by name and returns its output to the program.",
    "lip": "A LIP is an LLM inference program: a WebAssembly module that drives generation itself.",
    "cat": "A cat is a small furry animal that likes milk and naps in the sun.",
}


def docs(topic: str) -> str:
    """The documentation entry for `topic` (case-insensitive), or a line saying there is none."""
    return DOCS.get(topic.strip().lower(), f"no documentation for {topic.strip()!r}")


def default_tools() -> ToolRegistry:
    """The built-in tools: what `symphony run` offers, and the default of every runtime."""
    return ToolRegistry({"calculator": calculator, "docs": docs})
