"""The engine's counters in the Prometheus text format (version 0.0.4), for `GET /metrics` scrapers.

`engine_text(status, snapshot, batching)` turns what the runtime already reports (its status dict,
the Metrics snapshot with per-device memory, the scheduler's and prefix cache's counters when the
runtime batches) into the exposition text: queue depth, running generations and batch size, decode
tokens/s, token totals, rejected requests, the prefix cache's hit rate and bytes, device memory.

What this is not: a metrics store (engine/metrics.py keeps the time series; the scheduler and the
prefix cache count their own) or an HTTP route (engine/server.py serves the text).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# scheduler / prefix cache counter -> (metric name, type, help)
_BATCHING: dict[str, tuple[str, str, str]] = {
    "queue_depth": ("minecart_queue_depth", "gauge", "Generation requests waiting for a slot."),
    "running": ("minecart_requests_running", "gauge", "Generations running (sharing decode steps)."),
    "parallel": ("minecart_parallel_slots", "gauge", "Generations allowed to run at once (--parallel)."),
    "batch_size": ("minecart_batch_size", "gauge", "Sequences in the last decode step."),
    "batch_size_mean": ("minecart_batch_size_mean", "gauge", "Mean sequences per step since start."),
    "batch_size_max": ("minecart_batch_size_max", "gauge", "Most sequences in one step since start."),
    "decode_tokens_per_s": ("minecart_decode_tokens_per_second", "gauge",
                            "Generated tokens per second, all sequences, over the last 10 s."),
    "decode_tokens": ("minecart_decode_tokens_total", "counter", "Generated tokens computed."),
    "prefill_tokens": ("minecart_prefill_tokens_total", "counter", "Prompt tokens computed."),
    "steps": ("minecart_steps_total", "counter", "Batched forward passes."),
    "alone_steps": ("minecart_alone_steps_total", "counter",
                    "Of those, decode steps a generation running alone launched itself (chained on a GPU)."),
    "chained_passes": ("minecart_chained_passes_total", "counter",
                       "Decode rows whose token the scheduler drew from the row before (no wait for the caller)."),
    "rejected": ("minecart_requests_rejected_total", "counter",
                 "Requests refused because the queue was full (HTTP 429)."),
    "finished": ("minecart_requests_finished_total", "counter", "Generations that ended."),
    "memory_waits": ("minecart_memory_waits_total", "counter",
                     "Generations that waited for another to end before their KV cache fitted."),
    "cache_hit_rate": ("minecart_prefix_cache_hit_rate", "gauge",
                       "Prompt tokens restored from the prefix cache / prompt tokens looked up."),
    "cache_hits": ("minecart_prefix_cache_hits_total", "counter", "Requests that resumed from the cache."),
    "cache_lookups": ("minecart_prefix_cache_lookups_total", "counter", "Prefix cache lookups."),
    "cache_hit_tokens": ("minecart_prefix_cache_hit_tokens_total", "counter",
                         "Prompt tokens restored from the prefix cache."),
    "cache_bytes": ("minecart_prefix_cache_bytes", "gauge", "Bytes held by the prefix cache."),
    "cache_entries": ("minecart_prefix_cache_entries", "gauge", "Block boundaries in the prefix cache."),
    "cache_evictions": ("minecart_prefix_cache_evictions_total", "counter",
                        "Block boundaries evicted from the prefix cache."),
}


@dataclass(frozen=True)
class Sample:
    name: str
    kind: str  # "gauge" or "counter"
    help: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(samples: list[Sample]) -> str:
    """The exposition text: one HELP and TYPE line per metric name, then its samples."""
    lines: list[str] = []
    seen: set[str] = set()
    for s in samples:
        if s.name not in seen:
            seen.add(s.name)
            lines.append(f"# HELP {s.name} {s.help}")
            lines.append(f"# TYPE {s.name} {s.kind}")
        labels = ",".join(f'{k}="{_label_value(v)}"' for k, v in s.labels)
        lines.append(f"{s.name}{{{labels}}} {_number(s.value)}" if labels else f"{s.name} {_number(s.value)}")
    return "\n".join(lines) + "\n"


def engine_samples(status: Mapping[str, Any], snapshot: Mapping[str, Any],
                   batching: Mapping[str, float | int] | None) -> list[Sample]:
    """Samples from the runtime's status(), its Metrics.snapshot() and (when it batches) the
    scheduler's and prefix cache's counters. Without batching, queue depth and running requests
    come from the runtime's own queue."""
    out = [Sample("minecart_up", "gauge", "The engine answers.", 1.0),
           Sample("minecart_model_loaded", "gauge", "A model is loaded.",
                  1.0 if status.get("model") else 0.0)]
    counters = dict(batching or {})
    if batching is None:
        counters["queue_depth"] = int(status.get("queued", 0))
        counters["running"] = 1 if status.get("busy") else 0
        counters["parallel"] = 1
        live = snapshot.get("decode_tps_live", {}).get("v") or []
        counters["decode_tokens_per_s"] = float(live[-1]) if live else 0.0
    for key, (name, kind, text) in _BATCHING.items():
        if key in counters:
            out.append(Sample(name, kind, text, float(counters[key])))
    for device, mem in sorted((snapshot.get("memory") or {}).items()):
        used = mem.get("used_bytes") or []
        if used:
            out.append(Sample("minecart_device_memory_used_bytes", "gauge",
                              "Memory in use on a device (last sample).", float(used[-1]),
                              (("device", str(device)),)))
        total = mem.get("total_bytes")
        if total:
            out.append(Sample("minecart_device_memory_total_bytes", "gauge", "Memory of a device.",
                              float(total), (("device", str(device)),)))
    return out


def engine_text(status: Mapping[str, Any], snapshot: Mapping[str, Any],
                batching: Mapping[str, float | int] | None) -> str:
    return render(engine_samples(status, snapshot, batching))
