"""Shared fixtures: the stories260K model from ../shared, and small random Hugging Face models
(Llama, Mistral, Qwen2, Qwen3) built with transformers inside the test run."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from symphony_os.model.random_model import build_random_model

if not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated: set it before any test imports one, so the
    # kernels run in Triton's CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not SHARED_MODEL.is_dir():
        pytest.skip(f"needs the stories260K model at {SHARED_MODEL} (../shared beside the checkout)")
    return SHARED_MODEL


TINY_SHAPES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def build_hf_model(directory: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    """Save a random model of `model_type` with a tokenizer into `directory`; returns it.
    Weights are N(0, 0.2): larger than the default init, so logit errors show."""
    return build_random_model(directory, model_type, seed=seed, init_std=0.2, **{**TINY_SHAPES, **overrides})


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_hf_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def tiny_engine(tiny_llama):
    """An engine on the tiny Llama with a small pool; checks for leaked pages afterwards."""
    from symphony_os.engine.loop import Engine

    engine = Engine.from_path(tiny_llama, device="cpu", page_size=4, num_pages=128)
    yield engine
    engine.stop()
    stats = engine.pool.stats()
    assert stats.used == 0 and stats.swapped == 0, f"leaked KV pages: {stats}"


def pytest_terminal_summary(terminalreporter):
    """How many fuzz inputs ran (tests/test_fuzz.py), so CI logs show the budget spent."""
    fuzzing = sys.modules.get("fuzzing")
    for line in getattr(fuzzing, "SUMMARY", []):
        terminalreporter.write_line(line)


def greedy_continuation(engine, prompt: str, max_tokens: int) -> str:
    """The text greedy decoding appends to `prompt` through the engine's Python API (stops at
    an end-of-sequence token)."""
    from symphony_os.engine.sampling import GREEDY

    session = engine.session()
    handle = session.create()
    feed, out = engine.tokenize(prompt), []
    for _ in range(max_tokens):
        token = engine.pred(session, handle, feed, want=GREEDY).token
        if token in engine.loaded.eos_token_ids:
            break
        out.append(token)
        feed = [token]
    session.close_all()
    return engine.detokenize(out)
