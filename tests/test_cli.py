"""The `symphony` command line."""
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from symphony_os.cli import main


def test_generate_prints_what_transformers_greedy_generate_prints(stories_path):
    prompt = "Once upon a time"
    result = CliRunner().invoke(main, ["generate", "--model", str(stories_path), "--prompt", prompt,
                                       "--max-tokens", "40"])
    assert result.exit_code == 0, result.output
    tokenizer = AutoTokenizer.from_pretrained(stories_path)
    model = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=40, do_sample=False)
    expected = tokenizer.decode(out[0], skip_special_tokens=True)
    assert result.output == expected + "\n"


def test_generate_with_seed_is_reproducible(tiny_llama):
    args = ["generate", "--model", str(tiny_llama), "--prompt", "w5 w6", "--max-tokens", "12",
            "--temperature", "1.0", "--seed", "7"]
    first, second = CliRunner().invoke(main, args), CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert first.output == second.output and len(first.output.split()) > 2


@pytest.mark.parametrize("option, value, message", [("--temperature", "inf", "temperature must be finite"),
                                                   ("--temperature", "nan", "temperature must be finite"),
                                                   ("--top-p", "0", "top_p must be in"),
                                                   ("--top-k", "-1", "top_k must be >= 0"),
                                                   ("--seed", str(2**64 - 1), "a seed is a 64-bit integer"),
                                                   ("--max-tokens", "-5", "-5 is not in the range x>=0"),
                                                   ("--page-size", "0", "0 is not in the range x>=1"),
                                                   ("--kv-pages", "0", "0 is not in the range x>=1")])
def test_generate_refuses_bad_options_in_one_line_before_loading(option, value, message):
    """Checked before the model loads (this model path does not even exist)."""
    result = CliRunner().invoke(main, ["generate", "--model", "/nonexistent", "--prompt", "x", option, value])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("device, message", [
    ("tpu", "unknown device 'tpu'"), ("cuda:x", "unknown device 'cuda:x'"),
    pytest.param("cuda", "torch sees no CUDA GPU here", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA GPU is here: --device cuda is valid")),
    # Past the GPUs there are: refused whether torch sees none or a few.
    ("cuda:99", "device 'cuda:99': torch sees ")])
def test_a_device_torch_cannot_use_is_refused_in_one_line(tiny_llama, device, message):
    result = CliRunner().invoke(main, ["info", "--model", str(tiny_llama), "--device", device])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output, result.output


def test_info_describes_model_and_pool(tiny_llama):
    result = CliRunner().invoke(main, ["info", "--model", str(tiny_llama), "--device", "cpu", "--kv-pages", "100",
                                       "--page-size", "8"])
    assert result.exit_code == 0, result.output
    rows = {line[:28].strip(): line[28:].strip() for line in result.output.splitlines()}
    assert rows["attention backend"] == "torch"
    assert rows["kv pool"].startswith("100 pages x 8 tokens = 800 tokens")
    assert rows["heads / kv heads / head dim"] == "4 / 2 / 16"
    assert rows["device"] == "cpu" and rows["dtype"] == "float32"


def test_bad_model_directory_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(main, ["info", "--model", str(tmp_path)])
    assert result.exit_code != 0
    assert "no config.json" in result.output and "Traceback" not in result.output


def test_env_option_must_be_name_equals_value(tmp_path):
    program = tmp_path / "p.wasm"
    program.write_bytes(b"\0asm\1\0\0\0")
    for command in (["run", str(program)], ["launch", str(program), "--server", "http://127.0.0.1:9"]):
        for pair in ("NOEQUALS", "=value"):
            result = CliRunner().invoke(main, [*command, "--env", pair])
            assert result.exit_code == 2 and f"{pair!r} is not NAME=VALUE" in result.output, result.output


@pytest.mark.parametrize("command", [["launch", "README.md"], ["upload", "README.md"], ["ps"], ["kill", "3"]])
def test_client_commands_without_a_server_fail_in_one_line(command, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    result = CliRunner().invoke(main, [*command, "--server", "http://127.0.0.1:9"])  # nothing listens on port 9
    assert result.exit_code == 1 and "cannot reach the server" in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("option, value", [("--port", "99999"), ("--workers", "0"), ("--log-level", "bogus"),
                                           ("--grace", "-1"), ("--grace", "nan")])
def test_serve_refuses_bad_options_before_loading(option, value):
    result = CliRunner().invoke(main, ["serve", "--model", "/nonexistent", option, value])
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output, result.output


def test_generate_with_the_pool_full_says_so_in_one_line(tiny_llama):
    result = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama), "--prompt", "w5 w6", "--kv-pages", "1",
                                       "--page-size", "1", "--max-tokens", "8"])
    assert result.exit_code == 1 and "KV pool exhausted" in result.output, result.output
    assert "Traceback" not in result.output
