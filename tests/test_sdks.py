"""The SDKs: the Rust and AssemblyScript programs, built with the real toolchains, compute the
same tokens as the C ones; the SDKs' helpers agree with torch."""
import pytest
import torch
from guests import ROOT, as_lip, as_test_guest, build_c, lip, rust_lip, rust_test_guest

from symphony_os.engine.loop import Engine
from symphony_os.lip.runtime import Runtime


@pytest.fixture(scope="module")
def runtime(stories_path):
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=1024)
    with Runtime(engine) as runtime:
        yield runtime
    engine.stop()


def run(runtime, path, args):
    out, log = [], []
    process = runtime.spawn(runtime.load(path), args, on_output=out.append, on_log=log.append)
    assert runtime.wait(process, 120) == 0, (process.end_reason, "".join(log))
    return b"".join(out).decode()


BUILDS = {"c": lip, "rust": rust_lip, "assemblyscript": as_lip}


@pytest.mark.parametrize("prompt", ["Once upon a time", "Tom and his dog"])
def test_basic_decoding_gives_the_same_tokens_in_every_language(runtime, prompt):
    outputs = {language: run(runtime, build("hello"), [prompt, "40"]) for language, build in BUILDS.items()}
    assert outputs["c"].startswith(prompt) and len(outputs["c"]) > len(prompt) + 40
    assert outputs["rust"] == outputs["c"]
    assert outputs["assemblyscript"] == outputs["c"]


def test_parallel_decoding_matches_across_languages(runtime):
    args = ["Once upon a time, there was a cat.", "10", "The cat", "One day", "Tom"]
    outputs = {language: run(runtime, build("parallel"), args) for language, build in BUILDS.items()}
    assert outputs["c"].count("\n") == 3 and outputs["c"].startswith("[0] The cat")
    assert outputs["rust"] == outputs["c"] == outputs["assemblyscript"]


ARGMAX_GUESTS = {  # each reads float32 arrays (a message each) and sends back its SDK's argmax
    "c-simd128": lambda tmp: build_c(ROOT / "tests" / "c_guests" / "argmax.c", tmp / "argmax.wasm"),
    "c-scalar": lambda tmp: build_c(ROOT / "tests" / "c_guests" / "argmax.c", tmp / "argmax.wasm", simd=False),
    "rust": lambda tmp: rust_test_guest("argmax"),
    "assemblyscript": lambda tmp: as_test_guest("argmax"),
}


@pytest.mark.parametrize("sdk", ARGMAX_GUESTS)
def test_sdk_argmax_is_torch_argmax(runtime, tmp_path, sdk):
    """Each SDK's argmax helper (C's sym_argmax on its SIMD and scalar paths): the first of equal
    maxima, the first NaN if there is one, as torch.argmax; maxima in the first and the last
    block of sixteen, in the tail, at the ends. (Python guests ask the host: component.py.)"""
    program = ARGMAX_GUESTS[sdk](tmp_path)
    torch.manual_seed(0)
    arrays = [torch.rand(n) for n in (1, 3, 7, 8, 9, 4096, 24_577)]
    arrays += [torch.zeros(13), -torch.rand(100), torch.tensor([1.0, 5, 2, 5, 5, 0, 5, 1, 1]),
               torch.tensor([0.0] * 9 + [2, 0, 2, 2]), torch.tensor([3.0, 1, 1, 1, 1, 1, 1, 1, 3, 3])]
    for n in (16, 17, 35, 24_576):
        for where in sorted({0, 1, 15, 16, n // 2, n - 17, n - 2, n - 1} & set(range(n))):
            values = torch.rand(n)
            values[where] = 2.0
            values[min(where + 5, n - 1)] = 2.0  # a tie after it: the first one counts
            arrays.append(values)
    nan = float("nan")
    arrays += [torch.tensor([1.0] * 20 + [nan] + [5.0] * 3), torch.tensor([nan] + [1.0] * 40),
               torch.tensor([1.0] * 39 + [nan]), torch.tensor([0.0, 9, nan, 9, nan]),
               torch.tensor([-0.0] * 3 + [0.0] * 30), torch.tensor([0.0] + [-0.0] * 30),
               torch.full((40,), float("-inf")), torch.tensor([float("-inf")] * 30 + [-1e30] + [float("-inf")] * 5),
               torch.tensor([1.0] * 18 + [float("inf")] + [2.0] * 20)]
    out = []
    process = runtime.spawn(runtime.load(program), on_output=out.append)
    for values in arrays:
        process.deliver(values.numpy().astype("<f4").tobytes())
    process.close_input()
    assert runtime.wait(process, 60) == 0, process.end_reason
    assert [int(line) for line in b"".join(out).split()] == [int(values.argmax()) for values in arrays]


@pytest.mark.parametrize("language", sorted(BUILDS))
def test_every_end_of_sequence_id_ends_generation_however_many(stories_path, tmp_path, language):
    """The C, Rust and AssemblyScript SDKs read at most 8 end-of-sequence ids: a model listing the
    token that ends its text ninth or later generated past it."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(stories_path, model)
    engine = Engine.from_path(model, device="cpu", page_size=16, num_pages=256)
    prompt = "Once upon a time"
    kv = engine.session()
    first = engine.pred(kv, kv.create(), engine.tokenize(prompt)).token  # what greedy decoding gives first
    kv.close_all()
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [*range(3, 12), first]}))
    engine = Engine.from_path(model, device="cpu", page_size=16, num_pages=256)
    assert len(engine.loaded.eos_token_ids) >= 10
    with Runtime(engine) as runtime:
        assert run(runtime, BUILDS[language]("hello"), [prompt, "20"]) == prompt + "\n"


STREAMERS = {  # each streams its argument's tokens one at a time through its SDK's streaming helper
    "c": lambda tmp: build_c(ROOT / "tests" / "c_guests" / "stream.c", tmp / "stream.wasm"),
    "rust": lambda tmp: rust_test_guest("stream"),
}


@pytest.mark.parametrize("text", ["café 日本, naïve — ok", " a b c d e 日本語", "日本語の日本語の日本語"])
@pytest.mark.parametrize("sdk", STREAMERS)
def test_streamed_text_holds_back_a_character_until_its_tokens_have_all_come(runtime, tmp_path, sdk, text):
    """A character spanning tokens decodes as U+FFFD until complete: the streams sent those
    replacement characters, and then the rest at the wrong offset ("café " + five U+FFFD); hello's
    window of recent tokens, moved while a character was held back, sent text twice or lost it."""
    engine = runtime.engine
    ids = engine.tokenize(text, add_special_tokens=False)
    assert any("\ufffd" in engine.detokenize(ids[:end]) for end in range(1, len(ids)))  # characters span tokens
    assert run(runtime, STREAMERS[sdk](tmp_path), [text]) == engine.detokenize(ids)  # as one decode gives it


@pytest.mark.parametrize("k", [5, 100])
def test_c_top_k_takes_any_k_the_host_serves(runtime, tmp_path, k):
    """The C SDK refused k > 64 (its buffer), though the host serves any k up to the vocabulary;
    a ticket submitted for such a k could never be waited for."""
    import struct

    from symphony_os.engine.sampling import TopK

    out, log = [], []
    program = runtime.load(build_c(ROOT / "tests" / "c_guests" / "topk.c", tmp_path / "topk.wasm"))
    process = runtime.spawn(program, ["Once upon a time", str(k)], on_output=out.append, on_log=log.append)
    assert runtime.wait(process, 120) == 0, (process.end_reason, "".join(log))
    engine = runtime.engine
    kv = engine.session()
    expected = engine.pred(kv, kv.create(), engine.tokenize("Once upon a time"), want=TopK(k)).top_ids
    kv.close_all()
    assert [list(struct.unpack(f"<{k}i", chunk)) for chunk in out] == [list(expected)] * 2


def test_c_stream_goes_on_well_after_byte_pieces(runtime, tmp_path):
    """Two cases of byte-fallback tokens (a run of them decodes whole only once valid): a prompt
    ending in a character of byte tokens, continued by more of them, was decoded from that
    character's last byte and garbled for good; a stray byte after a whole character sent from
    inside a U+FFFD, not from a character's start."""
    engine, stream = runtime.engine, STREAMERS["c"](tmp_path)
    prompt = engine.tokenize("Once upon a time there was 日", add_special_tokens=False)
    ids = engine.tokenize("Once upon a time there was 日中漢語文", add_special_tokens=False)
    assert ids[:len(prompt)] == prompt and engine.detokenize(prompt[-1:]) == "\ufffd"
    assert run(runtime, stream, ["--ids", ",".join(map(str, ids)), str(len(prompt))]) == engine.detokenize(ids)
    piece, stray = engine.tokenize("a 中", add_special_tokens=False), engine.tokenize("a ok", add_special_tokens=False)
    out = run(runtime, stream, ["--ids", ",".join(map(str, piece + [131] + stray))])  # 131: a lone continuation byte
    assert out.endswith(engine.detokenize(stray)[1:])  # valid UTF-8 (run() decodes it), and the text after
