"""CUDA graphs of decode batches: a replay gives the eager forward pass's logits on the same
inputs and cache, for batches padded up to a captured size; engines with and without graphs
generate the same tokens; mixed batches and $SYMPHONY_CUDA_GRAPHS=0 run eagerly."""
from __future__ import annotations

import pytest
import torch

from symphony_os.engine.loop import Engine
from symphony_os.engine.model_runner import SequenceInput
from symphony_os.engine.sampling import Sample

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")

PROMPTS = [[1, 5, 9, 17, 33, 65, 3, 12, 100, 7, 8, 9, 10], [1, 40], [1, 90, 91, 92, 93, 94],
           [1, 7, 7, 7, 7, 7, 7, 7, 7], [1, 2, 3], [1, 127, 64, 32, 16, 8, 4, 2, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8]]


def decode_inputs(engine: Engine, files, tokens: list[int]) -> list[SequenceInput]:
    """One new token per file, its slot reserved (as the engine's _prepare does)."""
    seqs = []
    for file, token in zip(files, tokens):
        position = file.length
        slots = engine.kvfs.reserve_slots(file, [position])
        seqs.append(SequenceInput([token], [position], slots, list(file.pages),
                                  file.length, wants_logits=True))
    return seqs


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_replay_matches_eager_logits_for_padded_batches(tiny_llama, dtype, tolerance):
    engine = Engine.from_path(tiny_llama, device="cuda", dtype=dtype, page_size=4, num_pages=512)
    graphs = engine.runner.graphs
    assert graphs is not None
    for batch in (1, 3, 6):  # graphs of 1, 4 and 8 rows
        kv = engine.session()
        handles = [kv.create() for _ in range(batch)]
        feeds = [engine.pred(kv, h, PROMPTS[i]).token for i, h in enumerate(handles)]
        files = [kv.file_of(h, write=True) for h in handles]
        for _ in range(6):
            seqs = decode_inputs(engine, files, feeds)
            eager = engine.runner.run_eager(seqs)  # stores the same K/V the replay stores again
            replayed = engine.runner.run(seqs)
            assert replayed.shape == eager.shape == (batch, 128)
            # Padding changes the rows cuBLAS sees, so the sums may round differently.
            assert float((replayed - eager).norm() / eager.norm()) < tolerance
            feeds = eager.argmax(-1).tolist()
        kv.close_all()
    assert graphs.captured_sizes == [1, 4, 8]
    assert engine.pool.stats().used == 0


def generate(engine: Engine, steps: int) -> list[list[int]]:
    """Greedy tokens of PROMPTS, all in flight together; the first step is a prefill batch,
    the second mixes prefills of late prompts with decodes, the rest are pure decode."""
    kv = engine.session()
    handles = [kv.create() for _ in PROMPTS]
    feeds = [list(p) for p in PROMPTS]
    out = [[] for _ in PROMPTS]
    for step in range(steps):
        active = range(len(PROMPTS)) if step else range(0, len(PROMPTS), 2)
        futures = {i: engine.submit(kv, handles[i], feeds[i], want=Sample()) for i in active}
        engine.run_until_idle()
        for i, future in futures.items():
            out[i].append(future.result().token)
            feeds[i] = [out[i][-1]]
    kv.close_all()
    return out


def test_engines_with_and_without_graphs_generate_the_same_tokens(tiny_llama, monkeypatch):
    with_graphs = Engine.from_path(tiny_llama, device="cuda", dtype="float32", page_size=4, num_pages=512)
    monkeypatch.setenv("SYMPHONY_CUDA_GRAPHS", "0")
    eager = Engine.from_path(tiny_llama, device="cuda", dtype="float32", page_size=4, num_pages=512)
    assert eager.runner.graphs is None
    assert generate(with_graphs, 10) == generate(eager, 10)
    assert with_graphs.runner.graphs.captured_sizes == [8]  # six decodes padded to 8; mixed batches eager


def test_torch_backend_runs_eagerly_on_cuda(tiny_llama):
    engine = Engine.from_path(tiny_llama, device="cuda", dtype="float32", page_size=4, num_pages=64,
                              attention="torch")
    assert engine.runner.graphs is None
