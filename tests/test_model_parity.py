"""Logits of our decoder over the paged pool against transformers' own model on the same
weights: a prefill, then 20 decode steps, float32, max abs error <= 1e-4."""
from __future__ import annotations

import pytest
import torch
from conftest import build_hf_model
from transformers import AutoModelForCausalLM

from symphony_os.engine.loop import Engine
from symphony_os.engine.model_runner import SequenceInput
from symphony_os.model.loader import ModelLoadError, load_model

TOLERANCE = 1e-4


def _our_logits(engine: Engine, prompt: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Greedy decoding straight through the model runner over the pool (no sampling step in
    between, so raw logits can be compared); returns each step's logits and the tokens."""
    kv = engine.session()
    handle = kv.create()
    file = kv.file_of(handle, write=True)
    feed, logits, tokens = prompt, [], []
    for _ in range(steps + 1):
        start = file.length
        slots = engine.kvfs.reserve_slots(file, list(range(start, start + len(feed))))
        seq = SequenceInput(feed, list(range(start, start + len(feed))), slots,
                            list(file.pages), file.length, wants_logits=True)
        row = engine.runner.run([seq])[0]
        logits.append(row)
        tokens.append(int(row.argmax()))
        feed = [tokens[-1]]
    kv.close_all()
    return logits, tokens


def _reference_logits(model, prompt: list[int], tokens: list[int], device: str) -> list[torch.Tensor]:
    model = model.to(device)
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0]
    return list(logits[len(prompt) - 1:])


ON_CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))


def assert_matches_transformers(path, prompt: list[int], steps: int = 20, device: str = "cpu",
                                reference_model=None, kernels: bool | None = None, **engine_kwargs) -> None:
    """`reference_model`: transformers' model on the same weights (default: loaded from `path`);
    `kernels`: the model's elementwise steps through the Triton kernels or not (default: as the
    device chooses)."""
    engine = Engine.from_path(path, device=device, dtype="float32", **engine_kwargs)
    if kernels is not None:
        engine.loaded.model.kernels = kernels
    ours, tokens = _our_logits(engine, prompt, steps)
    if reference_model is None:
        reference_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = _reference_logits(reference_model, prompt, tokens, device)
    assert len(ours) == len(reference) == steps + 1
    for step, (a, b) in enumerate(zip(ours, reference)):
        err = (a - b).abs().max().item()
        assert err <= TOLERANCE, f"step {step}: max abs error {err:.2e}"
    assert engine.pool.stats().used == 0


PROMPT = [1, 5, 9, 17, 33, 65, 3, 12, 100, 7]

MODELS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-mha": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama3-rope-scaling": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                           "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 64})),
    "qwen2-attention-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32)),
    "mistral": ("mistral", {}),
    "llama-tanh-gelu": ("llama", dict(hidden_act="gelu_pytorch_tanh")),
    # Windows shorter than the 30 tokens of the test, so they cut.
    "mistral-window-8": ("mistral", dict(sliding_window=8)),
    # Qwen2/3 slide only the layers transformers marks sliding (layer i >= max_window_layers).
    "qwen2-window-on-upper-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen2-window-on-no-layer": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=28)),
    "qwen3-window-on-lower-layer": ("qwen3", dict(head_dim=32, use_sliding_window=True, sliding_window=8,
                                                  layer_types=["sliding_attention", "full_attention"])),
}


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_transformers(name, device, tmp_path):
    model_type, overrides = MODELS[name]
    path = build_hf_model(tmp_path, model_type, **overrides)
    assert_matches_transformers(path, PROMPT, device=device, page_size=4, num_pages=64)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_logits_match_transformers_on_stories260k(stories_path, device):
    engine = Engine.from_path(stories_path, device="cpu")
    prompt = engine.tokenize("Once upon a time, a little dog")
    assert_matches_transformers(stories_path, prompt, device=device, page_size=16, num_pages=64)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_size_does_not_change_logits(tiny_llama, page_size):
    assert_matches_transformers(tiny_llama, PROMPT, steps=6, page_size=page_size, num_pages=256)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_stays_close(tiny_llama, dtype):
    engine = Engine.from_path(tiny_llama, device="cpu", dtype=dtype, page_size=4, num_pages=32)
    assert engine.pool.k.dtype == getattr(torch, dtype)
    full, _ = _our_logits(Engine.from_path(tiny_llama, device="cpu", page_size=4, num_pages=32), PROMPT, 2)
    half, _ = _our_logits(engine, PROMPT, 2)
    full_probs, half_probs = torch.softmax(full[0], -1), torch.softmax(half[0], -1)
    assert (full_probs - half_probs).abs().max() < 0.05


def test_loading_errors_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="not supported"):
        load_model(tmp_path)


ON_CPU_INTERPRETED = pytest.param("cpu", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="with a GPU, Triton runs kernels there, not on CPU tensors (no interpreter)"))


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen3-qk-norm", "llama-tanh-gelu"])
def test_the_elementwise_kernels_match_transformers(name, tmp_path):
    """Norms (after the residual add too, and of q/k heads), RoPE and the SiLU gate through the
    Triton kernels, as on CUDA, here in the interpreter (a GELU model keeps torch's gate)."""
    model_type, overrides = MODELS[name]
    path = build_hf_model(tmp_path, model_type, **overrides)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert_matches_transformers(path, PROMPT, steps=3, device=device, kernels=True, page_size=4, num_pages=64)


@pytest.mark.parametrize("device", [ON_CPU_INTERPRETED, ON_CUDA])
def test_triton_attention_backend_matches_transformers(tiny_llama, device):
    # On CPU the kernels run in Triton's interpreter (slow): a few steps are enough.
    assert_matches_transformers(tiny_llama, PROMPT, steps=3, device=device, page_size=4, num_pages=64,
                                attention="triton")


WINDOW_MODELS = ["mistral-window-8", "qwen2-window-on-upper-layers", "qwen3-window-on-lower-layer"]


@pytest.mark.parametrize("device", [ON_CPU_INTERPRETED, ON_CUDA])
@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_triton_attention_slides_its_windows_as_transformers(name, device, tmp_path):
    """The Triton kernels refused sliding windows on CUDA, so such models ran there only with
    --attention torch. The window cuts the 10-token prompt's prefill and every decode step."""
    model_type, overrides = MODELS[name]
    path = build_hf_model(tmp_path, model_type, **overrides)
    assert_matches_transformers(path, PROMPT, steps=3, device=device, page_size=4, num_pages=64, attention="triton")
