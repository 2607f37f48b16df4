"""The paper's comparisons, programs against prompts, on one `symphony serve` instance.

Every workload is done two ways on the same server (same engine, same KV pool, so the same KV
memory budget), over real HTTP on 127.0.0.1:

- programs: LIPs from bench/lips/ (their own KV files and policies, forks, parallel decoding,
  tools inside the server), launched with POST /processes and streamed over the WebSocket;
- prompts: /v1/completions (the built-in `complete` LIP with automatic prefix caching, LRU),
  driven by a client that does the application logic, as applications drive vLLM today.

Workloads (sizes in SIZES; all greedy, token ids in and out so both paths do the same work):
1. rag: documents with Pareto-distributed popularity (one shape per run); the program keeps a
   named KV file per document with an LFU priority; the prompt path relies on the prefix cache.
   rag_mixed: the same while another application's one-off long prompts share the server.
2. completion: plain prompts, the overhead of the program path (and transformers' generate).
3. fork: one shared prefix, N continuations: one program with forks against N prompts.
4. react: an agent with calculator calls: the `tool` host call against a client loop.
5. got: Graph-of-Thought (4 thoughts, pairwise aggregation) and swarm: agents handing a
   conversation to each other.

    .venv/bin/python bench/paper.py [--quick] [--only rag,react]

Prints one table, writes bench/results/paper.json and PNG plots next to it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from symphony_os.client.client import AsyncClient  # noqa: E402
from symphony_os.lip.tools import calculator  # noqa: E402
from symphony_os.wasm.native_build import ZIG_CC  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LIPS = ROOT / "bench" / "lips"
LIP_NAMES = ("rag", "complete_ids", "fork", "react_ids", "got", "swarm")
BOS = 1

# The claims of the Symphony paper each workload is set against (MISSION.md).
PAPER = {"rag": "up to 7x", "completion": "0.89-0.96x (-4% to -11%)", "fork": "-", "react": "1.24x",
         "got": "1.15-1.43x", "swarm": "1.55x"}

SIZES = {
    "full": dict(
        kv_pages=224, page_size=16, repeats=6,
        rag=dict(shapes=[0.5, 1.0, 1.5, 2.0, 2.5], docs=200, doc_len=384, question=16, tokens=8, queries=96,
                 concurrency=4, repeats=4),
        rag_mixed=dict(shapes=[1.0, 2.0], docs=200, doc_len=384, question=16, tokens=8, queries=96, concurrency=4,
                       repeats=4, other_traffic=640),
        completion=dict(prompt=64, tokens=32, requests=32, concurrency=8),
        fork=dict(prefix=256, branches=8, suffix=4, tokens=16, rounds=4),
        react=dict(agents=16, concurrency=4, question=32, turns=3, thought=12, action=6, answer=12),
        got=dict(problems=8, concurrency=2, prompt=192, branches=4, tokens=12, conclude=4),
        swarm=dict(agents=4, instructions=192, conversations=16, concurrency=4, turns=4, tokens=12, user=32),
    ),
    "quick": dict(
        kv_pages=224, page_size=16, repeats=4,
        rag=dict(shapes=[0.5, 1.0, 2.0], docs=200, doc_len=384, question=16, tokens=8, queries=48, concurrency=4,
                 repeats=2),
        rag_mixed=dict(shapes=[1.0], docs=200, doc_len=384, question=16, tokens=8, queries=48, concurrency=4,
                       repeats=2, other_traffic=640),
        completion=dict(prompt=64, tokens=32, requests=12, concurrency=4),
        fork=dict(prefix=256, branches=8, suffix=4, tokens=16, rounds=2),
        react=dict(agents=8, concurrency=4, question=32, turns=3, thought=12, action=6, answer=12),
        got=dict(problems=4, concurrency=2, prompt=192, branches=4, tokens=12, conclude=4),
        swarm=dict(agents=4, instructions=192, conversations=8, concurrency=4, turns=4, tokens=12, user=32),
    ),
    # For tests/test_bench_paper.py: seconds on a tiny model.
    "tiny": dict(
        kv_pages=48, page_size=16, repeats=2,
        rag=dict(shapes=[1.0], docs=12, doc_len=40, question=4, tokens=4, queries=10, concurrency=2),
        rag_mixed=dict(shapes=[1.0], docs=12, doc_len=40, question=4, tokens=4, queries=10, concurrency=2,
                       other_traffic=100),
        completion=dict(prompt=8, tokens=6, requests=3, concurrency=2),
        fork=dict(prefix=20, branches=3, suffix=2, tokens=5, rounds=1),
        react=dict(agents=2, concurrency=2, question=6, turns=2, thought=4, action=3, answer=4),
        got=dict(problems=1, concurrency=1, prompt=12, branches=4, tokens=3, conclude=2),
        swarm=dict(agents=3, instructions=20, conversations=2, concurrency=2, turns=3, tokens=4, user=6),
    ),
}


def ids_text(ids) -> str:
    return " ".join(str(int(i)) for i in ids)


@dataclass
class Phase:
    """One path through one workload: per-unit latencies, outputs, and the server's counters."""

    units: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    outputs: list = field(default_factory=list)
    http_requests: int = 0
    engine_tokens: int = 0
    forward_passes: int = 0
    generated_tokens: int = 0
    cached_prompt_tokens: int = 0
    evicted_files: int = 0  # named KV files KVFS evicted (documents, prefix-cache pages)
    background_requests: int = 0  # other traffic's requests finished meanwhile (rag_mixed)
    background_tokens: int = 0  # and the tokens they computed, left out of engine_tokens
    program_events: dict[str, int] = field(default_factory=dict)  # "rag: hit" lines of the logs, counted

    def summary(self) -> dict:
        lat = sorted(self.latencies_s)
        pick = lambda q: round(1000 * lat[min(len(lat) - 1, int(q * (len(lat) - 1) + 0.5))], 1) if lat else None
        return {"units": self.units, "wall_s": round(self.wall_s, 3),
                "units_per_s": round(self.units / self.wall_s, 4) if self.wall_s else None,
                "generated_tokens_per_s": round(self.generated_tokens / self.wall_s, 2) if self.wall_s else None,
                "latency_ms": {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)},
                "http_requests": self.http_requests, "http_requests_per_unit": round(self.http_requests / max(self.units, 1), 2),
                "engine_tokens": self.engine_tokens, "forward_passes": self.forward_passes,
                "generated_tokens": self.generated_tokens, "cached_prompt_tokens": self.cached_prompt_tokens,
                "evicted_files": self.evicted_files,
                **({"background_requests": self.background_requests} if self.background_requests else {}),
                **({"program_events": self.program_events} if self.program_events else {})}


class Driver:
    """Both front doors of one server, with the client-side tokenizer a prompt-API app uses."""

    def __init__(self, url: str, model_dir: Path):
        from transformers import AutoTokenizer

        self.url = url
        self.client = AsyncClient(url, token="")
        self.http = httpx.AsyncClient(base_url=url, timeout=600)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.programs: dict[str, str] = {}
        self.model = ""
        self.phase = Phase()

    async def start(self) -> None:
        self.model = (await self.http.get("/v1/models")).json()["data"][0]["id"]
        for name in LIP_NAMES:
            self.programs[name] = (await self.client.upload(LIPS / f"{name}.wasm"))["sha256"]

    async def close(self) -> None:
        await self.client.aclose()
        await self.http.aclose()

    async def program(self, name: str, args: list[str]) -> list[list[int]]:
        """Run a LIP to its end; its output lines as lists of ids."""
        self.phase.http_requests += 2  # POST /processes, then the WebSocket
        result = await self.client.run(self.programs[name], [str(a) for a in args])
        if result.exit_code != 0:
            raise RuntimeError(f"{name} failed ({result.reason}): {result.log[-500:]}")
        for line in result.log.splitlines():
            if line.startswith(f"{name}: "):
                event = line[len(name) + 2:]
                self.phase.program_events[event] = self.phase.program_events.get(event, 0) + 1
        lines = [[int(t) for t in line.split()] for line in result.output.decode().splitlines()]
        self.phase.generated_tokens += sum(map(len, lines))
        return lines

    async def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        """One /v1/completions request; the text back to ids with the client's tokenizer."""
        self.phase.http_requests += 1
        response = await self.http.post("/v1/completions", json={"model": self.model, "prompt": [int(i) for i in prompt],
                                                                  "max_tokens": max_tokens, "temperature": 0})
        response.raise_for_status()
        body = response.json()
        self.phase.cached_prompt_tokens += body["usage"]["prompt_tokens_details"]["cached_tokens"]
        self.phase.generated_tokens += body["usage"]["completion_tokens"]
        return self.tokenizer.encode(body["choices"][0]["text"], add_special_tokens=False)

    async def counters(self) -> dict[str, float]:
        text = (await self.http.get("/metrics")).text
        wanted = ("symphony_tokens_total", "symphony_batches_total", "symphony_kv_evicted_files_total")
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.split()[0] in wanted}

    async def measure(self, jobs: list, concurrency: int, background=None) -> Phase:
        """Run job coroutine factories, `concurrency` at a time, in order; each job's result is
        one output and its time one latency. `background(phase)`, a coroutine function, runs
        alongside until the jobs are done."""
        self.phase = phase = Phase(units=len(jobs))
        before = await self.counters()
        queue = list(enumerate(jobs))
        outputs: list = [None] * len(jobs)

        async def worker() -> None:
            while queue:
                index, job = queue.pop(0)
                started = time.perf_counter()
                outputs[index] = await job()
                phase.latencies_s.append(time.perf_counter() - started)

        started = time.perf_counter()
        other = asyncio.create_task(background(phase)) if background else None
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        phase.wall_s = time.perf_counter() - started
        if other:
            other.cancel()
            await asyncio.gather(other, return_exceptions=True)
        after = await self.counters()
        phase.outputs = outputs
        self.phase = Phase()  # what runs between measurements counts for no one
        phase.engine_tokens = int(after["symphony_tokens_total"] - before["symphony_tokens_total"]
                                  - phase.background_tokens)
        phase.forward_passes = int(after["symphony_batches_total"] - before["symphony_batches_total"])
        phase.evicted_files = int(after["symphony_kv_evicted_files_total"] - before["symphony_kv_evicted_files_total"])
        return phase

    async def other_traffic(self, phase: Phase, prompt_tokens: int, vocab: int) -> None:
        """Another application on the same server: one-off prompts of `prompt_tokens` random ids,
        one at a time, 1 new token each, until cancelled. Counted apart from the phase's work."""
        rng = np.random.default_rng([7, prompt_tokens])
        while True:
            prompt = [BOS] + random_ids(rng, vocab, prompt_tokens - 1)
            response = await self.http.post("/v1/completions", json={"model": self.model, "prompt": prompt,
                                                                      "max_tokens": 1, "temperature": 0})
            usage = response.json()["usage"]
            phase.background_requests += 1
            phase.background_tokens += usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]

    async def flush_pool(self, tokens: int) -> None:
        """Fill the KV pool with two throw-away prompts of tokens / 2 each, so KVFS evicts every
        closed named file (the prompt path's prefix cache included, which no API removes):
        the next run starts cold whichever path ran before it."""
        half = [BOS] + [3 + i % 1000 for i in range(tokens // 2 - 1)]
        await asyncio.gather(*(self.program("complete_ids", [1, ids_text(half)]) for _ in range(2)))

    async def remove_files(self, prefix: str) -> None:
        for stat in await self.client.kv_ls(prefix):
            await self.client.kv_rm(stat["path"])


def merged(phases: list[Phase]) -> Phase:
    """Repeated runs of one path as one: sums, latencies and outputs pooled."""
    out = Phase()
    for p in phases:
        out.outputs += p.outputs
        for name in ("units", "wall_s", "http_requests", "engine_tokens", "forward_passes", "generated_tokens",
                     "cached_prompt_tokens", "evicted_files", "background_requests", "background_tokens"):
            setattr(out, name, getattr(out, name) + getattr(p, name))
        out.latencies_s += p.latencies_s
        for event, count in p.program_events.items():
            out.program_events[event] = out.program_events.get(event, 0) + count
    return out


def compare(programs: list[Phase], prompts: list[Phase], **extra) -> dict:
    """Both paths' summaries and their throughput ratio programs / prompts: the median of the
    repeats' ratios (a shared 2-core machine is noisy: one slow moment skews a pooled ratio),
    each repeat's, and the pooled one (all units over all wall time)."""
    program, prompt = merged(programs), merged(prompts)
    same = sum(a == b for a, b in zip(program.outputs, prompt.outputs))
    p, q = program.summary(), prompt.summary()
    per_repeat = [round(q.wall_s / p.wall_s, 3) for p, q in zip(programs, prompts)]
    return {"programs": p, "prompts": q, "ratio": round(float(np.median(per_repeat)), 3),
            "ratio_per_repeat": per_repeat, "pooled_ratio": round(p["units_per_s"] / q["units_per_s"], 3),
            "identical_outputs": f"{same}/{len(program.outputs)}",
            "latencies_s": {"programs": program.latencies_s, "prompts": prompt.latencies_s}, **extra}


async def both(d: Driver, make, concurrency: int, repeats: int, before_each=None, background=None) -> dict:
    """Each path `repeats` times (even: each goes first equally often) on the jobs of make(r) ->
    (program jobs, prompt jobs), in the order A B B A A B ..., so that drift in the machine's
    load and what one run leaves in the KV pool fall on both alike. `before_each` (a coroutine
    function) runs before every run, outside the timing."""
    runs: dict[str, list[Phase]] = {"programs": [], "prompts": []}
    for r in range(repeats):
        jobs = dict(zip(("programs", "prompts"), make(r)))
        for name in (("programs", "prompts") if r % 2 == 0 else ("prompts", "programs")):
            if before_each:
                await before_each()
            runs[name].append(await d.measure(jobs[name], concurrency, background))
    return compare(runs["programs"], runs["prompts"])


def random_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(3, vocab, n).tolist()


# ---- 1. RAG with Pareto-distributed document popularity ----

def pareto_stream(rng: np.random.Generator, shape: float, docs: int, queries: int) -> list[int]:
    """Document ids floor(X) - 1 for X ~ Pareto(shape, minimum 1), draws past the last document
    redrawn: document k is asked for with probability ~ k^-shape - (k+1)^-shape. A small shape
    is a heavy tail (many documents asked for once), a large one a few hot documents."""
    out: list[int] = []
    while len(out) < queries:
        x = rng.pareto(shape, queries) + 1
        out += [int(v) - 1 for v in x if v < docs + 1]
    return out[:queries]


async def rag(d: Driver, size: dict, vocab: int, seed: int, repeats: int) -> dict:
    pool_tokens = size["pool_tokens"]
    rows = []
    for index, shape in enumerate(size["shapes"]):
        streams = []

        def make(r: int):
            # New documents for every shape and repeat: no path finds another run's KV cached.
            rng = np.random.default_rng([seed, index, r])
            docs = [[BOS] + random_ids(rng, vocab, size["doc_len"]) for _ in range(size["docs"])]
            stream = pareto_stream(rng, shape, size["docs"], size["queries"])
            questions = [random_ids(rng, vocab, size["question"]) for _ in stream]
            streams.append(stream)
            seen: dict[int, int] = {}

            def program_job(q: int):
                doc = stream[q]
                seen[doc] = seen.get(doc, 0) + 1  # the app's popularity count so far: an LFU priority
                args = [f"s{index}-r{r}-d{doc}", seen[doc], size["tokens"], ids_text(docs[doc]),
                        ids_text(questions[q])]
                return lambda: _first(d.program("rag", args))

            return ([program_job(q) for q in range(len(stream))],
                    [lambda q=q: d.complete(docs[stream[q]] + questions[q], size["tokens"]) for q in range(len(stream))])

        async def cold_pool():
            await d.remove_files("rag/")
            await d.flush_pool(pool_tokens)

        other = size.get("other_traffic")
        background = (lambda phase: d.other_traffic(phase, other, vocab)) if other else None
        result = await both(d, make, size["concurrency"], repeats, before_each=cold_pool, background=background)
        counts = np.sort(np.bincount(streams[0], minlength=size["docs"]))[::-1]
        rows.append({"shape": shape, "distinct_docs": int((counts > 0).sum()),
                     "top5_share": round(float(counts[:5].sum() / len(streams[0])), 3), **result})
    return {"shapes": rows}


async def rag_mixed(d: Driver, size: dict, vocab: int, seed: int, repeats: int) -> dict:
    """rag while another application shares the server: a stream of one-off long prompts
    (size["other_traffic"] tokens each) through /v1/completions, the same during both paths'
    runs. Their pages enter the prefix cache at priority 0 and push documents out of an LRU
    cache; the program's documents, at LFU priorities >= 1, are evicted after them."""
    return await rag(d, size, vocab, seed + 100, repeats)


async def _first(lines):
    return (await lines)[0]


# Below, make(r) builds repeat r's jobs for both paths from fresh random tokens, so no repeat
# finds the previous one's prefixes cached.

# ---- 2. plain completion ----

async def completion(d: Driver, size: dict, vocab: int, seed: int, repeats: int) -> dict:
    def make(r: int):
        rng = np.random.default_rng([seed, r])
        prompts = [[BOS] + random_ids(rng, vocab, size["prompt"]) for _ in range(size["requests"])]
        return ([lambda p=p: _first(d.program("complete_ids", [size["tokens"], ids_text(p)])) for p in prompts],
                [lambda p=p: d.complete(p, size["tokens"]) for p in prompts])

    return await both(d, make, size["concurrency"], repeats)


# ---- 3. shared-prefix parallel generation ----

async def fork(d: Driver, size: dict, vocab: int, seed: int, repeats: int) -> dict:
    async def prompts_round(prefix, suffixes):
        return await asyncio.gather(*(d.complete(prefix + s, size["tokens"]) for s in suffixes))

    def make(r: int):
        rng = np.random.default_rng([seed, r])
        rounds = [([BOS] + random_ids(rng, vocab, size["prefix"]),
                   [random_ids(rng, vocab, size["suffix"]) for _ in range(size["branches"])])
                  for _ in range(size["rounds"])]
        return ([lambda x=x: d.program("fork", [size["tokens"], ids_text(x[0])] + [ids_text(s) for s in x[1]])
                 for x in rounds],
                [lambda x=x: prompts_round(*x) for x in rounds])

    return await both(d, make, 1, repeats)


# ---- 4. ReAct with tool calls ----

async def react(d: Driver, size: dict, vocab: int, seed: int, repeats: int) -> dict:
    def program_job(question, steps):
        args = [size["thought"], size["answer"], ids_text(question)]
        for action, expression in steps:
            args += [ids_text(action), expression]
        return lambda: d.program("react_ids", args)

    async def client_loop(question, steps):
        transcript, segments = list(question), []
        for action, expression in steps:
            thought = await d.complete(transcript, size["thought"])
            observation = calculator(expression)  # the tool runs in the client, between requests
            transcript += thought + action + d.tokenizer.encode(observation, add_special_tokens=False)
            segments.append(thought)
        segments.append(await d.complete(transcript, size["answer"]))
        return segments

    def make(r: int):
        rng = np.random.default_rng([seed, r])
        agents = []
        for _ in range(size["agents"]):
            steps = [(random_ids(rng, vocab, size["action"]), f"{rng.integers(2, 99)}*{rng.integers(2, 99)}")
                     for _ in range(size["turns"])]
            agents.append(([BOS] + random_ids(rng, vocab, size["question"]), steps))
        return [program_job(*a) for a in agents], [lambda a=a: client_loop(*a) for a in agents]

    return await both(d, make, size["concurrency"], repeats)


# ---- 5a. Graph-of-Thought ----

async def got(d: Driver, size: dict, vocab: int, seed: int, repeats: int) -> dict:
    def program_job(prompt_ids, seeds, conclude):
        return lambda: d.program("got", [size["branches"], size["tokens"], ids_text(prompt_ids), ids_text(seeds),
                                         ids_text(conclude)])

    async def client_graph(prompt_ids, seeds, conclude):
        """The same graph as got.c: a level's requests go out together; each node's segment
        (its tokens after the prompt) is what the next level's prompts are built from."""
        segs = [[s] for s in seeds]
        outs = await asyncio.gather(*(d.complete(prompt_ids + seg, size["tokens"]) for seg in segs))
        lines = list(outs)
        segs = [seg + out for seg, out in zip(segs, outs)]
        while len(segs) > 1:
            pairs = [segs[i] + segs[i + 1] + conclude for i in range(0, len(segs), 2)]
            outs = await asyncio.gather(*(d.complete(prompt_ids + seg, size["tokens"]) for seg in pairs))
            lines += outs
            segs = [seg + out for seg, out in zip(pairs, outs)]
        return lines

    def make(r: int):
        rng = np.random.default_rng([seed, r])
        problems = [([BOS] + random_ids(rng, vocab, size["prompt"]), random_ids(rng, vocab, size["branches"]),
                     random_ids(rng, vocab, size["conclude"])) for _ in range(size["problems"])]
        return [program_job(*p) for p in problems], [lambda p=p: client_graph(*p) for p in problems]

    return await both(d, make, size["concurrency"], repeats)


# ---- 5b. SWARM-style agent handoffs ----

async def swarm(d: Driver, size: dict, vocab: int, seed: int, repeats: int) -> dict:
    rng = np.random.default_rng(seed)
    agents = [[BOS] + random_ids(rng, vocab, size["instructions"]) for _ in range(size["agents"])]

    async def client_conversation(user):
        history, agent, turns = list(user), 0, []
        for _ in range(size["turns"]):
            out = await d.complete(agents[agent] + history, size["tokens"])
            turns.append(out)
            history += out
            agent = sum(out) % len(agents)  # the handoff, decided in the client
        return turns

    def make(r: int):
        users = [random_ids(np.random.default_rng([seed, r, u]), vocab, size["user"])
                 for u in range(size["conversations"])]
        return ([lambda u=u: d.program("swarm", [size["turns"], size["tokens"], ids_text(u)]) for u in users],
                [lambda u=u: client_conversation(u) for u in users])

    # Setup, outside the timing on both sides: the program computes and pins each agent's
    # instructions; the prompt path warms its prefix cache with them.
    await d.program("swarm", ["setup"] + [ids_text(a) for a in agents])
    for a in agents:
        await d.complete(a, 1)
    result = await both(d, make, size["concurrency"], repeats)
    await d.remove_files("swarm/")
    return result


WORKLOADS = {"rag": rag, "rag_mixed": rag_mixed, "completion": completion, "fork": fork, "react": react, "got": got, "swarm": swarm}


async def run_workloads(url: str, model_dir: Path, size: dict, names: list[str], vocab: int, seed: int = 0,
                        log=print) -> dict:
    """Run the named workloads against the server at `url`; their results by name."""
    d = Driver(url, model_dir)
    try:
        await d.start()
        # Warm both paths up (first process of each program, first batches).
        await d.program("complete_ids", [2, ids_text([BOS, 5, 6, 7])])
        await d.complete([BOS, 5, 6, 7], 2)
        results = {}
        for name in names:
            started = time.perf_counter()
            sizes = {**size[name], "pool_tokens": size["kv_pages"] * size["page_size"]}
            results[name] = await WORKLOADS[name](d, sizes, vocab, seed, sizes.get("repeats", size["repeats"]))
            log(f"{name}: {time.perf_counter() - started:.1f} s", flush=True)
        return results
    finally:
        await d.close()


# ---- the server ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`symphony serve` as a child process on a loopback port."""

    def __init__(self, model_dir: Path, kv_pages: int, page_size: int, device: str = "cpu"):
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "symphony_os.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
                   "--port", self.url.rsplit(":", 1)[1], "--kv-pages", str(kv_pages), "--page-size", str(page_size),
                   "--device", device, "--log-level", "warning"]
        self.process = subprocess.Popen(command, env={k: v for k, v in os.environ.items() if k != "SYMPHONY_TOKEN"})

    def __enter__(self) -> "Server":
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError("symphony serve did not start")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def build_lips() -> None:
    zig = [*ZIG_CC, "--target=wasm32-wasi", "-O2", "-s",
           "-I", str(ROOT / "guest_sdk" / "c")]
    for name in LIP_NAMES:
        source, wasm = LIPS / f"{name}.c", LIPS / f"{name}.wasm"
        newest = max(source.stat().st_mtime, (LIPS / "bench_lip.h").stat().st_mtime)
        if not wasm.exists() or wasm.stat().st_mtime < newest:
            subprocess.run(zig + [str(source), "-o", str(wasm)], check=True)


# ---- transformers' generate, where it applies ----

def transformers_generate(model_dir: Path, size: dict, vocab: int, seed: int) -> dict:
    """Tokens per second of `generate` (greedy, static batches) on the completion and fork
    workloads' shapes, in this process while the server idles."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(batch: list[list[int]], tokens: int) -> float:
        ids = torch.tensor(batch)
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
        return time.perf_counter() - started

    rng = np.random.default_rng(seed)
    c = size["completion"]
    run([[BOS] + random_ids(rng, vocab, c["prompt"])] * 2, 2)  # warm-up
    elapsed, generated = 0.0, 0
    for start in range(0, c["requests"], c["concurrency"]):
        n = min(c["concurrency"], c["requests"] - start)
        elapsed += run([[BOS] + random_ids(rng, vocab, c["prompt"]) for _ in range(n)], c["tokens"])
        generated += n * c["tokens"]
    f = size["fork"]
    fork_elapsed = 0.0
    for _ in range(f["rounds"]):
        prefix = [BOS] + random_ids(rng, vocab, f["prefix"])
        fork_elapsed += run([prefix + random_ids(rng, vocab, f["suffix"]) for _ in range(f["branches"])], f["tokens"])
    return {"completion": {"generated_tokens_per_s": round(generated / elapsed, 2),
                           "units_per_s": round(c["requests"] / elapsed, 4)},
            "fork": {"generated_tokens_per_s": round(f["rounds"] * f["branches"] * f["tokens"] / fork_elapsed, 2),
                     "units_per_s": round(f["rounds"] / fork_elapsed, 4)}}


# ---- report ----

def table_rows(results: dict, hf: dict) -> list[tuple]:
    rows = []

    def add(name, metric, r, hf_value="-", paper="-"):
        spread = f"{r['ratio']:.2f} ({min(r['ratio_per_repeat']):.2f}-{max(r['ratio_per_repeat']):.2f})"
        rows.append((name, metric, r["programs"]["units_per_s"], r["prompts"]["units_per_s"], spread,
                     hf_value, r["identical_outputs"], f"{r['programs']['engine_tokens']} / {r['prompts']['engine_tokens']}",
                     f"{r['programs']['http_requests_per_unit']:g} / {r['prompts']['http_requests_per_unit']:g}", paper))

    for r in results.get("rag", {}).get("shapes", []):
        add(f"rag shape {r['shape']}", "queries/s", r, paper=PAPER["rag"])
    for r in results.get("rag_mixed", {}).get("shapes", []):
        add(f"rag + other traffic, shape {r['shape']}", "queries/s", r, paper=PAPER["rag"])
    units = {"completion": "requests/s", "fork": "rounds/s", "react": "agents/s", "got": "problems/s",
             "swarm": "conversations/s"}
    for name in ("completion", "fork", "react", "got", "swarm"):
        if name in results:
            hf_value = hf.get(name, {}).get("units_per_s", "-") if hf else "-"
            add(name, units[name], results[name], hf_value, PAPER[name])
    return rows


def print_table(rows: list[tuple], title: str) -> None:
    header = ("workload", "unit", "programs", "prompts", "ratio (range)", "hf generate", "same outputs",
              "engine tokens", "HTTP req/unit", "paper")
    cells = [header] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def plot(results: dict, latencies: dict, out: Path) -> list[str]:
    """PNGs beside `out` (the JSON), named after it: <stem>_rag_throughput.png, <stem>_latency_cdf.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    shapes = results.get("rag", {}).get("shapes", [])
    if shapes:
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(6, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
        x = [r["shape"] for r in shapes]
        ax.plot(x, [r["programs"]["units_per_s"] for r in shapes], "o-", label="programs (LIP, LFU-hinted KV files)")
        ax.plot(x, [r["prompts"]["units_per_s"] for r in shapes], "s--", label="prompts (/v1, prefix cache + LRU)")
        mixed = results.get("rag_mixed", {}).get("shapes", [])
        if mixed:
            mx = [r["shape"] for r in mixed]
            ax.plot(mx, [r["programs"]["units_per_s"] for r in mixed], "C0^", label="programs, with other traffic")
            ax.plot(mx, [r["prompts"]["units_per_s"] for r in mixed], "C1v", label="prompts, with other traffic")
            ax2.plot(mx, [r["ratio"] for r in mixed], "k^", label="with other traffic")
        ax.set_ylabel("queries / s (all repeats)")
        ax.set_title("RAG throughput on one server, same KV budget")
        ax.legend(fontsize=8)
        ratios = [r["ratio"] for r in shapes]
        low = [r["ratio"] - min(r["ratio_per_repeat"]) for r in shapes]
        high = [max(r["ratio_per_repeat"]) - r["ratio"] for r in shapes]
        ax2.errorbar(x, ratios, yerr=[low, high], fmt="ko-", capsize=4, label="median (range) of repeats")
        ax2.axhline(1.0, color="gray", lw=0.8)
        ax2.set_xlabel("Pareto shape of document popularity")
        ax2.set_ylabel("programs / prompts")
        ax2.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out.parent / f"{out.stem}_rag_throughput.png", dpi=110)
        plt.close(fig)
        written.append(f"{out.stem}_rag_throughput.png")
    if latencies:
        columns = -(-len(latencies) // 2)
        fig, axes = plt.subplots(2, columns, figsize=(4 * columns, 7), squeeze=False)
        for ax, (name, paths) in zip(axes.flat, latencies.items()):
            for path, style in (("programs", "-"), ("prompts", "--")):
                values = sorted(paths[path])
                ax.plot([v * 1000 for v in values], [(i + 1) / len(values) for i in range(len(values))], style,
                        drawstyle="steps-post", label=path)
            ax.set_title(name)
            ax.set_xlabel("latency per unit (ms)")
            ax.set_ylabel("fraction")
            ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(latencies):]:
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(out.parent / f"{out.stem}_latency_cdf.png", dpi=110)
        plt.close(fig)
        written.append(f"{out.stem}_latency_cdf.png")
    return written


def latencies_of(results: dict) -> dict:
    out = {}
    shapes = results.get("rag", {}).get("shapes", [])
    if shapes:
        middle = shapes[len(shapes) // 2]
        out[f"rag (shape {middle['shape']})"] = middle["latencies_s"]
    mixed = results.get("rag_mixed", {}).get("shapes", [])
    if mixed:
        out[f"rag + other traffic (shape {mixed[0]['shape']})"] = mixed[0]["latencies_s"]
    for name in ("completion", "fork", "react", "got", "swarm"):
        if name in results:
            out[name] = results[name]["latencies_s"]
    return out


def strip_latencies(results: dict) -> None:
    """Per-unit latencies go into the plots, not the JSON (which keeps percentiles)."""
    for value in list(results.values()):
        for r in value.get("shapes", [value]):
            r.pop("latencies_s", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the smaller sizes (under 10 minutes on 2 cores)")
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads")
    parser.add_argument("--model", default=None, help="a model directory (default: the random 8-layer Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "paper.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    size = SIZES["quick" if args.quick else "full"]
    names = [n for n in args.only.split(",") if n]
    build_lips()
    if args.model:
        model_dir = Path(args.model)
    else:
        import torch
        from engine import BENCH_SHAPE  # bench/engine.py's 50M-parameter random Llama

        from symphony_os.model.random_model import build_random_model
        model_dir = ROOT / "build" / "paper-model"
        if not (model_dir / "config.json").exists():
            build_random_model(model_dir, "llama", seed=0, dtype=torch.float32, **BENCH_SHAPE)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    with Server(model_dir, size["kv_pages"], size["page_size"], args.device) as server:
        results = asyncio.run(run_workloads(server.url, model_dir, size, names, vocab))
    hf = {} if args.no_transformers or not {"completion", "fork"} & set(names) else \
        transformers_generate(model_dir, size, vocab, seed=1)
    rows = table_rows(results, hf)
    latencies = latencies_of(results)
    strip_latencies(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    plots = plot(results, latencies, Path(args.out))
    import torch
    from engine import cpu_name, python_build  # bench/engine.py
    report = {"benchmark": "paper", "mode": "quick" if args.quick else "full", "model": model_dir.name,
              "device": args.device, "cpu": cpu_name(), "python": python_build(), "cpus": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "sizes": size, "paper": PAPER, "results": results,
              "transformers_generate": hf, "plots": plots, "wall_s": round(time.perf_counter() - started, 1),
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_table(rows, f"Programs vs prompts on one `symphony serve` ({model_dir.name}, {args.device}, "
                      f"{size['kv_pages']} KV pages of {size['page_size']} tokens); ratio = programs / prompts")
    print(f"\nwrote {args.out} and {', '.join(plots)}; {report['wall_s']} s")


if __name__ == "__main__":
    main()
