"""Per-GPU results of the kernel probe, kept as JSON in the user cache directory.

The CuPy backend times the DP4A and fp32-FMA variants of its matmul kernels on the actual card at load
(kernels/probe.py), keeps the faster path, and stores the result here under the GPU's UUID (the NVML
form "GPU-xxxxxxxx-..."), so the next start reuses the choice and `minecart inspect --gpu`
(engine/devices.py) can show it. One JSON object: {uuid: record}; a record is a plain dict with at least
"name", "gemv", "gemm" (chosen paths among dp4a / dp4a2 / fma / hfma2), "summary" (one line for people)
and "probed_at"; kernels/probe.py also stores "gemv_us" / "gemm_us" (microseconds per variant).

This module only reads and writes that file; it never touches a GPU. A missing or corrupt file reads
as empty (the probe then runs again). Set MINECART_CACHE_DIR to put the file elsewhere (tests do).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

FILE_NAME = "gpu_probe.json"
VERSION = 4  # bump when the kernels change enough that old choices should be re-probed
# Version 2 added the fp16 HFMA2 path: version-1 records (DP4A / FMA timings only) are ignored, so a
# card probed before it is simply probed again, three-way, at the next load. Version 3 added the
# K-quants' own prefill stage depth (gemm_kquant). Version 4 added the requantized K-quant prefill
# (gemm_kquant "dp4a_rq").


def cache_path() -> Path:
    env = os.environ.get("MINECART_CACHE_DIR")
    if env:
        return Path(env) / FILE_NAME
    import platformdirs

    return Path(platformdirs.user_cache_dir("minecart")) / FILE_NAME


def load_all() -> dict[str, dict]:
    """Every stored record, keyed by GPU UUID ({} when there is no readable cache)."""
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and v.get("version") == VERSION}


def get(uuid: str) -> dict | None:
    """The record of one GPU, or None."""
    return load_all().get(uuid)


def save(uuid: str, record: dict) -> Path:
    """Store (replace) the record of one GPU; written atomically so readers never see half a file."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    rec = dict(record)
    rec["version"] = VERSION
    rec.setdefault("probed_at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    rec.setdefault("summary", summarize(rec))
    data[uuid] = rec
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gpu_probe.", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def summarize(rec: dict) -> str:
    """One line for people: chosen paths and the measured rates behind the choice."""
    parts = []
    if "dp4a_tops" in rec:
        parts.append(f"DP4A {rec['dp4a_tops']:.1f} TOPS")
    if "fma_tflops" in rec:
        parts.append(f"FP32 {rec['fma_tflops']:.1f} TFLOP/s")
    if "copy_gbs" in rec:
        parts.append(f"copy {rec['copy_gbs']:.0f} GB/s")
    for label, what in (("gemv", "decode"), ("gemm", "prefill"), ("gemm_kquant", "K-quant prefill")):
        chosen = rec.get(label)
        if not chosen:
            continue
        times = rec.get(f"{label}_us")
        if isinstance(times, dict) and times:
            shown = ", ".join(f"{p} {t:.0f} us" for p, t in times.items() if isinstance(t, (int, float)))
            parts.append(f"{what} path {chosen} ({shown})")
        else:
            parts.append(f"{what} path {chosen}")
    if rec.get("dp4a_throttled"):
        parts.append("DP4A throttled")
    return "; ".join(parts)


def summary_for(key: str) -> str:
    """The summary line for a GPU UUID ('' when not probed)."""
    rec = load_all().get(key)
    return "" if rec is None else str(rec.get("summary") or summarize(rec))
