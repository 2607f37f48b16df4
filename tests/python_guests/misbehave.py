"""A Python guest that misuses the system calls on purpose, for tests/test_python_sdk.py.
Usage: misbehave MODE
  errors  - bad handles, a closed KV file, unknown tickets and names, bad arguments: sends one
            line `check=error-name` per misuse, then exits 0
  crash   - prints to its log, then raises: exit code 1, the traceback in the log
  calls N - times N cheap host calls of each kind; sends `call=microseconds` lines
  limits  - runs into the per-process limits (run it with small ones): sends `check=outcome` lines
  sleep   - sends `sleeping`, then calls time.sleep (a LIP cannot wait on a timer: it traps)
  stream TEXT - sends TEXT's tokens through TextStream, one token at a time (stream-ids: ids a,b,c)
  exit [CODE|MESSAGE] - sys.exit() with nothing, a code or a message
  tokenize N - sends how many ids N repeats of "a b " tokenize to (a long text waits off the worker)
  recurse - recurses without end in C (repr of a deeply nested list): the wasm stack overflows
  chat [tools=JSON] ROLE CONTENT ... - sends the pairs rendered with the model's chat template,
            with the tools (its error's name if it refuses)"""
import json
import sys
import time

import symphony
from symphony import Kv, Sampler, TopK
from wit_world.imports import inference
from wit_world.imports import kv as raw_kv


def outcome(call) -> str:
    try:
        call()
        return "ok"
    except symphony.SymphonyError as error:
        return type(error).__name__


def errors() -> None:
    closed = Kv.create()
    handle = closed.handle
    closed.close()
    live = Kv.create()
    checks = {
        "unknown-handle": lambda: symphony._check(raw_kv.kv_len, 4242),
        "closed-handle": lambda: symphony._check(raw_kv.kv_len, handle),
        "closed-handle-pred": lambda: Kv(handle).pred([1]),
        "close-twice": lambda: symphony._check(raw_kv.kv_close, handle),
        "unknown-ticket": lambda: symphony._check(inference.pred_wait, 777),
        "bad-token-id": lambda: symphony.detokenize([-1]),
        "no-such-file": lambda: Kv.open("no/such/file"),
        "top-k-zero": lambda: live.submit([1], TopK(0)),
        "negative-truncate": lambda: live.truncate(-1),
        "fork-unknown": lambda: Kv(999).fork(),
        "no-such-tool": lambda: symphony.tool("format-disk", "now"),
        "empty-pred": lambda: live.pred([]),
        "sampler-inf-temperature": lambda: live.fork().next_token([1], Sampler(temperature=float("inf"))),
        "sampler-bias-at-float32-limit": lambda: live.fork().next_token([1], Sampler(bias={3: 3.4e38})),
    }
    for name, call in checks.items():
        symphony.send(f"{name}={outcome(call)}\n")
    # The host is still fine with this process: a correct pred after all of that.
    with live.pred([1]) as distribution:
        symphony.send(f"after={distribution.argmax() >= 0}\n")
        for name, temperature, top_p in (("inf-temperature", float("inf"), 1.0), ("nan-top-p", 1.0, float("nan"))):
            symphony.send(f"sample-{name}={outcome(lambda: distribution.sample(temperature, top_p, 0))}\n")
        # A vanishing temperature overflows nothing: the most likely token.
        symphony.send(f"sample-vanishing={distribution.sample(1e-45, 1.0, 0) == distribution.argmax()}\n")
    live.close()


def limits() -> None:
    """Each check names the first error (or `ok`); the test sets small limits."""
    with Kv.create() as kv:
        symphony.send(f"pages={outcome(lambda: kv.next_token(list(range(1, 201))))}\n")
    with Kv.create() as kv:
        kv.next_token([1])
        held = []
        try:
            for _ in range(100):
                held.append(kv.pred([1]))
                kv.truncate(1)
            symphony.send("held=100\n")
        except symphony.SymphonyError as error:
            symphony.send(f"held={len(held)} {type(error).__name__}\n")
        for distribution in held:
            distribution.__exit__(None, None, None)  # drop: frees the host's copy
        # Dropped distributions no longer count: a long loop of pred-then-drop runs.
        for _ in range(50):
            with kv.pred([1]) as distribution:
                distribution.argmax()
            kv.truncate(1)
        symphony.send("pred-drop-loop=ok\n")
    symphony.send(f"detokenize-2M={outcome(lambda: symphony.detokenize([7] * 2_000_000))}\n")
    symphony.send(f"tokenize-2MB={outcome(lambda: symphony.tokenize('a' * 2_000_000))}\n")
    limited = 0
    for _ in range(500):
        if outcome(lambda: symphony._check(raw_kv.kv_len, 4242)) == "LimitExceeded":
            limited += 1
    while outcome(lambda: symphony._check(raw_kv.kv_len, 4242)) == "LimitExceeded":
        pass  # the next one-second window lets calls through again
    symphony.send(f"rate-limited={limited > 0}\n")


def calls(n: int) -> None:
    handle = Kv.create()
    timed = {
        "vocab-size": lambda: symphony.vocab_size(),
        "kv-len": lambda: len(handle),
        "kv-len-error": lambda: outcome(lambda: symphony._check(raw_kv.kv_len, 4242)),
        "tokenize-8": lambda: symphony.tokenize("one two three four five six seven eight"),
    }
    for name, call in timed.items():
        started = time.perf_counter()
        for _ in range(n):
            call()
        symphony.send(f"{name}={(time.perf_counter() - started) / n * 1e6:.1f}\n")
    handle.close()


def main(args: list[str]) -> int:
    mode = args[0] if args else "errors"
    if mode == "errors":
        errors()
    elif mode == "crash":
        print("about to fail")
        raise RuntimeError("boom")
    elif mode == "limits":
        limits()
    elif mode == "calls":
        calls(int(args[1]))
    elif mode in ("stream", "stream-ids"):  # args[1]'s tokens (or ids) through TextStream, one at a time
        stream = symphony.TextStream()
        ids = symphony.tokenize(args[1]) if mode == "stream" else [int(i) for i in args[1].split(",")]
        for token in ids:
            symphony.send(stream.push(token))
        symphony.send(stream.finish())
    elif mode == "exit":  # sys.exit(args[1]): nothing, an int or a message
        sys.exit(None if len(args) < 2 else int(args[1]) if args[1].isdigit() else args[1])
    elif mode == "tokenize":
        symphony.send(f"ids={len(symphony.tokenize('a b ' * int(args[1])))}\n")
    elif mode == "recurse":
        sys.setrecursionlimit(10**8)
        nested = []
        for _ in range(10**6):
            nested = [nested]
        symphony.send(f"{len(repr(nested))}\n")
    elif mode == "chat":
        tools = None
        if args[1:2] and args[1].startswith("tools="):  # OpenAI-style function definitions, JSON
            tools, args = json.loads(args[1][len("tools="):]), args[:1] + args[2:]
        pairs = list(zip(args[1::2], args[2::2]))
        try:
            symphony.send(symphony.chat_template(pairs, tools=tools))
        except symphony.SymphonyError as error:
            symphony.send(type(error).__name__)
    elif mode == "sleep":
        symphony.send("sleeping\n")
        time.sleep(0.01)
        symphony.send("woke\n")
    return 0


WitWorld = symphony.program(main)
