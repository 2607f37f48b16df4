"""The models `symphony models` lists: the default (SmolLM2-135M-Instruct when its package is
installed) and the bundled tiny model, $SYMPHONY_MODEL, the models in
`../shared/models` beside the checkout, and Hugging Face directories in the hub cache."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .loader import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME, instruct_model_path

SHARED_MODELS_DIR = Path(__file__).resolve().parents[3] / "shared" / "models"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    kind: str  # where it was found: default, bundled, $SYMPHONY_MODEL, shared, hf-cache
    format: str  # hf (a Hugging Face directory) or gguf
    size_bytes: int
    path: Path

    @property
    def size(self) -> str:
        return f"{self.size_bytes / 2**20:.1f} MiB"


def _entry(path: Path, kind: str, name: str | None = None) -> ModelEntry | None:
    """The model at `path`, or None when it is neither a HF directory nor a .gguf file."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelEntry(name or path.stem, kind, "gguf", path.stat().st_size, path)
    if path.is_dir() and (path / "config.json").is_file():
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        return ModelEntry(name or path.name, kind, "hf", size, path)
    return None


def _hub_cache_entries() -> list[ModelEntry]:
    from huggingface_hub import scan_cache_dir

    try:
        cache = scan_cache_dir()
    except Exception:  # no cache directory yet, or an unreadable one: nothing cached
        return []
    entries = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            entry = _entry(Path(revision.snapshot_path), "hf-cache", repo.repo_id)
            if entry:
                entries.append(entry)
                break
    return entries


def find_models() -> list[ModelEntry]:
    instruct = instruct_model_path()
    candidates: list[ModelEntry | None] = [_entry(instruct, "default") if instruct is not None else None,
                                           _entry(DEFAULT_MODEL_DIR, "bundled" if instruct else "default",
                                                  DEFAULT_MODEL_NAME)]
    if os.environ.get("SYMPHONY_MODEL"):
        candidates.append(_entry(Path(os.environ["SYMPHONY_MODEL"]), "$SYMPHONY_MODEL"))
    if SHARED_MODELS_DIR.is_dir():
        candidates += [_entry(p, "shared") for p in sorted(SHARED_MODELS_DIR.iterdir())]
    candidates += _hub_cache_entries()
    return [c for c in candidates if c is not None]
