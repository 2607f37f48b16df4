"""Reads `wit/symphony.wit`, the source of truth of the guest interface, so the host and the
tests can check themselves against it."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

WIT_PATH = Path(__file__).resolve().parent.parent / "wit" / "symphony.wit"


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
    return re.sub(r"//[^\n]*", "", text)


def read_wit(path: Path = WIT_PATH) -> tuple[list[WitFunction], list[str]]:
    """The functions of every interface and the error-code cases, in order."""
    text = _strip_comments(path.read_text())
    functions, errors = [], []
    for match in re.finditer(r"interface\s+([\w-]+)\s*\{(.*?)\n\}", text, re.S):
        interface, body = match.group(1), match.group(2)
        for fn in re.finditer(r"([\w-]+)\s*:\s*func\(([^)]*)\)\s*(->\s*[^;]+)?;", body):
            params = tuple(p.split(":")[0].strip().lstrip("%") for p in fn.group(2).split(",") if p.strip())
            functions.append(WitFunction(interface, fn.group(1), params, fn.group(3) is not None))
        enum = re.search(r"enum\s+error-code\s*\{(.*?)\}", body, re.S)
        if enum:
            errors = [case.strip() for case in enum.group(1).split(",") if case.strip()]
    return functions, errors
