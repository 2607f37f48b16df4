"""The Rust and AssemblyScript SDKs: their programs, built with the real toolchains, compute
the same tokens as the C ones."""
import pytest

from guests import as_lip, lip, rust_lip
from symphony_os.engine import Engine
from symphony_os.runtime import Runtime


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
