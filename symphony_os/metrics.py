"""/metrics in the Prometheus text exposition format (version 0.0.4): processes by state, batch
sizes, tokens, queue wait, KV pages used / shared / swapped, prefix-cache reuse."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .process import ProcessState

if TYPE_CHECKING:
    from .server_state import ServerState


def _metric(lines: list[str], name: str, kind: str, help_text: str, samples) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        label_text = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        lines.append(f"{name}{label_text} {_number(value)}")


def _number(value: int | float) -> str:
    """Exactly: counters as integers, other values as the shortest repr that round-trips."""
    return str(value) if isinstance(value, int) else repr(float(value))


def render_metrics(state: "ServerState") -> str:
    engine, table = state.engine, state.table
    stats, pool = engine.stats(), engine.pool.stats()
    uptime_s = max(time.time() - state.started_at, 1e-9)
    by_state = table.counts_by_state()
    lines: list[str] = []
    _metric(lines, "symphony_processes", "gauge", "Processes the server remembers, by state.",
            [({"state": s.value}, by_state.get(s.value, 0)) for s in ProcessState])
    _metric(lines, "symphony_batches_total", "counter", "Forward passes run.", [({}, stats.batches)])
    _metric(lines, "symphony_batch_sequences_total", "counter", "Sequences over all batches.", [({}, stats.sequences)])
    _metric(lines, "symphony_batch_size_mean", "gauge", "Mean sequences per batch since start.",
            [({}, stats.mean_batch_size)])
    _metric(lines, "symphony_tokens_total", "counter", "Tokens through the model (prefill and decode).",
            [({}, stats.tokens)])
    _metric(lines, "symphony_tokens_per_second", "gauge", "Tokens through the model per second since start.",
            [({}, stats.tokens / uptime_s)])
    _metric(lines, "symphony_pred_queue_wait_seconds", "summary", "Time pred requests waited for a batch.", [])
    lines.append(f"symphony_pred_queue_wait_seconds_sum {_number(stats.queue_wait_s)}")
    lines.append(f"symphony_pred_queue_wait_seconds_count {_number(stats.requests)}")
    _metric(lines, "symphony_forward_seconds_total", "counter", "Time spent in forward passes.", [({}, stats.forward_s)])
    _metric(lines, "symphony_kv_pages", "gauge", "KV pool pages by use.",
            [({"kind": "total"}, pool.total), ({"kind": "used"}, pool.used), ({"kind": "shared"}, pool.shared),
             ({"kind": "swapped"}, pool.swapped), ({"kind": "free"}, pool.free)])
    _metric(lines, "symphony_kv_files", "gauge", "KV files alive.", [({}, engine.kvfs.file_count)])
    _metric(lines, "symphony_kv_evicted_files_total", "counter", "Named KV files evicted under memory pressure.",
            [({}, engine.kvfs.evicted_files)])
    completions = state.completions
    _metric(lines, "symphony_completion_prompt_tokens_total", "counter", "Prompt tokens of OpenAI-path requests.",
            [({}, completions.prompt_tokens)])
    _metric(lines, "symphony_completion_cached_tokens_total", "counter",
            "Prompt tokens of OpenAI-path requests reused from the prefix cache.", [({}, completions.cached_tokens)])
    return "\n".join(lines) + "\n"
