"""The client commands of the `symphony` CLI (`upload`, `launch`, `ps`, `kill`, `kv ls|rm`),
talking to `symphony serve` through `symphony_os.client`. Each takes --server and --token
(or $SYMPHONY_SERVER and $SYMPHONY_TOKEN)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

import click
import websockets

from .client import DEFAULT_SERVER, AsyncClient, Client, ServerError


def parse_env(pairs: tuple[str, ...]) -> dict[str, str]:
    """--env NAME=VALUE options (of `launch` and `run`) as a dict."""
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--env")
        env[name] = value
    return env


# A stdin line goes as one message; the server's WebSocket takes frames up to 16 MiB.
MAX_LINE_BYTES = 8 * 2**20


def stdin_messages(command: str):
    """The lines of stdin as the program's messages: bytes as they are (any encoding), without
    their line ending (\\n or \\r\\n). A line over MAX_LINE_BYTES ends the input, with a warning."""
    for line in sys.stdin.buffer:
        line = line[:-1] if line.endswith(b"\n") else line
        line = line[:-1] if line.endswith(b"\r") else line
        if len(line) > MAX_LINE_BYTES:
            click.echo(f"symphony {command}: a stdin line of {len(line)} bytes is over the {MAX_LINE_BYTES}-byte "
                       "limit of a message; the program's input ends there", err=True)
            return
        yield line


def exit_status(code: int) -> int:
    """A program's exit code as this command's status: 0-255 as they are, any other 1 (a shell
    would see 256 as 0, success)."""
    return code if 0 <= code <= 255 else 1


def output_closed_status() -> int:
    """After stdout's reader left (`| head`): stdout goes to /dev/null, so that nothing fails
    flushing it at exit, and the exit status is a SIGPIPE death's, as other Unix tools give."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _server_options(func):
    func = click.option("--token", envvar="SYMPHONY_TOKEN", default=None,
                        help="Bearer token of your tenant (or $SYMPHONY_TOKEN).")(func)
    return click.option("--server", envvar="SYMPHONY_SERVER", default=DEFAULT_SERVER, show_default=True,
                        help="Server URL (or $SYMPHONY_SERVER).")(func)


def _fail(error: Exception) -> None:
    reason = error.reason if isinstance(error, ServerError) else str(error)
    prefix = f"server refused ({error.status})" if isinstance(error, ServerError) else "cannot reach the server"
    raise click.ClickException(f"{prefix}: {reason}")


@contextlib.contextmanager
def _server_errors():
    """The server's refusals and the transport's failures (OSError, httpx's and websockets'
    own exceptions) as one-line errors; anything else propagates."""
    try:
        yield
    except BrokenPipeError:  # our own stdout's reader left (`launch --detach | true`), not the server
        sys.exit(output_closed_status())
    except OSError as error:
        if error.filename is not None:  # a local file, not the connection
            raise click.ClickException(f"cannot read {error.filename}: {error.strerror}") from None
        _fail(error)
    except ServerError as error:
        _fail(error)
    except Exception as error:
        if type(error).__module__.split(".")[0] in ("httpx", "websockets"):
            _fail(error)
        raise


def _calling(server: str, token: str | None, call):
    with _server_errors(), Client(server, token) as client:
        return call(client)


@click.command()
@click.argument("program", type=click.Path(dir_okay=False, exists=True))
@click.option("--name", default=None, help="Name shown in listings (default: the file's stem).")
@_server_options
def upload(program, name, server, token):
    """Upload PROGRAM.wasm; prints its sha256."""
    stored = _calling(server, token, lambda c: c.upload(program, name))
    click.echo(stored["sha256"])


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("program")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE", help="Environment variable for the program.")
@click.option("--detach", is_flag=True, help="Print the pid and leave the process running.")
@click.option("--verbose", "-v", is_flag=True, help="Copy the program's log to stderr.")
@_server_options
def launch(program, args, env_pairs, detach, verbose, server, token):
    """Launch PROGRAM (a sha256 or a .wasm file, uploaded first) with ARGS after --; stream its
    output to stdout and stdin lines to its recv. The exit code is the program's."""
    env = parse_env(env_pairs)
    with _server_errors():
        code = asyncio.run(_launch(server, token, program, list(args), env, detach, verbose))
    sys.exit(code)


async def _launch(server, token, program, args, env, detach, verbose) -> int:
    async with AsyncClient(server, token) as client:
        if Path(program).is_file():
            program = (await client.upload(program))["sha256"]
        info = await client.launch(program, args, env, detached=detach)
        if detach:
            click.echo(info["pid"])
            return 0
        return await _follow(client, info["pid"], verbose, "launch")


@click.command()
@click.argument("pid", type=int)
@click.option("--verbose", "-v", is_flag=True, help="Copy the program's log to stderr.")
@_server_options
def attach(pid, verbose, server, token):
    """Attach to process PID (one launched with --detach, say): stream its output to stdout, from
    what no client has taken yet, and stdin lines to its recv. The exit code is the program's;
    Ctrl-C detaches again and leaves it running."""
    with _server_errors():
        code = asyncio.run(_attach(server, token, pid, verbose))
    sys.exit(code)


async def _attach(server, token, pid, verbose) -> int:
    async with AsyncClient(server, token) as client:
        return await _follow(client, pid, verbose, "attach")


async def _follow(client: AsyncClient, pid: int, verbose: bool, command: str) -> int:
    """Be process `pid`'s client until it ends: its output to stdout, stdin to it; its exit status."""
    stream = await client.attach(pid)
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue = asyncio.Queue()

    def read_stdin() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the process ended first
            for line in stdin_messages(command):
                loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, None)

    async def forward() -> None:
        while (line := await lines.get()) is not None:
            await stream.send(line)
        await stream.close_input()

    threading.Thread(target=read_stdin, name="stdin", daemon=True).start()
    forwarding = asyncio.create_task(forward())
    end = {"code": 1, "reason": "the connection closed before the process ended"}
    out = sys.stdout.buffer
    try:
        async for frame in stream:
            if frame["type"] == "output":
                try:
                    out.write(frame["data"])
                    out.flush()
                except BrokenPipeError:  # the reader left (`| head`): end the process, quietly
                    with contextlib.suppress(websockets.ConnectionClosed):  # (it may have ended)
                        await stream.kill()
                    return output_closed_status()
            elif frame["type"] == "log" and verbose:
                sys.stderr.write(frame["text"])
            elif frame["type"] == "error":  # the server refused something we sent
                click.echo(f"symphony {command}: {frame['message']}", err=True)
            elif frame["type"] == "exit":
                end = frame
    except asyncio.CancelledError:  # Ctrl-C: `attach` leaves it running, detached again
        if command == "attach":
            with contextlib.suppress(websockets.ConnectionClosed):
                await stream.detach()
        raise
    finally:
        forwarding.cancel()
        await stream.close()
    if not str(end.get("reason", "")).startswith("exit"):
        click.echo(f"symphony {command}: process {pid} {end['reason']}", err=True)
    return exit_status(end["code"])


@click.command()
@click.option("--all", "-a", "show_all", is_flag=True, help="Include processes that ended recently.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_server_options
def ps(show_all, as_json, server, token):
    """List your processes."""
    processes = _calling(server, token, lambda c: c.ps(all=show_all))
    if as_json:
        click.echo(json.dumps(processes, indent=2))
        return
    click.echo(f"{'PID':>6}  {'STATE':<16} {'CPU_S':>7}  {'PROGRAM':<12} ARGS")
    for p in processes:
        click.echo(f"{p['pid']:>6}  {p['state']:<16} {p['cpu_time_s']:>7.2f}  {p['program'][:12]:<12} "
                   f"{p['name']} {' '.join(p['args'])}")


@click.command()
@click.argument("pid", type=int)
@_server_options
def kill(pid, server, token):
    """Kill one of your processes."""
    info = _calling(server, token, lambda c: c.kill(pid))
    click.echo(f"killed {pid}" if info.get("was_running", True) else f"{pid} had already ended: {info['end_reason']}")


@click.group()
def kv():
    """Your KV files on the server."""


@kv.command("ls")
@click.argument("prefix", default="")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_server_options
def kv_ls(prefix, as_json, server, token):
    """List your KV files (and those shared with you, as @owner/name)."""
    files = _calling(server, token, lambda c: c.kv_ls(prefix))
    if as_json:
        click.echo(json.dumps(files, indent=2))
        return
    for f in files:
        click.echo(f"{f['tokens']:>8} tokens {f['pages']:>6} pages  {f['path']}")


@kv.command("rm")
@click.argument("paths", nargs=-1, required=True)
@_server_options
def kv_rm(paths, server, token):
    """Remove KV files by name."""
    for path in paths:
        _calling(server, token, lambda c: c.kv_rm(path))
        click.echo(f"removed {path}")


CLIENT_COMMANDS = (upload, launch, attach, ps, kill, kv)
