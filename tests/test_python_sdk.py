"""Python LIPs: components built with componentize-py from guest_sdk/python, run by the same
runtime as core modules. Builds are cached by content hash under build/python-lips (a fresh
build takes 5-20 s)."""
import hashlib
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import wasmtime
from click.testing import CliRunner
from guests import lip

from symphony_os.cli import main
from symphony_os.engine.loop import Engine
from symphony_os.errors import ErrorCode
from symphony_os.lip.component import INTERFACES
from symphony_os.lip.limits import ProcessLimits
from symphony_os.lip.process import EXIT_KILLED, EXIT_TRAPPED
from symphony_os.lip.runtime import Runtime
from symphony_os.wasm.component import describe_func
from symphony_os.wasm.fiber import make_async_engine
from symphony_os.wasm.program import ProgramError
from symphony_os.wasm.wit import component_signatures, read_wit

ROOT = Path(__file__).resolve().parent.parent
SDK = ROOT / "guest_sdk" / "python"
WIT = SDK / "wit" / "symphony.wit"
CACHE = ROOT / "build" / "python-lips"
COMPONENTIZE = Path(sys.executable).parent / "componentize-py"


def build_python(module: str, directory: Path) -> Path:
    """Build `directory/module.py` into a component, reusing a build of the same sources."""
    if not COMPONENTIZE.exists():
        pytest.skip("componentize-py is not installed (pip install -e '.[dev]')")
    sources = [directory / f"{module}.py", SDK / "symphony.py", WIT]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()[:16]
    out = CACHE / f"{module}-{digest}.wasm"
    if not out.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        subprocess.run([str(COMPONENTIZE), "-d", str(WIT.parent), "-w", "lip-python", "componentize", "-p", str(SDK),
                        "-p", str(directory), module, "-o", str(partial)], check=True, capture_output=True)
        partial.replace(out)
    return out


def python_lip(name: str) -> Path:
    return build_python(name, ROOT / "lips" / "python")


def misbehave() -> Path:
    return build_python("misbehave", ROOT / "tests" / "python_guests")


@pytest.fixture
def engine(stories_path):
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=2048)
    yield engine
    assert engine.pool.stats().used == 0, engine.pool.stats()


def run(runtime, path, args, timeout_s=120, expect=0):
    out, log = [], []
    process = runtime.spawn(runtime.load(path), args, on_output=out.append, on_log=log.append)
    code = runtime.wait(process, timeout_s)
    assert code == expect, (process.end_reason, "".join(log))
    return b"".join(out).decode(), "".join(log)


# ---- one source of truth ----

def test_component_world_has_the_calls_and_errors_of_the_core_wit():
    core, core_errors = read_wit()
    component, component_errors = read_wit(WIT)
    assert component_errors == core_errors
    assert [c.replace("-", "_").upper() for c in component_errors] == [e.name for e in ErrorCode]
    by_interface = lambda functions: {(f.interface, f.name) for f in functions}
    methods = {(f.interface, f.name) for f in component if f.name in ("argmax", "top-k", "logprob", "sample")}
    assert by_interface(component) - methods == by_interface(core)
    # The host serves every call of the world, and nothing else.
    served = {(interface, name) for interface, calls in INTERFACES.items() for name in calls
              if not name.startswith("[method]")}
    assert served == by_interface(core)
    assert {name.split(".")[1] for name in INTERFACES["inference"] if name.startswith("[method]")} == \
        {name for _, name in methods}
    assert re.search(r"resource distribution", WIT.read_text())


def test_the_types_a_component_may_declare_are_the_wits_and_sdk_components_declare_them():
    """check_component compares what a component declares with component_signatures (read
    from the WIT): one signature per call the host serves, and a component componentize-py
    built from the WIT (it imports every call) declares exactly those."""
    signatures = component_signatures(WIT)
    assert set(signatures) == {f"{interface}.{name}" for interface, calls in INTERFACES.items() for name in calls}
    assert signatures["inference.[method]distribution.top-k"] == \
        f"(borrow<distribution>, s32) -> result<list<tuple<s32, f32>>, enum{{{', '.join(read_wit(WIT)[1])}}}>"
    assert signatures["inference.pred-wait"].startswith(
        "(s32) -> result<variant{distribution(own<distribution>), top-k(list<tuple<s32, f32>>), token(s32), "
        "tokens(list<s32>), sampled(record{token: s32, logprob: f32, top: list<tuple<s32, f32>>}), "
        "scores(list<record{logprob: f32, top: list<tuple<s32, f32>>}>)}, "
        "enum{invalid-argument, ")
    engine = make_async_engine()
    component = wasmtime.component.Component(engine, python_lip("hello").read_bytes())
    declared = {}
    for name, item in component.type.imports(engine).items():
        if name.startswith("symphony:component/"):
            interface = name.split("/")[1].split("@")[0]
            exports = {n: e.ty for n, e in item.ty.exports(engine).items()}
            resources = [(ty, n) for n, ty in exports.items() if isinstance(ty, wasmtime.component.ResourceType)]
            declared.update({f"{interface}.{n}": describe_func(ty, resources) for n, ty in exports.items()
                             if isinstance(ty, wasmtime.component.FuncType)})
    assert declared == signatures


# ---- the gallery in Python ----

def test_hello_py_gives_the_same_tokens_as_hello_c(engine):
    with Runtime(engine) as runtime:
        python, _ = run(runtime, python_lip("hello"), ["Once upon a time", "40"])
        c, _ = run(runtime, lip("hello"), ["Once upon a time", "40"])
    assert python == c
    assert python.startswith("Once upon a time") and len(python) > 60


def test_beam_py_matches_beam_c_and_its_beams_share_batches(engine):
    with Runtime(engine) as runtime:
        python, _ = run(runtime, python_lip("beam"), ["Once upon a time", "3", "10"])
        stats = engine.stats()
        c, _ = run(runtime, lip("beam"), ["Once upon a time", "3", "10"])
    assert python == c and "\nscore -" in python
    # 3 beams' top-k preds in flight together: 1 prefill + 1 + 9 rounds of 3.
    assert stats.sequences == 1 + 1 + 9 * 3 and stats.batches == 1 + 10


def test_python_and_c_lips_share_batches(engine):
    # Batches run only inside wait() (drive_in_caller), and every program is loaded before any
    # process starts, so the four start together and the first batch waits for all of them.
    with Runtime(engine, drive_in_caller=True) as runtime:
        alone, _ = run(runtime, python_lip("hello"), ["One day", "24"])
        programs = [runtime.load(path) for path in (python_lip("hello"), lip("hello"))] * 2
        before = engine.stats()
        outputs = {}
        processes = []
        for program in programs:
            out = []
            processes.append((runtime.spawn(program, ["One day", "24"], on_output=out.append), out))
        for process, out in processes:
            assert runtime.wait(process, 120) == 0, process.end_reason
            outputs[process.pid] = b"".join(out).decode()
        after = engine.stats()
    assert set(outputs.values()) == {alone}
    batches, sequences = after.batches - before.batches, after.sequences - before.sequences
    assert sequences / batches > 1.5


# ---- misbehaving guests ----

def test_misbehaving_python_guest_gets_error_codes_and_the_host_survives(engine):
    with Runtime(engine) as runtime:
        out, _ = run(runtime, misbehave(), ["errors"])
        checks = dict(line.split("=") for line in out.splitlines())
        assert checks == {
            "unknown-handle": "BadHandle", "closed-handle": "BadHandle", "closed-handle-pred": "BadHandle",
            "close-twice": "BadHandle", "unknown-ticket": "BadHandle", "bad-token-id": "InvalidArgument",
            "no-such-file": "FileNotFound", "top-k-zero": "InvalidArgument", "negative-truncate": "InvalidArgument",
            "fork-unknown": "BadHandle", "no-such-tool": "Unsupported", "empty-pred": "InvalidArgument",
            "sampler-inf-temperature": "InvalidArgument", "sampler-bias-at-float32-limit": "ok",
            "after": "True", "sample-inf-temperature": "InvalidArgument", "sample-nan-top-p": "InvalidArgument",
            "sample-vanishing": "True",
        }
        hello, _ = run(runtime, python_lip("hello"), ["Once upon a time", "8"])
        assert hello.startswith("Once upon a time")


def test_python_guest_killed_while_waiting_on_pred_ends_and_frees_its_kv(engine):
    with Runtime(engine) as runtime:
        first_output = threading.Event()
        process = runtime.spawn(runtime.load(python_lip("hello")), ["Once upon a time", "100000"],
                                on_output=lambda data: first_output.set())
        assert first_output.wait(60)
        runtime.kill(process.pid, "test")
        assert runtime.wait(process, 30) == EXIT_KILLED
        hello, _ = run(runtime, python_lip("hello"), ["Once upon a time", "4"])
        assert hello.startswith("Once upon a time")
    assert not process.abi.distributions


def test_python_guest_runs_into_the_same_limits_as_a_core_module(engine):
    """KV pages, distribution memory (dropping one frees it), argument sizes and the host-call
    rate apply to components through the same code as to core modules."""
    one_distribution = 4 * engine.loaded.config.vocab_size
    limits = ProcessLimits(kv_pages=4, distribution_bytes=10 * one_distribution, hostcalls_per_s=300)
    with Runtime(engine) as runtime:
        out = []
        process = runtime.spawn(runtime.load(misbehave()), ["limits"], on_output=out.append, limits=limits)
        assert runtime.wait(process, 120) == 0, process.end_reason
    checks = dict(line.split("=") for line in b"".join(out).decode().splitlines())
    assert checks == {
        "pages": "LimitExceeded", "held": "10 LimitExceeded", "pred-drop-loop": "ok",
        "detokenize-2M": "InvalidArgument", "tokenize-2MB": "InvalidArgument", "rate-limited": "True",
    }
    assert not process.abi.distributions


def test_text_stream_holds_back_a_character_until_its_tokens_have_all_come(engine):
    """A character spanning tokens decodes as U+FFFD until complete: TextStream sent those
    replacement characters, and then the rest at the wrong offset."""
    text = "café 日本, naïve — ok"
    with Runtime(engine) as runtime:
        out, _ = run(runtime, misbehave(), ["stream", text])
        assert out == text
        # 日 as bytes, a stray lead byte, then words: the stray byte changes the text before it,
        # and the stream went silent for good; now it goes on (and finish sends what is left).
        ids = "410,233,154,168,233,407,261,378,383,286,261,280,294"
        out, _ = run(runtime, misbehave(), ["stream-ids", ids])
    assert out.endswith(engine.detokenize([407, 261, 378, 383, 286, 261, 280, 294]).strip())


@pytest.mark.parametrize("args, code, logged", [([], 0, ""), (["7"], 7, ""), (["fatal: bad input"], 1, "fatal: bad input")])
def test_sys_exit_in_a_python_guest_ends_as_in_python(engine, args, code, logged):
    """sys.exit() ended with 1, and sys.exit("message") lost its message."""
    with Runtime(engine) as runtime:
        _, log = run(runtime, misbehave(), ["exit", *args], expect=code)
    assert logged in log


def test_python_guest_exception_exits_1_with_traceback_and_prints_in_its_log(engine):
    with Runtime(engine) as runtime:
        _, log = run(runtime, misbehave(), ["crash"], expect=1)
    assert "about to fail" in log and "RuntimeError: boom" in log


def test_a_python_guest_that_sleeps_is_trapped_and_the_host_carries_on(engine):
    """time.sleep waits on a WASI timer, which wasmtime serves with tokio's: polled from our
    fibers (no tokio runtime) it panicked in Rust and aborted the whole host. Now the timer is
    refused: that process traps with the reason, and the next one runs."""
    with Runtime(engine) as runtime:
        out = []
        process = runtime.spawn(runtime.load(misbehave()), ["sleep"], on_output=out.append)
        assert runtime.wait(process, 60) == EXIT_TRAPPED
        assert b"".join(out) == b"sleeping\n" and "a LIP cannot sleep or wait on a timer" in process.end_reason
        hello, _ = run(runtime, python_lip("hello"), ["Once upon a time", "8"])
        assert hello.startswith("Once upon a time")


def test_a_python_guests_stack_overflow_is_the_stack_limit(engine):
    """A component reports its trap as an error with no trap code: a Python guest that ran out
    of wasm stack ended as "trapped" (134), not killed by the stack limit (137) as a core
    module does and SECURITY.md says."""
    with Runtime(engine) as runtime:
        process = runtime.spawn(runtime.load(misbehave()), ["recurse"])
        assert runtime.wait(process, 120) == EXIT_KILLED
    assert process.end_reason == "killed: wasm stack limit 1 MiB exceeded"


def test_a_python_guest_tokenizes_a_long_text_off_the_worker(engine, monkeypatch):
    """Its tokenize waits as a core module's does (tests/test_hostcall_abuse.py), the same ids."""
    asked = []
    tokenize_later = engine.tokenize_later
    monkeypatch.setattr(engine, "tokenize_later", lambda text, add: asked.append(len(text)) or tokenize_later(text, add))
    with Runtime(engine) as runtime:
        short, _ = run(runtime, misbehave(), ["tokenize", "10"])
        long, _ = run(runtime, misbehave(), ["tokenize", "20000"])
    assert short == f"ids={len(engine.tokenize('a b ' * 10, add_special_tokens=False))}\n"
    assert long == f"ids={len(engine.tokenize('a b ' * 20000, add_special_tokens=False))}\n" and asked == [80_000]


EXIT_AFTER_A_LOGGING_GUEST = """
import sys, time
from symphony_os.engine.loop import Engine
from symphony_os.lip.runtime import Runtime
engine = Engine.from_path(sys.argv[1], device="cpu", page_size=16, num_pages=256)
with Runtime(engine, drive_in_caller=True) as runtime:
    process = runtime.spawn(runtime.load(sys.argv[2]), ["crash"], on_log=lambda text: None)
    print("exit", runtime.wait(process, 60), flush=True)
time.sleep(0.3)  # the guest's output streams are all written; its process is still referenced
"""


def test_the_host_exits_cleanly_after_a_python_guest_wrote_to_its_log(stories_path):
    """wasmtime writes a component's stdout/stderr on its tokio threads, and dropped the writer
    there too, calling the finalizer that wasmtime-py registers, in Python. A process still
    referenced at interpreter exit was dropped during finalization, when Python 3.11 ends a
    foreign thread taking the GIL with pthread_exit: Rust aborted the host (exit 134, every
    time here; `symphony run` of a Python LIP that printed a traceback, 2 runs in 3)."""
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", EXIT_AFTER_A_LOGGING_GUEST, str(stories_path), str(misbehave())],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout == "exit 1\n"  # the guest's uncaught exception


@pytest.mark.parametrize("wat, message", [
    ('(component (import "evil:disk/format" (instance)))', "unknown import evil:disk/format"),
    ('(component (import "wasi:http/outgoing-handler@0.2.0" (instance)))', "unknown import wasi:http"),
    ('(component (import "symphony:component/raw-memory@0.1.0" (instance)))', "no such interface"),
    # Our host functions take whatever type a component declares for them: a type other than
    # the WIT's is refused at load (a send without its result, written anyway, crashed the host).
    ('(component (import "symphony:component/io@0.1.0" (instance (export "send" (func (param "text" string))))))',
     r"import io.send is declared as \(string\); the host provides \(string\) -> result<_, enum\{invalid-argument"),
    ('(component (import "symphony:component/io@0.1.0" (instance (export "send" (func (param "text" u32))))))',
     r"import io.send is declared as \(u32\); the host provides \(string\)"),
    ('(component (import "symphony:component/kv@0.1.0" (instance (export "kv-format" (func)))))',
     "unknown import kv.kv-format: no such function in symphony:component/kv"),
    ('(component (import "symphony:component/io@0.1.0" (func)))', "import symphony:component/io@0.1.0 must be an instance"),
    ('(component (import "symphony:component/io@0.1.0" (instance (export "send" (instance)))))',
     "import io.send is a ComponentInstanceType"),
    ("(component)", "exports no `run"),
    ('(component (core module $m (func (export "f"))) (core instance $i (instantiate $m)) '
     '(func (export "run") (canon lift (core func $i "f"))))', "exports no `run: func"),
])
def test_bad_components_are_refused_with_one_line(engine, wat, message):
    with Runtime(engine) as runtime:
        with pytest.raises(ProgramError, match=message) as info:
            runtime.load(bytes(wasmtime.wat2wasm(wat)))
    assert "\n" not in str(info.value)


def test_symphony_run_takes_a_python_lip(stories_path):
    result = CliRunner().invoke(main, ["run", "--model", str(stories_path), "--device", "cpu",
                                       str(python_lip("hello")), "--", "Once upon a time", "6"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Once upon a time")


def test_an_ended_python_process_is_freed(engine):
    """wasmtime-py keeps WASI output callbacks in a global table until their store is freed: a
    callback holding its process would keep the process and its store alive forever."""
    import gc
    import weakref

    with Runtime(engine) as runtime:
        program = runtime.load(python_lip("hello"))
        process = runtime.spawn(program, ["One day", "2"])
        assert runtime.wait(process, 120) == 0, process.end_reason
        ended, store = weakref.ref(process), weakref.ref(process.store)
        del process
    gc.collect()  # the runtime is closed: its workers hold nothing either
    assert ended() is None and store() is None
