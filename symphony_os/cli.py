"""The `symphony` command line."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import click

from .engine.sampling import Sample, validate_want
from .errors import InvalidArgument, SymphonyError


def _engine_options(func):
    options = [
        click.option("--model", "model_path", default=None, metavar="DIR|FILE.gguf|ORG/NAME",
                     help="A Hugging Face directory, a GGUF file or a hub id (default: $SYMPHONY_MODEL, "
                          "else the bundled default model; `symphony models` lists what is here)."),
        click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
                     help="Weights and KV dtype (default: float32 on CPU, bfloat16 on GPU)."),
        click.option("--attention", type=click.Choice(["torch", "triton", "flash-attn"]), default=None,
                     help="Force an attention backend (also $SYMPHONY_ATTENTION; default: flash-attn on CUDA "
                          "when it is installed and the page size is a multiple of 256, else triton on CUDA, "
                          "torch on CPU)."),
        click.option("--page-size", default=16, show_default=True, type=click.IntRange(min=1),
                     help="KV page size in tokens."),
        click.option("--kv-pages", default=None, type=click.IntRange(min=1),
                     help="KV pool size in pages (default: by memory)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _make_engine(model_path, device, dtype, attention, page_size, kv_pages):
    from .engine.loop import Engine
    from .model.loader import ModelLoadError, default_model_path, load_model

    try:
        loaded = load_model(model_path or default_model_path(), dtype=dtype, device=device)
        return Engine(loaded, page_size=page_size, num_pages=kv_pages, attention=attention)
    except (ModelLoadError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    except RuntimeError as error:  # torch could not allocate the weights or the KV pool
        raise click.ClickException(f"cannot set up the model: {str(error).splitlines()[0]}") from error


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
def generate(model_path, device, dtype, attention, page_size, kv_pages, prompt, max_tokens, temperature,
             top_p, top_k, seed):
    """Stream a completion of PROMPT through the batch scheduler."""
    def sampling(step: int) -> Sample:
        return Sample(temperature=temperature, top_p=top_p, top_k=top_k, seed=None if seed is None else seed + step)

    try:  # before the model loads: a bad value is refused at once, in one line
        for step in (0, max(max_tokens - 1, 0)):
            validate_want(sampling(step), vocab_size=1)  # (no token ids to check against the vocabulary)
    except InvalidArgument as error:
        raise click.UsageError(str(error)) from None
    engine = _make_engine(model_path, device, dtype, attention, page_size, kv_pages)
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
def info(model_path, device, dtype, attention, page_size, kv_pages):
    """Print the model's shape, dtype, device, attention backend and KV pool size."""
    from .model.attention import describe_backend

    engine = _make_engine(model_path, device, dtype, attention, page_size, kv_pages)
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
    """List the models found here: the bundled default, $SYMPHONY_MODEL, ../shared/models and
    the Hugging Face cache. Any of them (or a hub id) can be passed as --model."""
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
def run(program, args, model_path, device, dtype, attention, page_size, kv_pages, stats, verbose, env_pairs):
    """Run PROGRAM.wasm (a LIP) in-process: what it sends goes to stdout, stdin lines go to its
    recv, and the exit code is the program's. Arguments after -- go to the program."""
    import threading
    import time

    from .client.commands import exit_status, output_closed_status, parse_env, stdin_messages
    from .errors import InputClosed, LimitExceeded, OutputClosed
    from .lip.runtime import Runtime
    from .wasm.program import ProgramError

    env = parse_env(env_pairs)
    engine = _make_engine(model_path, device, dtype, attention, page_size, kv_pages)
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

        started = time.perf_counter()
        process = runtime.spawn(prog, list(args), env, on_output=on_output,
                                on_log=(lambda text: sys.stderr.write(text)) if verbose else None)

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
    elif process.end_reason and not process.end_reason.startswith("exit"):
        click.echo(f"symphony run: {prog.name} {process.end_reason}", err=True)
    if stats:
        s, pool = engine.stats(), engine.pool.stats()
        click.echo(f"batches {s.batches}, mean batch size {s.mean_batch_size:.2f}, tokens {s.tokens} "
                   f"({s.tokens / elapsed:.1f} tokens/s), queue wait {s.mean_queue_wait_ms:.2f} ms, "
                   f"KV pages peak {pool.peak_used} of {pool.total}", err=True)
    sys.exit(exit_status(code))


@main.command()
@_engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
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
                   "Without --tenants, requests to other names are refused (DNS rebinding).")
@click.option("--allowed-origin", "allowed_origins", multiple=True, metavar="ORIGIN",
              help="A web origin whose pages may call the API, e.g. https://app.example (repeatable; '*': any). "
                   "Without --tenants, browsers' requests from other sites are refused.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"], case_sensitive=False))
def serve(model_path, device, dtype, attention, page_size, kv_pages, host, port, tenants_file, data_dir, grace_s,
          workers, allowed_hosts, allowed_origins, log_level):
    """Serve LIPs to many tenants over HTTP and WebSocket, with OpenAI-compatible endpoints
    under /v1 (API description at /docs and /openapi.json)."""
    if not grace_s < math.inf:  # (NaN too: vanished clients' processes would never be killed)
        raise click.BadParameter(f"{grace_s} is not a finite number of seconds", param_hint="'--grace'")
    import uvicorn

    from .server import logs
    from .server.app import ServerConfig, create_app
    from .server.tenants import Tenants, TenantsFileError

    try:
        tenants = Tenants.from_file(tenants_file) if tenants_file else Tenants.single()
    except TenantsFileError as error:
        raise click.ClickException(str(error)) from error
    if not tenants_file and not _is_loopback(host):
        names = "a loopback name" + ("" if host in ("0.0.0.0", "::") else f", {host}")
        click.echo(f"symphony serve: warning: listening on {host} without --tenants: anyone who can reach "
                   "the port may run programs, with no token and no quotas (requests must name this server "
                   f"by {names} or an --allowed-host)", err=True)
    engine = _make_engine(model_path, device, dtype, attention, page_size, kv_pages)
    config = ServerConfig(grace_s=grace_s, data_dir=Path(data_dir) if data_dir else None, workers=workers,
                          bind_host=host, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins)
    logs.configure(log_level)
    uvicorn.run(create_app(engine, tenants, config), host=host, port=port, log_config=None, log_level=log_level)


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
