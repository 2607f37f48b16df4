"""Serving benchmark: starts `symphony serve` as its own process, then drives it from this one
with N concurrent clients over both front doors, and reports throughput and latency:

- LIP path: upload lips/hello.wasm, then each request launches a process and streams its
  output over the WebSocket (hello sends the prompt first, then text as tokens come);
- OpenAI path: streamed /v1/completions (the built-in `complete` LIP, prefix reuse on).

Time to first token (TTFT) is from sending the request to the first generated text; per-token
latency is (last - first token time) / (tokens - 1) for each request. Writes
bench/results/serve.json (or --out).

    .venv/bin/python bench/serve.py --clients 16 --requests 4 --max-tokens 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from symphony_os.client.client import AsyncClient  # noqa: E402

PROMPTS = [f"{name} went to the {place} and" for name in ("Tom", "Lily", "Sue", "Ben", "Max", "Mia", "Sam", "Ann")
           for place in ("park", "shop", "sea", "woods")]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def summarize(records: list[dict], wall_s: float) -> dict:
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    per_token = [r["per_token_s"] for r in records if r["per_token_s"] is not None]
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "generated_tokens": tokens, "wall_s": round(wall_s, 3),
            "tokens_per_s": round(tokens / wall_s, 2), "requests_per_s": round(len(records) / wall_s, 3),
            "ttft_ms": {"p50": round(1000 * percentile(ttft, 50), 2), "p99": round(1000 * percentile(ttft, 99), 2)},
            "per_token_ms": {"p50": round(1000 * percentile(per_token, 50), 2),
                             "p99": round(1000 * percentile(per_token, 99), 2)}}


def timing(started: float, token_times: list[float]) -> dict:
    return {"ttft_s": token_times[0] - started if token_times else None,
            "per_token_s": (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else None,
            "tokens": len(token_times)}


async def lip_request(client: AsyncClient, sha: str, prompt: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    pid = (await client.launch(sha, [prompt, str(max_tokens)]))["pid"]
    stream = await client.attach(pid)
    times, frames = [], 0
    async for frame in stream:
        if frame["type"] == "output":
            frames += 1
            if frames > 1 and frame["data"] != b"\n":  # the first frame is the prompt, the last a newline
                times.append(time.perf_counter())
        elif frame["type"] == "exit" and frame["code"] != 0:
            raise RuntimeError(f"hello failed: {frame}")
    await stream.close()
    return timing(started, times)


async def openai_request(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    times = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(time.perf_counter())
    return timing(started, times)


async def drive(clients: int, requests: int, one) -> tuple[list[dict], float]:
    async def client_loop(c: int) -> list[dict]:
        return [await one(PROMPTS[(c * requests + r) % len(PROMPTS)]) for r in range(requests)]

    started = time.perf_counter()
    results = await asyncio.gather(*(client_loop(c) for c in range(clients)))
    return [r for rs in results for r in rs], time.perf_counter() - started


async def bench(url: str, args) -> dict:
    async with AsyncClient(url) as client, httpx.AsyncClient(base_url=url, timeout=600) as http:
        sha = (await client.upload(ROOT / "lips" / "hello.wasm"))["sha256"]
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        # Warm up both paths (the first process of a program, the first batches).
        await lip_request(client, sha, PROMPTS[0], 4)
        await openai_request(http, model, PROMPTS[0], 4)
        lip, lip_wall = await drive(args.clients, args.requests, lambda p: lip_request(client, sha, p, args.max_tokens))
        oai, oai_wall = await drive(args.clients, args.requests,
                                    lambda p: openai_request(http, model, p, args.max_tokens))
        metrics = (await http.get("/metrics")).text
    batch_size = next(float(line.split()[1]) for line in metrics.splitlines()
                      if line.startswith("symphony_batch_size_mean "))
    return {"lip_path": summarize(lip, lip_wall), "openai_path": summarize(oai, oai_wall),
            "server_mean_batch_size": batch_size}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT.parent / "shared" / "models" / "stories260K"))
    parser.add_argument("--device", default=None)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve.json"))
    args = parser.parse_args()
    subprocess.run(["make", "-C", str(ROOT), "lips"], check=True, capture_output=True)
    port = free_port()
    command = [str(ROOT / ".venv" / "bin" / "symphony"), "serve", "--model", args.model, "--port", str(port),
               "--log-level", "warning"] + (["--device", args.device] if args.device else [])
    server = subprocess.Popen(command, env={**os.environ, "SYMPHONY_TOKEN": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("symphony serve did not start")
            time.sleep(0.2)
        results = asyncio.run(bench(url, args))
    finally:
        server.terminate()
        server.wait(30)
    report = {"benchmark": "serve", "model": Path(args.model).name, "device": args.device or "default",
              "host": platform.node(), "cpus": os.cpu_count(), "clients": args.clients,
              "requests_per_client": args.requests, "max_tokens": args.max_tokens, **results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
