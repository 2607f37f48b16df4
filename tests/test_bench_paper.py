"""bench/paper.py at a tiny size: every workload runs both ways (programs and prompts) on one real
`symphony serve` over loopback HTTP, and both ways compute the same thing. No timing asserted."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from symphony_os.model.random_model import build_random_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import paper  # noqa: E402

VOCAB = 4096  # large enough that greedy text rarely holds a special token the text path drops


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model = build_random_model(tmp_path_factory.mktemp("paper-model"), "llama", seed=0, vocab_size=VOCAB,
                               hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=2048)
    paper.build_lips()
    size = paper.SIZES["tiny"]
    with paper.Server(model, size["kv_pages"], size["page_size"]) as server:
        return asyncio.run(paper.run_workloads(server.url, model, size, list(paper.WORKLOADS), VOCAB,
                                               log=lambda *a, **k: None))


def all_comparisons(results):
    for name, result in results.items():
        for row in result.get("shapes", [result]):
            yield name, row


def test_every_workload_ran_both_ways(results):
    assert set(results) == set(paper.WORKLOADS)
    for name, row in all_comparisons(results):
        program, prompt = row["programs"], row["prompts"]
        assert program["units"] == prompt["units"] > 0, name
        assert program["generated_tokens"] > 0 and prompt["generated_tokens"] > 0, name
        assert program["http_requests_per_unit"] == 2, name  # launch + WebSocket, whatever the workload


def test_programs_and_prompts_produce_the_same_tokens(results):
    for name, row in all_comparisons(results):
        same, total = row["identical_outputs"].split("/")
        assert same == total, f"{name}: {row['identical_outputs']} identical outputs"
        assert row["programs"]["generated_tokens"] == row["prompts"]["generated_tokens"], name


def test_client_loops_pay_round_trips_and_reprefill(results):
    size = paper.SIZES["tiny"]
    react = results["react"]
    assert react["prompts"]["http_requests_per_unit"] == size["react"]["turns"] + 1
    # The agent's transcript lives in one KV file: nothing is computed twice.
    assert react["programs"]["engine_tokens"] < react["prompts"]["engine_tokens"]
    assert results["got"]["programs"]["engine_tokens"] < results["got"]["prompts"]["engine_tokens"]
    assert results["swarm"]["prompts"]["http_requests_per_unit"] == size["swarm"]["turns"]
