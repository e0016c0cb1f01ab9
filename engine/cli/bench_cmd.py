"""`minecart bench`: prefill and decode speed of a model on one device, each beside its ceiling.

    minecart bench MODEL.gguf [--device cuda:0]
    minecart bench --shape qwen3.5-9b --quant q8_0        # synthesizes the file first (engine/synth.py)

In the same run it measures the card's ceilings (copy bandwidth, DP4A and fp32 FMA rates; see
kernels/probe.py), then:
- GEMM and GEMV kernel rates on one of the model's own FFN weights (int8 TOPS vs the DP4A ceiling,
  GB/s vs the copy ceiling);
- prefill tokens/s at 512, 2K, 8K and 18K prompt tokens (one pass), ceiling = DP4A rate / int8
  operations per token (2 x matrix weights, embedding and LM head excluded);
- decode tokens/s at context 0, 4K and 18K, ceiling = copy bandwidth / weight bytes read per token
  (every weight but the token-embedding table);
- peak VRAM.
Prints a table (or JSON with --json). Not here: any comparison with other engines (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="measure prefill/decode speed against the card's ceilings",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="GGUF file to benchmark (or use --shape)")
    p.add_argument("--shape", help="synthesize a model of this shape (e.g. qwen3.5-9b) instead of a file")
    p.add_argument("--quant", default="q8_0", help="quant type for --shape (default q8_0)")
    p.add_argument("--layers", type=int, help="keep only the first N layers of a --shape model")
    p.add_argument("--workdir", default=None, help="where --shape writes its file (default: a temp dir)")
    p.add_argument("--device", default="cuda:0", help="device to run on (default cuda:0)")
    p.add_argument("--prefill", default="512,2048,8192,18432", help="prompt lengths, comma separated")
    p.add_argument("--decode-ctx", default="0,4096,18432", help="decode contexts, comma separated")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed per context")
    p.add_argument("--chunk", type=int, default=0, help="prefill chunk size (0 = one pass)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
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
    p.set_defaults(func=run)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every main-layer tensor, the final norm and the LM head
    (the token-embedding table only when it is the tied LM head)."""
    cfg = model.config
    total = 0
    for name, info in model.gguf.tensors.items():
        m = re.match(r"blk\.(\d+)\.", name)
        if m:
            if int(m.group(1)) < cfg.n_layers:
                total += int(info.n_bytes)
        elif name == "token_embd.weight":
            if cfg.tied_embeddings:
                total += int(info.n_bytes)
        else:
            total += int(info.n_bytes)
    return total


def matrix_params_per_token(model) -> int:
    """Multiply-adds per prompt token in the main layers' matrices (no embedding, no LM head)."""
    cfg = model.config
    total = 0
    for name, info in model.gguf.tensors.items():
        m = re.match(r"blk\.(\d+)\.", name)
        if m and int(m.group(1)) < cfg.n_layers and len(info.shape) >= 2:
            n = int(np.prod(info.shape))
            if len(info.shape) == 3:  # experts: only the used ones run per token
                n = n // info.shape[0] * max(1, int(getattr(cfg, "n_experts_used", 1) or 1))
            total += n
    return total


def _timed(fn, backend) -> float:
    backend.synchronize()
    t = time.perf_counter()
    fn()
    backend.synchronize()
    return time.perf_counter() - t


def kernel_rates(model, backend, ceil: dict) -> dict:
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
    out = {"weight": f"{w.name} {w.type_name} {R}x{K}"}
    xg = backend.asarray(rng.standard_normal((4096, K)).astype(np.float32))
    x1 = backend.asarray(rng.standard_normal((1, K)).astype(np.float32))
    timer = getattr(backend, "time_matmul", None)
    if timer is not None:  # GPU time without Python launch overhead
        t = timer(xg, w, 5)
    else:
        backend.matmul(xg, w)
        t = min(_timed(lambda: backend.matmul(xg, w), backend) for _ in range(3))
    out["gemm_tops"] = 2 * 4096 * R * K / t / 1e12
    if timer is not None:
        t = timer(x1, w, 50)
    else:
        backend.matmul(x1, w)
        reps = 50
        t = _timed(lambda: [backend.matmul(x1, w) for _ in range(reps)], backend) / reps
    nbytes = getattr(w, "nbytes", R * K)
    out["gemv_gbs"] = nbytes / t / 1e9
    if ceil.get("dp4a_tops"):
        out["gemm_vs_dp4a"] = out["gemm_tops"] / ceil["dp4a_tops"]
    if ceil.get("copy_gbs"):
        out["gemv_vs_copy"] = out["gemv_gbs"] / ceil["copy_gbs"]
    return out


def _prefill_seconds(model, backend, ids, chunk) -> float:
    """Seconds of one prefill of `ids` into a fresh session."""
    s = model.new_session(len(ids) + 8)
    dt = _timed(lambda: s.prefill(ids, chunk=chunk or len(ids)), backend)
    s.close()
    return dt


def _decode_seconds(model, backend, ids, steps: int, chunk) -> float:
    """Seconds of `steps` greedy decode steps after a prefill of `ids` and one untimed step."""
    s = model.new_session(len(ids) + steps + 8)
    logits = s.prefill(ids, chunk=chunk or len(ids))
    logits = s.step(int(np.argmax(logits)))  # first step outside the timing

    def decode():
        nonlocal logits
        for _ in range(steps):
            logits = s.step(int(np.argmax(logits)))

    dt = _timed(decode, backend)
    s.close()
    return dt


def _with_ceiling(row: dict, ceiling: float | None) -> dict:
    """The row with its ceiling (tokens/s) and the measured share of it, if the ceiling is known."""
    if ceiling:
        row["ceiling_tokens_per_s"] = ceiling
        row["ratio"] = row["tokens_per_s"] / ceiling
    return row


def bench(model, *, prefill=(512, 2048, 8192, 18432), decode_ctx=(0, 4096, 18432), decode_tokens=32,
          chunk=0, log=None) -> dict:
    backend = model.backends.get("global") or next(iter(model.backends.values()))
    ceil = backend.measure_ceilings() if hasattr(backend, "measure_ceilings") else {}
    wbytes = weight_bytes_per_token(model)
    params = matrix_params_per_token(model)
    res: dict = {"model": str(model.path), "device": getattr(backend, "device", "?"),
                 "backend": repr(backend), "weight_bytes_per_token": wbytes,
                 "int8_ops_per_token": 2 * params, "ceilings": ceil, "prefill": [], "decode": []}
    say = log or (lambda s: None)
    say(f"ceilings: {ceil}")
    res["kernels"] = kernel_rates(model, backend, ceil)
    say(f"kernels: {res['kernels']}")
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    # warm-up: compiles every kernel the model uses
    s = model.new_session(80)
    s.prefill(list(rng.integers(0, min(vocab, 50000), 70)))
    s.step(1)
    s.close()
    prefill_ceiling = ceil["dp4a_tops"] * 1e12 / (2 * params) if ceil.get("dp4a_tops") else None
    decode_ceiling = ceil["copy_gbs"] * 1e9 / wbytes if ceil.get("copy_gbs") else None
    for n in prefill:
        ids = list(rng.integers(0, min(vocab, 50000), n))
        dt = _prefill_seconds(model, backend, ids, chunk)
        row = _with_ceiling({"tokens": n, "seconds": dt, "tokens_per_s": n / dt}, prefill_ceiling)
        res["prefill"].append(row)
        say(f"prefill {row}")
    for ctx in decode_ctx:
        ids = list(rng.integers(0, min(vocab, 50000), max(ctx, 1)))
        dt = _decode_seconds(model, backend, ids, decode_tokens, chunk)
        row = {"context": ctx, "tokens": decode_tokens, "tokens_per_s": decode_tokens / dt}
        row = _with_ceiling(row, decode_ceiling)
        res["decode"].append(row)
        say(f"decode {row}")
    if res["decode"] and len(res["decode"]) > 1:
        res["long_vs_short_decode"] = res["decode"][-1]["tokens_per_s"] / res["decode"][0]["tokens_per_s"]
    if hasattr(backend, "peak_memory"):
        res["peak_vram_bytes"] = backend.peak_memory()
    return res


def format_table(res: dict) -> str:
    c = res.get("ceilings", {})
    lines = [f"model: {res['model']}", f"backend: {res['backend']}",
             f"ceilings (measured now): copy {c.get('copy_gbs', 0):,.0f} GB/s, DP4A {c.get('dp4a_tops', 0):.1f} TOPS, "
             f"FP32 {c.get('fma_tflops', 0):.1f} TFLOP/s",
             f"weights read per decode token: {res['weight_bytes_per_token'] / 1e9:.2f} GB; "
             f"int8 ops per prompt token: {res['int8_ops_per_token'] / 1e9:.2f} G"]
    k = res.get("kernels") or {}
    if k:
        lines.append(f"kernels on {k.get('weight')}: GEMM T=4096 {k.get('gemm_tops', 0):.1f} TOPS "
                     f"({k.get('gemm_vs_dp4a', 0):.0%} of DP4A), GEMV {k.get('gemv_gbs', 0):,.0f} GB/s "
                     f"({k.get('gemv_vs_copy', 0):.0%} of copy)")
    lines.append(f"{'test':<22}{'tokens/s':>12}{'ceiling':>12}{'ratio':>8}")
    for r in res["prefill"]:
        lines.append(f"{'prefill ' + str(r['tokens']):<22}{r['tokens_per_s']:>12,.1f}"
                     f"{r.get('ceiling_tokens_per_s', 0):>12,.0f}{r.get('ratio', 0):>8.0%}")
    for r in res["decode"]:
        lines.append(f"{'decode @ ' + str(r['context']):<22}{r['tokens_per_s']:>12,.1f}"
                     f"{r.get('ceiling_tokens_per_s', 0):>12,.0f}{r.get('ratio', 0):>8.0%}")
    if "long_vs_short_decode" in res:
        lines.append(f"longest-context decode / short-context decode: {res['long_vs_short_decode']:.0%}")
    if "peak_vram_bytes" in res:
        lines.append(f"peak VRAM: {res['peak_vram_bytes'] / 2**30:.2f} GiB")
    return "\n".join(lines)


def run(args) -> int:
    from ..errors import MinecartError
    from ..model import load_model

    if not args.model and not args.shape:
        raise MinecartError("give a GGUF file or --shape NAME (e.g. --shape qwen3.5-9b --quant q8_0)")
    tmp = None
    path = args.model
    if args.shape:
        from ..synth import write_synthetic

        work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="minecart-bench-"))
        work.mkdir(parents=True, exist_ok=True)
        path = work / f"{args.shape}-{args.quant}.gguf"
        if not path.exists():
            print(f"synthesizing {path} ...", file=sys.stderr)
            info = write_synthetic(path, args.shape, args.quant, seed=0, n_layers=args.layers)
            print(f"  {info['bytes'] / 1e9:.2f} GB in {info['seconds']:.1f} s", file=sys.stderr)
        tmp = path if not args.workdir else None
    if args.devices:
        code = run_split(path, args)
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        return code
    t = time.perf_counter()
    model = load_model(path, devices=[args.device])
    print(f"loaded in {time.perf_counter() - t:.1f} s", file=sys.stderr)

    def log(s):
        print(s, file=sys.stderr, flush=True)

    res = bench(model, prefill=_ints(args.prefill), decode_ctx=_ints(args.decode_ctx),
                decode_tokens=args.decode_tokens, chunk=args.chunk, log=log)
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(json.dumps(res, indent=1) if args.json else format_table(res))
    model.close()
    if tmp is not None:
        try:
            tmp.unlink()
        except OSError:
            pass
    return 0


def split_configs(devices: list[str], link: str) -> list[tuple[str, str]]:
    """(label, Rig description) for 1..N devices, each without and (N > 1) with the simulated link."""
    out = []
    for n in range(1, len(devices) + 1):
        names = devices[:n]
        out.append((f"{n} device{'s' if n > 1 else ''}", ",".join(names)))
        if n > 1:
            out.append((f"{n} devices @{link}", ",".join(f"{d}@{link}" for d in names)))
    return out


def _release(backends) -> None:
    """Drop what a closed model's backends still cache (captured graphs, pooled blocks), so the next
    configuration's memory is measured alone."""
    import gc

    gc.collect()
    for be in backends:
        release = getattr(be, "release_cached", None)
        if release is not None:
            release()


def run_split(path, args) -> int:
    """`minecart bench --devices ...`: prefill/decode of the same model split over 1, 2, 3... devices.

    Per configuration: pipelined chunked prefill of --split-prompt random tokens (and the same chunks
    without overlap), greedy decode of --decode-tokens tokens at that context with CUDA graphs and
    with graphs off, and each device's memory estimate beside its measured use."""
    from ..errors import MinecartError
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

            gpus = sum(1 for d in list_devices() if str(getattr(d, "id", "")).startswith("cuda"))
        except Exception:  # noqa: BLE001 - no NVML/CuPy: logical devices on GPU 0
            gpus = 0
    # 512-token chunks: at 250 MB/s a 4096-wide fp32 hidden state of one chunk (8 MB) is 33 ms on each
    # riser, less than a chunk's compute on either device, so the pipeline hides the link
    chunk = args.chunk or 512
    rows = []
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


def format_split_table(rows: list[dict], name: str, prompt: int, chunk: int) -> str:
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
