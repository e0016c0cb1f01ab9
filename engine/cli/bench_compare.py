"""The peer comparison of `minecart bench --compare-gguf FILE [--peer-bench LLAMA_BENCH]`: the contexts of
the peer table (prompt 512 and 4096 from an empty context, decode of 64 tokens at context 0, 4K and 16K),
the llama-bench command that measures the same file at the same contexts, the parsing of its JSON
output, and the table of our tokens/s beside the ceilings and the peer's.

Here: plain data and one subprocess call. Not here: running our own benchmark (bench_cmd.bench) and
the command line (bench_cmd.register). Every number printed is measured in the same run; nothing is
quoted from elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MinecartError

PEER_PREFILL = (512, 4096)  # prompt tokens, each from an empty context
PEER_DECODE_CTX = (0, 4096, 16384)  # decode depths (tokens already in the context)
PEER_DECODE_TOKENS = 64  # tokens generated per decode test
PEER_TIMEOUT_S = 1800


@dataclass(frozen=True)
class PeerResult:
    """Tokens/s the peer measured, keyed like ours: prefill by prompt tokens (empty context), decode by
    depth. `label` names the build (commit, backend)."""

    label: str
    prefill: dict[int, float]
    decode: dict[int, float]


def peer_command(binary: str | Path, gguf: str | Path, prefill: Sequence[int] = PEER_PREFILL,
                 decode_ctx: Sequence[int] = PEER_DECODE_CTX,
                 decode_tokens: int = PEER_DECODE_TOKENS) -> list[str]:
    """llama-bench on `gguf` at the peer table's contexts: every layer on the GPU, flash attention on,
    JSON on stdout (one object per test: n_prompt, n_gen, n_depth, avg_ts)."""
    return [str(binary), "-m", str(gguf), "-p", ",".join(map(str, prefill)), "-n", str(decode_tokens),
            "-d", ",".join(map(str, decode_ctx)), "-fa", "1", "-ngl", "99", "-o", "json"]


def peer_env(device: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The peer's environment: only the GPU our run used is visible (llama-bench would otherwise split
    the layers over every GPU), counted within an existing CUDA_VISIBLE_DEVICES list if one is set."""
    env = dict(environ)
    if not device.startswith("cuda"):
        return env
    index = int(device.split(":")[1]) if ":" in device else 0
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        if index >= len(visible):
            raise MinecartError(f"{device} is not among CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}")
        env["CUDA_VISIBLE_DEVICES"] = visible[index]
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(index)
    return env


def parse_peer_json(text: str, prefill: Sequence[int] = PEER_PREFILL,
                    decode_ctx: Sequence[int] = PEER_DECODE_CTX) -> PeerResult:
    """llama-bench's `-o json` output (an array of test objects) -> PeerResult. Prompt tests at a depth
    other than 0 are left out (ours start from an empty context); a context the peer did not report
    is an error naming it."""
    start = text.find("[")
    try:
        rows = json.loads(text[start:]) if start >= 0 else None
    except ValueError as exc:
        raise MinecartError(f"llama-bench printed no readable JSON array ({exc}); first bytes: {text[:200]!r}") \
            from exc
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise MinecartError(f"llama-bench printed no JSON array of tests; first bytes: {text[:200]!r}")
    pre: dict[int, float] = {}
    dec: dict[int, float] = {}
    try:
        for r in rows:
            n_prompt, n_gen, depth = int(r["n_prompt"]), int(r["n_gen"]), int(r.get("n_depth", 0))
            if n_gen == 0 and n_prompt > 0 and depth == 0:
                pre[n_prompt] = float(r["avg_ts"])
            elif n_prompt == 0 and n_gen > 0:
                dec[depth] = float(r["avg_ts"])
    except (KeyError, TypeError, ValueError) as exc:
        raise MinecartError(f"llama-bench JSON test lacks a field ({exc}); expected n_prompt, n_gen, n_depth, "
                            "avg_ts") from exc
    missing = [f"prompt {n}" for n in prefill if n not in pre] + [f"decode @ {d}" for d in decode_ctx if d not in dec]
    if missing:
        raise MinecartError(f"llama-bench reported no result for {', '.join(missing)}")
    first = rows[0] if rows else {}
    label = " ".join(str(first[k]) for k in ("build_commit", "backends", "gpu_info") if first.get(k)) or "peer"
    return PeerResult(label, pre, dec)


def run_peer(binary: str, gguf: str | Path, device: str, prefill: Sequence[int] = PEER_PREFILL,
             decode_ctx: Sequence[int] = PEER_DECODE_CTX, decode_tokens: int = PEER_DECODE_TOKENS,
             timeout: float = PEER_TIMEOUT_S) -> PeerResult:
    """Run llama-bench (peer_command) and parse its JSON; a missing binary, a failure or a timeout is a
    MinecartError that says which."""
    exe = shutil.which(binary) or (binary if Path(binary).is_file() else None)
    if exe is None or not os.access(exe, os.X_OK):
        raise MinecartError(f"--peer-bench {binary}: no such executable (give the path of a llama-bench binary)")
    cmd = peer_command(exe, gguf, prefill, decode_ctx, decode_tokens)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=peer_env(device, os.environ))
    except subprocess.TimeoutExpired as exc:
        raise MinecartError(f"llama-bench did not finish within {timeout:.0f} s: {' '.join(cmd)}") from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise MinecartError(f"llama-bench exited with status {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return parse_peer_json(proc.stdout, prefill, decode_ctx)


def compare_rows(res: dict[str, Any], peer: PeerResult | None) -> list[dict[str, Any]]:
    """One row per test of the peer table: our tokens/s, the ceiling and our share of it, and (with a
    peer) the peer's tokens/s, its share of the ceiling and ours / the peer's."""
    rows: list[dict[str, Any]] = []
    tests = [("prefill", r["tokens"], f"prompt {r['tokens']}", r) for r in res["prefill"]]
    tests += [("decode", r["context"], f"decode {r['tokens']} @ {r['context']}", r) for r in res["decode"]]
    for kind, key, label, r in tests:
        row: dict[str, Any] = {"test": label, "kind": kind, "key": key, "tokens_per_s": r["tokens_per_s"],
                               "ceiling_tokens_per_s": r.get("ceiling_tokens_per_s"), "ratio": r.get("ratio")}
        if peer is not None:
            theirs = (peer.prefill if kind == "prefill" else peer.decode).get(key)
            row["peer_tokens_per_s"] = theirs
            ceiling = row["ceiling_tokens_per_s"]
            row["peer_ratio"] = theirs / ceiling if theirs and ceiling else None
            row["vs_peer"] = r["tokens_per_s"] / theirs if theirs else None
        rows.append(row)
    return rows


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_compare(res: dict[str, Any], rows: list[dict[str, Any]], peer: PeerResult | None) -> str:
    """The comparison table: ours beside the ceiling, and beside the peer when there is one."""
    lines = [f"model: {res['model']}", f"backend: {res['backend']}, KV cache {res.get('kv_type', '?')}"]
    if peer is not None:
        lines.append(f"peer: llama-bench ({peer.label}), -fa 1 -ngl 99, same file, same run")
    head = f"{'test':<20}{'minecart tok/s':>15}{'ceiling':>11}{'ratio':>7}"
    if peer is not None:
        head += f"{'peer tok/s':>12}{'ratio':>7}{'vs peer':>9}"
    lines.append(head)
    for r in rows:
        line = (f"{r['test']:<20}{r['tokens_per_s']:>15,.1f}{_cell(r['ceiling_tokens_per_s'], ',.0f'):>11}"
                f"{_cell(r['ratio'], '.0%'):>7}")
        if peer is not None:
            line += (f"{_cell(r['peer_tokens_per_s'], ',.1f'):>12}{_cell(r['peer_ratio'], '.0%'):>7}"
                     f"{_cell(r['vs_peer'], '.2f'):>9}")
        lines.append(line)
    dec = [r for r in rows if r["kind"] == "decode"]
    if len(dec) > 1 and dec[0]["tokens_per_s"]:
        lines.append(f"decode @ {dec[-1]['key']} / decode @ {dec[0]['key']}: "
                     f"{dec[-1]['tokens_per_s'] / dec[0]['tokens_per_s']:.0%}"
                     + (f" (peer {dec[-1]['peer_tokens_per_s'] / dec[0]['peer_tokens_per_s']:.0%})"
                        if peer is not None and dec[0].get("peer_tokens_per_s") and dec[-1].get("peer_tokens_per_s")
                        else ""))
    return "\n".join(lines)
