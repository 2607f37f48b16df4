"""Where Symphony keeps what it builds once for the user: compiled native code and components
(wasm/), the built-in LIPs (server/), models converted from GGUF (model/)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$SYMPHONY_CACHE, else $XDG_CACHE_HOME/symphony, else ~/.cache/symphony; RuntimeError when
    none of them is set and there is no home directory."""
    if os.environ.get("SYMPHONY_CACHE"):
        return Path(os.environ["SYMPHONY_CACHE"])
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "symphony"
