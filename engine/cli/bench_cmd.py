"""`minecart bench`: prefill and decode speed of a model on one device, each beside its ceiling.

    minecart bench MODEL.gguf [--device cuda:0]
    minecart bench --shape qwen3.5-9b --quant q8_0        # synthesizes the file first (engine/synth.py)

In the same run it measures the device's ceilings - on a GPU copy bandwidth, DP4A and fp32 FMA rates
(kernels/probe.py), on the CPU memory copy bandwidth and the fp32 matrix-product (FMA) rate of NumPy's
BLAS (cpu_ceilings) - then:
- GEMM and GEMV kernel rates on one of the model's own FFN weights (int8 TOPS vs the DP4A ceiling,
  GB/s vs the copy ceiling);
- prefill tokens/s at 512, 2K, 8K and 18K prompt tokens (one pass), ceiling = DP4A rate (CPU: fp32
  FMA rate) / operations per token (2 x matrix weights, embedding and LM head excluded);
- decode tokens/s at context 0, 4K and 18K, ceiling = copy bandwidth / weight bytes read per token
  (every weight but the token-embedding table; of a MoE layer's routed experts only the
  n_experts_used a token picks);
- peak VRAM.
Prints a table (or JSON with --json). The device is opened before anything is written; a file --shape
synthesizes is deleted afterwards, pass or fail, unless --workdir names where to keep it.
`--quant q8_0,q4_k,q6_k` benchmarks several synthesized types in one run and ends with a table of
them; `--compare-gguf FILE [--peer-bench LLAMA_BENCH]` runs FILE at the peer table's contexts and, with
a llama-bench binary, that binary on the same file in the same run (bench_compare.py).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import DeviceError, MinecartError
from ..execution import make_backend
from ..expert_pool import GPU_STEPS, PROF_STEPS, SERVED_STEPS, ExpertPool
from ..experts import ExpertsApart
from ..kvquant import DEFAULT_KV_TYPE, KV_TYPES
from ..placement import EXPERTS_ON_HELP
from ..rig import RigBackend
from ..sampling import GREEDY_PICK, TopLogits
from .run_cmd import add_cpu_weights_arg, add_threads_arg, experts_on_arg

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..model import Model


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="measure prefill/decode speed against the card's ceilings",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="GGUF file to benchmark (or use --shape)")
    p.add_argument("--shape", help="synthesize a model of this shape (e.g. qwen3.5-9b) instead of a file")
    p.add_argument("--quant", default="q8_0",
                   help="quant type(s) for --shape, comma separated: each is synthesized and benchmarked in "
                        "turn, then compared in one table (e.g. q8_0,q4_k,q6_k; default q8_0)")
    p.add_argument("--compare-gguf", metavar="FILE", default=None,
                   help="benchmark FILE at the peer table's contexts (prompt 512 and 4096, decode of 64 tokens "
                        "at context 0, 4096 and 16384) and print tokens/s with the ratios to the ceilings")
    p.add_argument("--peer-bench", metavar="LLAMA_BENCH", default=None,
                   help="with --compare-gguf: also run this llama-bench binary on the same file at the same "
                        "contexts (-fa 1 -ngl 99, JSON) after ours, and print the ratio to it")
    p.add_argument("--layers", type=int, help="keep only the first N layers of a --shape model")
    p.add_argument("--workdir", default=None,
                   help="where --shape writes its file and keeps it for the next run (default: a "
                        "temporary folder, deleted afterwards)")
    p.add_argument("--device", default="cuda:0", help="device to run on (default cuda:0)")
    p.add_argument("--prefill", default="512,2048,8192,18432", help="prompt lengths, comma separated")
    p.add_argument("--decode-ctx", default="0,4096,18432", help="decode contexts, comma separated")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed per context")
    p.add_argument("--chunk", type=int, default=0, help="prefill chunk size (0 = one pass)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--kv-type", default=DEFAULT_KV_TYPE, choices=KV_TYPES,
                   help=f"KV cache type (default {DEFAULT_KV_TYPE}, the engine's)")
    p.add_argument("--devices", default=None,
                   help="split benchmark instead: comma-separated devices (e.g. cuda:0,cuda:1,cuda:2 or "
                        "cpu:0,cpu:1); the model is split over the first 1, 2, ... of them, each with and "
                        "without a simulated PCIe link (--link), and compared with one device. Logical "
                        "cuda:N beyond the GPUs present share the physical GPUs")
    p.add_argument("--link", default="gen1x1",
                   help="simulated link for the split benchmark: gen1x1 (250 MB/s), or a rate like "
                        "'500MB/s+20us' (default gen1x1)")
    p.add_argument("--split-prompt", type=int, default=2048,
                   help="prompt tokens for the split benchmark (default 2048)")
    p.add_argument("--experts-on", default=None, type=experts_on_arg, metavar="host|auto|N",
                   help=EXPERTS_ON_HELP + "; reports prefill's streamed bytes/s beside the link's rate "
                   "and decode's CPU expert reads beside the CPU's copy bandwidth")
    p.add_argument("--experts-link", default=None, metavar="LINK",
                   help="with --experts-on: simulate the GPU's PCIe link (engine/rig.py), e.g. gen1x1 or "
                        "gen3x4 (default: the real link)")
    p.add_argument("--experts-cap", default=None, metavar="SIZE",
                   help="with --experts-on: cap the GPU's memory at SIZE (e.g. 8GiB; engine/rig.py), as "
                        "on a card that size: with --experts-on auto the planner keeps the experts that "
                        "fit on it and puts the rest in host RAM")
    add_cpu_weights_arg(p)
    add_threads_arg(p)
    p.set_defaults(func=run)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def weight_bytes_per_token(model: Model) -> int:
    """Bytes of weights one decode step reads: every main-layer tensor, the final norm and the LM head
    (the token-embedding table only when it is the tied LM head). A routed-expert stack (E, n_out,
    n_in) counts n_experts_used of its E experts: the ones a token runs (the active bytes)."""
    cfg = model.config
    total = 0
    for name, info in model.gguf.tensors.items():
        m = re.match(r"blk\.(\d+)\.", name)
        if m:
            if int(m.group(1)) < cfg.n_layers:
                if len(info.shape) == 3 and cfg.n_experts_used:
                    total += int(info.n_bytes) // int(info.shape[0]) * int(cfg.n_experts_used)
                else:
                    total += int(info.n_bytes)
        elif name == "token_embd.weight":
            if cfg.tied_embeddings:
                total += int(info.n_bytes)
        else:
            total += int(info.n_bytes)
    return total


def matrix_params_per_token(model: Model) -> int:
    """Multiply-adds per prompt token in the main layers' matrices (no embedding, no LM head)."""
    cfg = model.config
    total = 0
    for name, info in model.gguf.tensors.items():
        m = re.match(r"blk\.(\d+)\.", name)
        if m and int(m.group(1)) < cfg.n_layers and len(info.shape) >= 2:
            n = int(np.prod(info.shape))
            if len(info.shape) == 3:  # experts: only the used ones run per token
                n = n // info.shape[0] * max(1, int(cfg.n_experts_used or 1))
            total += n
    return total


def _timed(fn: Callable[[], object], backend: Backend) -> float:
    backend.synchronize()
    t = time.perf_counter()
    fn()
    backend.synchronize()
    return time.perf_counter() - t


def cpu_ceilings(seconds: float = 0.3, copy_mib: int = 256) -> dict[str, float]:
    """The CPU's ceilings as NumPy reaches them: copy bandwidth (GB/s, bytes read + written, of a
    `copy_mib` MiB float32 array, larger than any cache) and the fp32 FMA rate of a 1024^3 matrix
    product in BLAS (TFLOP/s, with the BLAS threads in force). Best of repeats within ~`seconds`."""
    n = copy_mib * 2**20 // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((1024, 1024), dtype=np.float32)

    def best(fn: Callable[[], object]) -> float:
        fn()  # warm: page faults, BLAS threads starting
        times: list[float] = []
        deadline = time.perf_counter() + seconds / 2
        while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 20):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    copy_s = best(lambda: np.copyto(dst, src))
    fma_s = best(lambda: a @ b)
    return {"copy_gbs": 2 * src.nbytes / copy_s / 1e9, "fma_tflops": 2 * 1024**3 / fma_s / 1e12}


def device_ceilings(backend: Backend) -> dict[str, float]:
    """The ceilings of the backend's device (see cpu_ceilings and CupyBackend.measure_ceilings)."""
    if backend.device.startswith("cpu"):
        return cpu_ceilings()
    from ..backends.cupy_backend import CupyBackend  # local import: CuPy is optional

    assert isinstance(backend, CupyBackend)
    return {k: float(v) for k, v in backend.measure_ceilings().items()}


def kernel_rates(model: Model, backend: Backend, ceil: dict[str, float]) -> dict[str, Any]:
    """GEMM (T=4096) and GEMV (T=1) on the first layer's FFN up-projection, vs the ceilings."""
    w = None
    for ws in model.weights.values():
        for name, wt in ws.items():
            if name.endswith("ffn_up.weight"):
                w = wt
                break
        if w is not None:
            break
    if w is None:
        return {}
    R, K = w.shape[-2], w.shape[-1]
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"weight": f"{w.name} {w.type_name} {R}x{K}"}
    xg = backend.asarray(rng.standard_normal((4096, K)).astype(np.float32))
    x1 = backend.asarray(rng.standard_normal((1, K)).astype(np.float32))
    gpu = None
    if not backend.device.startswith("cpu"):
        from ..backends.cupy_backend import CupyBackend  # local import: CuPy is optional

        assert isinstance(backend, CupyBackend)
        gpu = backend
    if gpu is not None:  # GPU time without Python launch overhead
        t = gpu.time_matmul(xg, w, 5)
    else:
        backend.matmul(xg, w)
        t = min(_timed(lambda: backend.matmul(xg, w), backend) for _ in range(3))
    out["gemm_tops"] = 2 * 4096 * R * K / t / 1e12
    reps = 50
    if gpu is not None:
        t = gpu.time_matmul(x1, w, reps)
    else:
        backend.matmul(x1, w)
        t = _timed(lambda: [backend.matmul(x1, w) for _ in range(reps)], backend) / reps
    out["gemv_gbs"] = int(w.nbytes) / t / 1e9
    if ceil.get("dp4a_tops"):
        out["gemm_vs_dp4a"] = out["gemm_tops"] / ceil["dp4a_tops"]
    elif ceil.get("fma_tflops"):
        out["gemm_vs_fma"] = out["gemm_tops"] / ceil["fma_tflops"]
    if ceil.get("copy_gbs"):
        out["gemv_vs_copy"] = out["gemv_gbs"] / ceil["copy_gbs"]
    return out


def _prefill_seconds(model: Model, backend: Backend, ids: list[int], chunk: int) -> float:
    """Seconds of one prefill of `ids` into a fresh session."""
    s = model.new_session(len(ids) + 8)
    dt = _timed(lambda: s.prefill(ids, chunk=chunk or len(ids)), backend)
    s.close()
    return dt


def _decode_seconds(model: Model, backend: Backend, ids: list[int], steps: int, chunk: int,
                    pool: ExpertPool | None = None) -> tuple[float, dict[str, float]]:
    """Seconds of `steps` greedy decode steps after a prefill of `ids` and one untimed step, and what
    the expert pool's counters (`ExpertPool.profile`) moved by over them (empty without a pool). Each
    step returns its largest logit only (top=1) and is launched behind the one before it, which feeds it
    its pick on the device, as a greedy generation's steps are (engine/generation.py; where that is not
    possible, after the host has the pick)."""
    s = model.new_session(len(ids) + steps + 8)
    logits = s.prefill(ids, chunk=chunk or len(ids))
    assert logits is not None

    def greedy(token: int, n: int) -> TopLogits:
        """n greedy steps from `token`, each launched behind the one before it (Session.launch_next)
        where the device allows, else after the host has the pick; the last step's top logit."""
        launched = s.launch_step(token, top=1, pick=GREEDY_PICK)
        for _ in range(n - 1):
            ahead = s.launch_next(launched, top=1, pick=GREEDY_PICK)
            out = launched.result()
            assert isinstance(out, TopLogits)
            launched = ahead if ahead is not None else s.launch_step(int(out.ids[0, 0]), top=1, pick=GREEDY_PICK)
        out = launched.result()
        assert isinstance(out, TopLogits)
        return out

    # two steps outside the timing, the second chained: each captures its graph (CupyBackend keeps two
    # a sequence, so that a chained step never rewrites the buffers of the one before it)
    top = greedy(int(np.argmax(logits)), 2)
    before = pool.profile() if pool is not None else {}

    def decode() -> None:
        nonlocal top
        top = greedy(int(top.ids[0, 0]), steps)

    dt = _timed(decode, backend)
    moved = {key: v - before[key] for key, v in pool.profile().items()} if pool is not None else {}
    s.close()
    return dt, moved


def _with_ceiling(row: dict[str, Any], ceiling: float | None) -> dict[str, Any]:
    """The row with its ceiling (tokens/s) and the measured share of it, if the ceiling is known."""
    if ceiling:
        row["ceiling_tokens_per_s"] = ceiling
        row["ratio"] = row["tokens_per_s"] / ceiling
    return row


def bench(model: Model, *, prefill: Sequence[int] = (512, 2048, 8192, 18432),
          decode_ctx: Sequence[int] = (0, 4096, 18432), decode_tokens: int = 32, chunk: int = 0,
          log: Callable[[str], None] | None = None) -> dict[str, Any]:
    proxy = model.backends.get("global") or next(iter(model.backends.values()))
    backend = _device_backend(proxy)
    say = log or (lambda s: None)
    say("measuring the device's ceilings ...")
    ceil = device_ceilings(backend)
    wbytes = weight_bytes_per_token(model)
    params = matrix_params_per_token(model)
    res: dict[str, Any] = {"model": str(model.path), "device": backend.device, "backend": repr(backend),
                           "weight_bytes_per_token": wbytes, "int8_ops_per_token": 2 * params,
                           "ceilings": ceil, "prefill": [], "decode": []}
    say(format_ceilings(ceil))
    res["kernels"] = kernel_rates(model, backend, ceil)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    # warm-up: compiles every kernel the model uses
    s = model.new_session(80)
    s.prefill(list(rng.integers(0, min(vocab, 50000), 70)))
    s.step(1)
    s.close()
    # the matrix-product ceiling: DP4A on a GPU (int8 weights), the fp32 FMA rate on the CPU
    ops_rate = ceil.get("dp4a_tops") or ceil.get("fma_tflops")
    prefill_ceiling = ops_rate * 1e12 / (2 * params) if ops_rate else None
    decode_ceiling = ceil["copy_gbs"] * 1e9 / wbytes if ceil.get("copy_gbs") else None
    streams = _expert_streams(model)
    for n in prefill:
        ids = [int(t) for t in rng.integers(0, min(vocab, 50000), n)]
        moved = sum(st.streamed_bytes for st in streams)
        dt = _prefill_seconds(model, backend, ids, chunk)
        row = _with_ceiling({"tokens": n, "seconds": dt, "tokens_per_s": n / dt}, prefill_ceiling)
        if streams:  # host-RAM experts streamed to the GPU: bytes over the link per second
            row["streamed_bytes_per_s"] = (sum(st.streamed_bytes for st in streams) - moved) / dt
        res["prefill"].append(row)
        say(f"prefill {n} tokens: {row['tokens_per_s']:,.1f} tok/s")
    pool = proxy.expert_pool if isinstance(proxy, ExpertsApart) else None
    for ctx in decode_ctx:
        ids = [int(t) for t in rng.integers(0, min(vocab, 50000), max(ctx, 1))]
        dt, moved = _decode_seconds(model, backend, ids, decode_tokens, chunk, pool)
        row = {"context": ctx, "tokens": decode_tokens, "tokens_per_s": decode_tokens / dt}
        if moved.get("requests"):  # the expert pool's own account of the steps (its leader's clock)
            row["pool_ms_per_token"] = {key: 1e3 * moved[key] / decode_tokens for key in PROF_STEPS + GPU_STEPS}
            row["pool_requests_per_token"] = moved["requests"] / decode_tokens
            row["pool_gpu_calls_per_token"] = moved["gpu_calls"] / decode_tokens
        row = _with_ceiling(row, decode_ceiling)
        res["decode"].append(row)
        say(f"decode at context {ctx}: {row['tokens_per_s']:,.1f} tok/s")
    if res["decode"] and len(res["decode"]) > 1:
        res["long_vs_short_decode"] = res["decode"][-1]["tokens_per_s"] / res["decode"][0]["tokens_per_s"]
    if isinstance(proxy, ExpertsApart):
        res["host_experts"] = host_expert_rates(model, proxy, res)
    if not backend.device.startswith("cpu"):
        from ..backends.cupy_backend import CupyBackend  # local import: CuPy is optional

        assert isinstance(backend, CupyBackend)
        res["peak_vram_bytes"] = backend.peak_memory()
    return res


def _device_backend(backend: Any) -> Backend:
    """The device's own backend under an experts proxy (engine/experts.py) and a rig's link proxy:
    ceilings and kernel rates are the card's, not the link's."""
    if isinstance(backend, ExpertsApart):
        backend = backend.inner
    return backend.inner if isinstance(backend, RigBackend) else backend


def _expert_streams(model: Model) -> list[Any]:
    """The expert streams of the model's devices (host-RAM experts streamed to a GPU for prefill)."""
    proxies = {id(b): b for b in model.backends.values() if isinstance(b, ExpertsApart)}.values()
    return [p.stream for p in proxies if p.stream is not None]


def host_expert_rates(model: Model, proxy: ExpertsApart, res: dict[str, Any]) -> dict[str, Any]:
    """Routed experts in host RAM: prefill streams them over the link (bytes per second beside the
    link's rate: a rig's simulated link, else the card's own as measured at load, which also sets
    the stream threshold); decode runs a token's experts on the CPU (the active expert bytes it reads
    per second, beside the CPU's copy bandwidth measured now)."""
    cfg = model.config
    host = {p: ws for p, ws in model.weights.items()
            if p.endswith(".experts") and model.device_plan[p].startswith("cpu")}
    frac = cfg.n_experts_used / cfg.n_experts if cfg.n_experts else 0.0
    active = sum(int(w.info.n_bytes) for ws in host.values() for w in ws.values() if w.role == "experts") * frac
    cpu = cpu_ceilings()
    out: dict[str, Any] = {"layers": len(host), "link": proxy.link.name, "link_bytes_per_s": proxy.link.bandwidth,
                           "stream_min_tokens": None, "expert_bytes_per_token": active,
                           "cpu_copy_gbs": cpu["copy_gbs"], "prefill": [], "decode": []}
    if proxy.stream is not None and host:
        first = min(int(p.split(".")[1]) for p in host)
        out["stream_min_tokens"] = proxy.stream_min_tokens(first, cfg.n_experts_used)
    for r in res["prefill"]:
        if "streamed_bytes_per_s" in r:
            out["prefill"].append({"tokens": r["tokens"], "streamed_bytes_per_s": r["streamed_bytes_per_s"],
                                   "vs_link": r["streamed_bytes_per_s"] / proxy.link.bandwidth})
    for r in res["decode"]:
        gbs = active * r["tokens_per_s"] / 1e9
        row = {"context": r["context"], "cpu_expert_gbs": gbs, "vs_cpu_copy": gbs / cpu["copy_gbs"]}
        if "pool_ms_per_token" in r:
            for key in ("pool_ms_per_token", "pool_requests_per_token", "pool_gpu_calls_per_token"):
                row[key] = r[key]
        out["decode"].append(row)
    return out


def format_pool_steps(ms: dict[str, float], requests: float, gpu_calls: float) -> str:
    """Where a decode token's time went by the expert pool's clock (ms a token), and by the GPU's
    stamps of its calls where it posted them (kernels/expert_call.cu)."""
    served = sum(ms[k] for k in SERVED_STEPS)
    line = (f"expert pool, ms a token over {requests:.0f} calls: serving {served:.2f} (gate/up {ms['gate_up']:.2f}, "
            f"its slowest-thread wait {ms['gate_up'] - ms['gate_up_own']:.2f}; SwiGLU {ms['swiglu']:.2f}; "
            f"down {ms['down']:.2f}, wait {ms['down'] - ms['down_own']:.2f}; setup + answer "
            f"{ms['setup'] + ms['tail']:.2f}); between calls (the GPU's part) {ms['wait']:.2f}")
    if gpu_calls:
        line += (f"\n    the GPU's clock over {gpu_calls:.0f} calls a token: rows posted {ms['gpu_post']:.2f}, "
                 f"waiting for the answer {ms['gpu_wait']:.2f}, rows read back {ms['gpu_read']:.2f}, "
                 f"its work between calls {ms['gpu_between']:.2f}")
    return line


def format_ceilings(c: dict[str, float]) -> str:
    """One line naming the ceilings measured (or saying there are none)."""
    parts = []
    if "copy_gbs" in c:
        parts.append(f"copy {c['copy_gbs']:,.1f} GB/s")
    if "dp4a_tops" in c:
        parts.append(f"DP4A {c['dp4a_tops']:.1f} TOPS")
    if "fma_tflops" in c:
        fma = c["fma_tflops"]
        parts.append(f"FP32 FMA {fma:.1f} TFLOP/s" if fma >= 1 else f"FP32 FMA {fma * 1e3:,.0f} GFLOP/s")
    if not parts:
        return "ceilings: none measured for this device (the table shows speeds only)"
    return "ceilings (measured now): " + ", ".join(parts)


def _si(n: float) -> str:
    """n with a decimal prefix: 9.78 G, 19.7 M, 512 ."""
    for prefix, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {prefix}"
    return f"{n:.0f} "


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(res: dict[str, Any]) -> str:
    c = res.get("ceilings", {})
    lines = [f"model: {res['model']}", f"backend: {res['backend']}, KV cache {res.get('kv_type', '?')}",
             format_ceilings(c),
             f"weights read per decode token: {_si(res['weight_bytes_per_token'])}B; "
             f"matrix ops per prompt token: {_si(res['int8_ops_per_token'])}"]
    k = res.get("kernels") or {}
    if k:
        gemm = f"GEMM T=4096 {k['gemm_tops']:.3f} TOPS"
        if "gemm_vs_dp4a" in k:
            gemm += f" ({k['gemm_vs_dp4a']:.0%} of DP4A)"
        elif "gemm_vs_fma" in k:
            gemm += f" ({k['gemm_vs_fma']:.0%} of FP32 FMA)"
        gemv = f"GEMV {k['gemv_gbs']:,.1f} GB/s"
        if "gemv_vs_copy" in k:
            gemv += f" ({k['gemv_vs_copy']:.0%} of copy)"
        lines.append(f"kernels on {k['weight']}: {gemm}, {gemv}")
    lines.append(f"{'test':<22}{'tokens/s':>12}{'ceiling':>12}{'ratio':>8}")
    for label, r in [(f"prefill {r['tokens']}", r) for r in res["prefill"]] + \
                    [(f"decode @ {r['context']}", r) for r in res["decode"]]:
        lines.append(f"{label:<22}{r['tokens_per_s']:>12,.1f}"
                     f"{_cell(r.get('ceiling_tokens_per_s'), ',.0f'):>12}{_cell(r.get('ratio'), '.0%'):>8}")
    if "long_vs_short_decode" in res:
        lines.append(f"longest-context decode / short-context decode: {res['long_vs_short_decode']:.0%}")
    if "peak_vram_bytes" in res:
        lines.append(f"peak VRAM: {res['peak_vram_bytes'] / 2**30:.2f} GiB")
    h = res.get("host_experts")
    if h:
        how = (f"chunks of {h['stream_min_tokens']} tokens or more are streamed to the GPU"
               if h["stream_min_tokens"] is not None else "never streamed: their layers are not on a GPU")
        lines.append(f"routed experts of {h['layers']} layers in host RAM (link {h['link']}, "
                     f"{h['link_bytes_per_s'] / 1e9:.2f} GB/s; {how})")
        for r in h["prefill"]:
            lines.append(f"  prefill {r['tokens']}: streamed {r['streamed_bytes_per_s'] / 1e9:.2f} GB/s "
                         f"({r['vs_link']:.0%} of the link)")
        for r in h["decode"]:
            lines.append(f"  decode @ {r['context']}: CPU experts read {r['cpu_expert_gbs']:.2f} GB/s "
                         f"({r['vs_cpu_copy']:.0%} of the CPU's {h['cpu_copy_gbs']:.1f} GB/s copy)")
            if "pool_ms_per_token" in r:
                lines.append("    " + format_pool_steps(r["pool_ms_per_token"], r["pool_requests_per_token"],
                                                        r["pool_gpu_calls_per_token"]))
    return "\n".join(lines)


def check_devices(args: argparse.Namespace) -> None:
    """Open the device(s) the benchmark will run on, before anything is synthesized: a machine
    without the GPU asked for fails here in a second, not after writing gigabytes."""
    if args.devices:
        names = [d.strip() for d in args.devices.split(",") if d.strip()]
        if not names:
            raise MinecartError("--devices needs at least one device, e.g. cuda:0,cuda:1")
        # logical cuda:N beyond the GPUs present share the physical ones: opening GPU 0 is the check
        kinds = {("cuda:0" if n.split("@")[0].startswith("cuda") else "cpu:0") for n in names}
    else:
        kinds = {args.device}
    for device in sorted(kinds):
        try:
            make_backend(device)
        except DeviceError as exc:
            # the engine's hint names `--devices` (run, chat, serve); here that is the split benchmark
            raise DeviceError(f"cannot benchmark on {device}: {exc}. To benchmark the CPU instead: "
                              "--device cpu:0") from exc


def quant_list(text: str) -> list[str]:
    """`--quant q8_0,q4_k` -> ["q8_0", "q4_k"], each checked against the types synth can write."""
    from ..quant_mix import QUANT_NAMES

    quants = list(dict.fromkeys(q.strip().lower() for q in text.split(",") if q.strip()))
    unknown = [q for q in quants if q not in QUANT_NAMES]
    if unknown or not quants:
        raise MinecartError(f"unknown --quant {', '.join(unknown) or repr(text)}; choose among {', '.join(QUANT_NAMES)}")
    return quants


def run(args: argparse.Namespace) -> int:
    from ..model import load_model

    quants = quant_list(args.quant)
    if args.compare_gguf:
        return run_compare(args, load_model)
    if args.peer_bench:
        raise MinecartError("--peer-bench goes with --compare-gguf FILE")
    if not args.model and not args.shape:
        raise MinecartError("give a GGUF file or --shape NAME (e.g. --shape qwen3.5-9b --quant q8_0)")
    if len(quants) > 1 and not args.shape:
        raise MinecartError("several --quant types need --shape (a GGUF file has its own types)")
    check_devices(args)
    results = []
    for q in quants:  # one after the other, each file deleted after its run unless --workdir keeps it
        res = _run_quant(argparse.Namespace(**{**vars(args), "quant": q}), load_model)
        if res is not None:
            results.append(res)
    if len(results) == 1:
        print(json.dumps(results[0], indent=1) if args.json else format_table(results[0]))
    elif results:
        print(json.dumps({"runs": results}, indent=1) if args.json
              else "\n\n".join([*map(format_table, results), format_quant_summary(results)]))
    return 0


def run_compare(args: argparse.Namespace, load_model: Callable[..., Model]) -> int:
    """--compare-gguf FILE [--peer-bench BIN]: FILE at the peer table's contexts, ours then the peer's."""
    from . import bench_compare as bc

    if args.model or args.shape or args.devices:
        raise MinecartError("--compare-gguf FILE benchmarks that file alone: leave out the model argument, "
                            "--shape and --devices")
    path = Path(args.compare_gguf)
    if not path.is_file():
        raise MinecartError(f"--compare-gguf {path}: no such file")
    check_devices(args)
    sub = argparse.Namespace(**{**vars(args), "prefill": ",".join(map(str, bc.PEER_PREFILL)),
                                "decode_ctx": ",".join(map(str, bc.PEER_DECODE_CTX)),
                                "decode_tokens": bc.PEER_DECODE_TOKENS})
    res = _measure(path, sub, load_model)
    peer = None
    if args.peer_bench:
        shape = (bc.PEER_PREFILL, bc.PEER_DECODE_CTX, bc.PEER_DECODE_TOKENS)
        print(f"running {' '.join(bc.peer_command(args.peer_bench, path, *shape))} ...", file=sys.stderr,
              flush=True)
        peer = bc.run_peer(args.peer_bench, path, args.device, *shape)
    rows = bc.compare_rows(res, peer)
    if args.json:
        res["compare"] = {"rows": rows, "peer": None if peer is None else
                          {"label": peer.label, "prefill": peer.prefill, "decode": peer.decode}}
        print(json.dumps(res, indent=1))
    else:
        print(bc.format_compare(res, rows, peer))
    return 0


def format_quant_summary(results: list[dict[str, Any]]) -> str:
    """One line per quant type of a `--quant a,b,c` run: every test's tokens/s and share of its ceiling."""
    tests = [f"prefill {r['tokens']}" for r in results[0]["prefill"]] + \
            [f"decode @ {r['context']}" for r in results[0]["decode"]]
    lines = ["quant types compared (tokens/s, share of the ceiling):",
             f"{'file':<34}" + "".join(f"{t:>20}" for t in tests)]
    for res in results:
        cells = []
        for r in res["prefill"] + res["decode"]:
            ratio = f" ({r['ratio']:.0%})" if r.get("ratio") is not None else ""
            cells.append(f"{r['tokens_per_s']:,.1f}{ratio}")
        lines.append(f"{Path(res['model']).name:<34}" + "".join(f"{c:>20}" for c in cells))
    return "\n".join(lines)


def _run_quant(args: argparse.Namespace, load_model: Callable[..., Model]) -> dict[str, Any] | None:
    """One benchmark of the file or --shape (args.quant is one type): its result, or None for the split
    benchmark (which prints its own table)."""
    made_dir: Path | None = None  # a temporary folder this run made (deleted at the end)
    made_file: Path | None = None  # a file this run synthesized and does not keep
    try:
        path = Path(args.model) if args.model else None
        if args.shape:
            if args.workdir:
                work = Path(args.workdir)
                work.mkdir(parents=True, exist_ok=True)
            else:
                work = made_dir = Path(tempfile.mkdtemp(prefix="minecart-bench-"))
            path = work / f"{args.shape}-{args.quant}.gguf"
            if not path.exists():
                made_file = path
                _synthesize(path, args)
            if args.workdir:
                made_file = None  # kept for the next run
        assert path is not None
        if args.devices:
            run_split(path, args)
            return None
        return _measure(path, args, load_model)
    finally:
        if made_file is not None:
            made_file.unlink(missing_ok=True)
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)


def _synthesize(path: Path, args: argparse.Namespace) -> None:
    """Write the --shape model to `path`; a partial file (error, Ctrl+C) never takes its name."""
    from ..synth import write_synthetic

    part = path.with_name(path.name + ".part")
    print(f"synthesizing {path} ...", file=sys.stderr)
    try:
        info = write_synthetic(part, args.shape, args.quant, seed=0, n_layers=args.layers)
        part.replace(path)
    finally:
        part.unlink(missing_ok=True)
    print(f"  {info['bytes'] / 1e9:.2f} GB in {info['seconds']:.1f} s", file=sys.stderr)


def _measure(path: Path, args: argparse.Namespace, load_model: Callable[..., Model]) -> dict[str, Any]:
    """Load `path`, benchmark it at args' prompt lengths and decode contexts, close it; the result."""
    t = time.perf_counter()
    if args.experts_on is not None:  # host-RAM experts, the GPU behind a simulated link if one is given
        from ..rig import Rig

        desc = args.device + (f"={args.experts_cap}" if args.experts_cap else "") + \
            (f"@{args.experts_link}" if args.experts_link else "")
        devices: Any = Rig.parse(desc) if desc != args.device else [args.device]
        model = load_model(path, devices=devices, kv_type=args.kv_type, experts=args.experts_on,
                           cpu_weights=args.cpu_weights)
    else:
        model = load_model(path, devices=[args.device], kv_type=args.kv_type, cpu_weights=args.cpu_weights)
    try:
        print(f"loaded in {time.perf_counter() - t:.1f} s", file=sys.stderr)

        def log(s: str) -> None:
            print(s, file=sys.stderr, flush=True)

        res = bench(model, prefill=_ints(args.prefill), decode_ctx=_ints(args.decode_ctx),
                    decode_tokens=args.decode_tokens, chunk=args.chunk, log=log)
    finally:
        model.close()
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res["kv_type"] = args.kv_type
    res["cpu_weights"] = args.cpu_weights
    return res


def split_configs(devices: list[str], link: str) -> list[tuple[str, str]]:
    """(label, Rig description) for 1..N devices, each without and (N > 1) with the simulated link."""
    out = []
    for n in range(1, len(devices) + 1):
        names = devices[:n]
        out.append((f"{n} device{'s' if n > 1 else ''}", ",".join(names)))
        if n > 1:
            out.append((f"{n} devices @{link}", ",".join(f"{d}@{link}" for d in names)))
    return out


def _release(backends: list[Backend]) -> None:
    """Drop what a closed model's backends still cache (captured graphs, pooled blocks), so the next
    configuration's memory is measured alone."""
    import gc

    gc.collect()
    for be in backends:
        if isinstance(be, RigBackend):  # a logical device of a rig: its GPU's own backend
            be = be.inner
        if not be.device.startswith("cpu"):  # the NumPy backend caches nothing on a device
            from ..backends.cupy_backend import CupyBackend  # local import: CuPy is optional

            assert isinstance(be, CupyBackend), f"{be!r} is not a GPU backend"
            be.release_cached()


def run_split(path: Path, args: argparse.Namespace) -> int:
    """`minecart bench --devices ...`: prefill/decode of the same model split over 1, 2, 3... devices.

    Per configuration: pipelined chunked prefill of --split-prompt random tokens (and the same chunks
    without overlap), greedy decode of --decode-tokens tokens at that context with CUDA graphs and
    with graphs off, and each device's memory estimate beside its measured use."""
    from ..model import load_model
    from ..multidevice import bench_split
    from ..rig import Rig

    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if not devices:
        raise MinecartError("--devices needs at least one device, e.g. cuda:0,cuda:1")
    gpus = 0
    if any(d.startswith("cuda") for d in devices):
        try:
            from ..devices import list_devices

            gpus = sum(1 for d in list_devices() if d.id.startswith("cuda"))
        except Exception:  # noqa: BLE001 - no NVML/CuPy: logical devices on GPU 0
            gpus = 0
    # 512-token chunks: at 250 MB/s a 4096-wide fp32 hidden state of one chunk (8 MB) is 33 ms on each
    # riser, less than a chunk's compute on either device, so the pipeline hides the link
    chunk = args.chunk or 512
    rows: list[dict[str, Any]] = []
    for label, desc in split_configs(devices, args.link):
        rig = Rig.parse(desc, physical_gpus=max(gpus, 1))
        model = load_model(path, devices=rig)
        backends = list({id(b): b for b in model.backends.values()}.values())
        try:
            r = bench_split(model, prompt_tokens=args.split_prompt, chunk=chunk,
                            decode_tokens=args.decode_tokens, sequential=model.executor.split)
        finally:
            model.close()
            del model
            _release(backends)
        rows.append({"config": label, "devices": desc, "prefill_tokens_per_s": r.prefill_tokens_per_s,
                     "no_overlap_prefill_tokens_per_s": (args.split_prompt / r.sequential_prefill_seconds
                                                         if r.sequential_prefill_seconds else None),
                     "overlap_speedup": r.overlap_speedup,
                     "decode_tokens_per_s": r.decode_tokens_per_s,
                     "decode_eager_tokens_per_s": r.decode_eager_tokens_per_s,
                     "graphed_stage_steps": r.graphed_stage_steps, "eager_stage_steps": r.eager_stage_steps,
                     "link_bytes": r.link_bytes, "segments": r.segments, "memory": r.memory})
        print(f"{label}: prefill {r.prefill_tokens_per_s:.1f} tok/s, decode {r.decode_tokens_per_s:.1f} "
              f"tok/s (graphs off {r.decode_eager_tokens_per_s:.1f})", file=sys.stderr, flush=True)
        for line in r.lines()[1:]:
            print(line, file=sys.stderr, flush=True)
    base = rows[0]
    for row in rows:
        row["prefill_vs_1"] = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
        row["decode_vs_1"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        if row["decode_eager_tokens_per_s"]:
            row["decode_eager_vs_1"] = row["decode_eager_tokens_per_s"] / base["decode_tokens_per_s"]
    if args.json:
        print(json.dumps({"model": str(path), "prompt_tokens": args.split_prompt, "chunk": chunk,
                          "decode_tokens": args.decode_tokens, "link": args.link, "physical_gpus": gpus,
                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows},
                         indent=1))
        return 0
    print(format_split_table(rows, Path(path).name, args.split_prompt, chunk))
    return 0


def format_split_table(rows: list[dict[str, Any]], name: str, prompt: int, chunk: int) -> str:
    """The split benchmark's rows as a table: prefill and decode tokens/s beside one device's."""
    lines = [f"split benchmark: {name}, prompt {prompt} tokens in chunks of {chunk}",
             f"{'config':<26}{'prefill tok/s':>14}{'vs 1':>7}{'no overlap':>12}{'decode tok/s':>14}"
             f"{'vs 1':>7}{'graphs off':>12}"]
    for row in rows:
        seq = row["no_overlap_prefill_tokens_per_s"]
        eager = row["decode_eager_tokens_per_s"]
        lines.append(f"{row['config']:<26}{row['prefill_tokens_per_s']:>14.1f}{row['prefill_vs_1']:>7.2f}"
                     f"{f'{seq:.1f}' if seq else '-':>12}{row['decode_tokens_per_s']:>14.1f}"
                     f"{row['decode_vs_1']:>7.2f}{f'{eager:.1f}' if eager else '-':>12}")
    for row in rows:
        for dev, m in row.get("memory", {}).items():
            line = (f"memory {row['config']}, {dev}: estimate {m['estimate'] / 2**30:.2f} GiB, measured "
                    f"{m['measured'] / 2**30:.2f} GiB ({m['how']}), ratio {m['ratio']:.3f}")
            if "pool_peak" in m:
                line += (f" [context {m['context'] / 2**30:.2f} + pool peak {m['pool_peak'] / 2**30:.2f} GiB; "
                         f"outside the pool {m['outside_pool'] / 2**30:.2f} GiB]")
            lines.append(line)
    return "\n".join(lines)
