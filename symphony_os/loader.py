"""Loading a Llama-family model from a Hugging Face directory (config.json, *.safetensors,
tokenizer files) with transformers' config and tokenizer classes and safetensors."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from .model import DecoderModel, ModelConfig, rope_inv_freq

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(Exception):
    """The directory does not hold a model Symphony can load; the message says why."""


@dataclass
class LoadedModel:
    """A model ready to run, with what a LIP asks about it."""

    name: str
    path: Path
    model: DecoderModel
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """float32 on CPU, bfloat16 on GPU unless asked otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def _arrange_weights(raw: dict[str, torch.Tensor], cfg: ModelConfig, dtype, device) -> dict[str, torch.Tensor]:
    """Map Hugging Face tensor names onto ours, fusing q/k/v and gate/up."""
    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ModelLoadError(f"weight {name!r} is missing from the checkpoint")
        return raw[name]

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    out = {"embed": put(take("model.embed_tokens.weight")), "norm": put(take("model.norm.weight"))}
    if "lm_head.weight" in raw and not cfg.tie_word_embeddings:
        out["lm_head"] = put(raw["lm_head.weight"])
    else:
        out["lm_head"] = out["embed"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = [take(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        layer = {
            "input_norm": take(f"{p}input_layernorm.weight"),
            "post_norm": take(f"{p}post_attention_layernorm.weight"),
            "qkv": torch.cat(attn),
            "o": take(f"{p}self_attn.o_proj.weight"),
            "gate_up": torch.cat([take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")]),
            "down": take(f"{p}mlp.down_proj.weight"),
        }
        if f"{p}self_attn.q_proj.bias" in raw:  # Qwen2 (and Llama with attention_bias)
            layer["qkv_bias"] = torch.cat([take(f"{p}self_attn.{n}_proj.bias") for n in "qkv"])
        if f"{p}self_attn.o_proj.bias" in raw or f"{p}mlp.down_proj.bias" in raw:
            raise ModelLoadError("output-projection and MLP biases are not supported")
        if f"{p}self_attn.q_norm.weight" in raw:  # Qwen3
            layer["q_norm"] = take(f"{p}self_attn.q_norm.weight")
            layer["k_norm"] = take(f"{p}self_attn.k_norm.weight")
        out.update({f"layers.{i}.{k}": put(v) for k, v in layer.items()})
    return out


def _eos_ids(path: Path, hf_config, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources = [json.loads(gen.read_text()).get("eos_token_id")] if gen.exists() else []
    sources += [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)


def load_model(path: str | Path, dtype: str | torch.dtype | None = None, device: str | None = None) -> LoadedModel:
    """Load the model in a Hugging Face directory onto `device` (default: cuda when present)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    hf_config = AutoConfig.from_pretrained(str(path))
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model type {hf_config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    cfg = ModelConfig.from_hf(hf_config)
    weights = _arrange_weights(_read_safetensors(path), cfg, torch_dtype, device)
    inv_freq, rope_scale = rope_inv_freq(hf_config)
    model = DecoderModel(cfg, weights, inv_freq, rope_scale)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return LoadedModel(
        name=path.resolve().name,
        path=path,
        model=model,
        config=cfg,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(path, hf_config, tokenizer),
        bos_token_id=tokenizer.bos_token_id,
    )


def default_model_path() -> Path:
    """$SYMPHONY_MODEL, else the stories260K model in ../shared beside the checkout."""
    env = os.environ.get("SYMPHONY_MODEL")
    if env:
        return Path(env)
    shared = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K"
    if shared.is_dir():
        return shared
    raise ModelLoadError("no default model here: pass --model DIR (a Hugging Face directory) or set SYMPHONY_MODEL")
