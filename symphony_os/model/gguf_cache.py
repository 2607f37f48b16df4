"""GGUF models kept converted in the user's cache (`models` in cache.cache_root()), keyed by the
file's content: the first load dequantizes the file through transformers (SmolLM2-135M's 98 MB
took 28 s and 2.1 GB here), every later one reads the converted weights back as a Hugging Face
directory (config.json, model.safetensors, the tokenizer's files) in a few seconds."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from ..cache import cache_root

ROPE_FREQS = "rope_freqs.pt"  # llama.cpp's per-frequency RoPE factors, when the file has them
DIGESTS = "digests.json"  # (path, size, modification time) -> the file's sha256
# Every field of the converted model's config (transformers' to_dict, defaults included), read
# back without transformers' config classes (stored_config).
FULL_CONFIG = "symphony-config.json"
log = logging.getLogger("symphony.model")


def converted_dir(path: Path) -> Path | None:
    """Where the converted model of the GGUF file at `path` is kept (whether or not it is there
    yet): named by the sha256 of the file's bytes. None when there is no cache (no home). The
    digest is remembered per (path, size, modification time) in `digests.json`: a 4 GB file
    takes ~8 s to hash, every load."""
    try:
        root = cache_root() / "models"
    except RuntimeError:
        return None
    return root / f"{path.stem}-{_digest(root / DIGESTS, path)[:32]}"


def _digest(index_path: Path, path: Path) -> str:
    status = path.stat()
    key = f"{path.resolve()}|{status.st_size}|{status.st_mtime_ns}"
    try:
        index = json.loads(index_path.read_text())
        if not isinstance(index, dict):
            index = {}
    except (OSError, ValueError):
        index = {}
    digest = index.get(key)
    if isinstance(digest, str) and len(digest) == 64:
        return digest
    digest = file_sha256(path)
    index[key] = digest
    try:
        index_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _replace_text(index_path, json.dumps(index))
    except OSError as error:
        log.warning("cannot remember the digest of %s: %s", path, error)
    return digest


def _replace_text(path: Path, text: str) -> None:
    """Write `path` beside itself and rename it into place: a reader sees the old text or the new."""
    staging = path.with_name(f".{path.name}-{os.getpid()}")
    staging.write_text(text)
    os.replace(staging, path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def rope_freqs_of(directory: Path) -> torch.Tensor | None:
    path = directory / ROPE_FREQS
    return torch.load(path, weights_only=True) if path.is_file() else None


def stored_config(directory: Path) -> SimpleNamespace | None:
    """The converted model's config as a plain object with every field as an attribute, or None
    when the directory has none (converted by an older Symphony) or its RoPE is not the default
    (whose frequencies transformers computes from its own config class). Importing transformers'
    LlamaConfig takes ~1.1 s here (its module pulls in torch.distributed and sympy): a quarter of
    the default model's second load."""
    try:
        fields = json.loads((directory / FULL_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        return None
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    if not isinstance(rope, dict) or (rope.get("rope_type") or rope.get("type") or "default") != "default":
        return None
    return SimpleNamespace(**fields)


def keep_full_config(directory: Path, hf_config) -> None:
    """Add the full config (FULL_CONFIG) to a conversion made before it was kept (best effort)."""
    try:
        _replace_text(directory / FULL_CONFIG, json.dumps(hf_config.to_dict()))
    except OSError as error:
        log.warning("cannot add the full config to %s: %s", directory, error)


def keep_converted(directory: Path, hf_config, tensors: dict[str, torch.Tensor], tokenizer,
                   rope_freqs: torch.Tensor | None) -> None:
    """Write a converted model to `directory`: into a fresh directory beside it, renamed into place
    once complete, so a reader sees all of it or none (and of two writers, the first's stays). A
    failure (a full disk, say) is logged: the model is loaded all the same."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    except OSError as error:
        log.warning("cannot keep the converted model in %s: %s", directory.parent, error)
        return
    try:
        hf_config.save_pretrained(staging)
        (staging / FULL_CONFIG).write_text(json.dumps(hf_config.to_dict()))
        tokenizer.save_pretrained(staging)
        seen: set[int] = set()
        weights = {}
        for name, tensor in tensors.items():  # tied tensors share storage: safetensors takes copies
            tensor = tensor.contiguous()
            weights[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
            seen.add(tensor.data_ptr())
        save_file(weights, str(staging / "model.safetensors"))
        if rope_freqs is not None:
            torch.save(rope_freqs, staging / ROPE_FREQS)
        os.rename(staging, directory)
    except OSError as error:
        if not directory.is_dir():
            log.warning("cannot keep the converted model in %s: %s", directory, error)
        shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
