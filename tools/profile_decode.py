"""Where one decode step's time goes on a GPU (9B shape by default): wall time per Session.step, GPU
time of the replayed CUDA graph alone, and (under Nsight Compute, `ncu`) every kernel of one eager
step. Run on the GPU machine from the repo root with minecart importable:

    python3 tools/profile_decode.py [--layers N] [--json OUT]
    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python3 tools/profile_decode.py --ncu > kernels.csv

With --ncu the script runs one eager decode step between cudaProfilerStart/Stop, so only that step's
kernels are measured; without it, it prints the timings and writes them as JSON.

    python3 tools/profile_decode.py --ablate [--quant q4_k] [--json OUT]

measures what each group of kernels costs inside the replayed graph, where Nsight Compute's per-kernel
times (one eager step, each kernel alone) do not say: the step is captured again with one group's
backend ops replaced by stubs that launch nothing (they return zeros of the right shape, with their
q8_1 blocks published so that no quantize launch takes their place) and its graph's GPU time is taken
against the whole step's. The outputs are garbage; only the timings mean anything.

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python3 tools/profile_decode.py --prefill 4096 --ncu > prefill.csv

does the same for one prefill of that many tokens (after one prefill of the same length that compiles
and warms everything); without --ncu it prints that prefill's wall time and tokens/s, best of three.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3.5-9b")
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--path", default=None)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--batch", type=int, default=1,
                    help="a batched step of this many sequences instead: with --ncu one eager step's "
                         "kernels, without it the graphed step's wall time against its GPU time")
    ap.add_argument("--json", default=None)
    ap.add_argument("--summarize", default=None, help="an ncu --csv file: print time per kernel name")
    ap.add_argument("--ablate", action="store_true",
                    help="the graphed step's GPU time with each group of kernels stubbed out, against the whole")
    ap.add_argument("--prefill", type=int, default=0,
                    help="one prefill of this many tokens instead of a decode step (with --ncu: its kernels)")
    ap.add_argument("--context", type=int, default=64,
                    help="tokens prefilled before the measured steps (single-sequence modes; e.g. 16384 for "
                         "the long-context step)")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    import cupy as cp
    from minecart.engine.model import load_model
    from minecart.engine.synth import write_synthetic

    path = args.path or f"/tmp/bench/{args.shape}-{args.quant}{f'-L{args.layers}' if args.layers else ''}.gguf"
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_synthetic(path, args.shape, args.quant, n_layers=args.layers)
    model = load_model(path, devices=["cuda:0"])
    if args.ablate:
        _ablate(model, args.context, args.json)
        return
    if args.prefill:
        _prefill(model, args.prefill, args.ncu, args.json)
        return
    if args.batch > 1:
        if args.ncu:
            _profile_batch(model, args.batch)
        else:
            _time_batch(model, args.batch, args.json)
        return
    be = model.backends["global"]
    s, tok = _prefilled(model, args.context)
    if args.ncu:
        be.use_graphs = False
        s.step(tok)  # eager once more (compiles anything new)
        cp.cuda.runtime.deviceSynchronize()
        cp.cuda.profiler.start()
        s.step(tok)
        cp.cuda.runtime.deviceSynchronize()
        cp.cuda.profiler.stop()
        return
    n = 48
    gpu, wall = _step_gpu_ms(model, s, tok, n)
    res = {"context": args.context, "wall_ms_per_step": wall, "graph_gpu_ms_per_step": gpu,
           "graphs": len(be._graphs)}
    rec = next(iter(be._graphs.values()), None)
    if rec is not None:
        try:
            res["graph_nodes"] = len(rec.graph.get_nodes()) if hasattr(rec.graph, "get_nodes") else None
        except Exception:  # noqa: BLE001
            res["graph_nodes"] = None
    logits = np.zeros(model.config.vocab_size, np.float32)
    t0 = time.perf_counter()
    for _ in range(n):
        np.argmax(logits)
    res["host_argmax_ms"] = (time.perf_counter() - t0) / n * 1e3  # the host-side piece of a step
    _emit(res, args.json)


def _prefilled(model, context: int):
    """(a session with `context` tokens prefilled and room for the measured steps after them, the token
    it steps with)."""
    s = model.new_session(max(1024, context + 1024))
    logits = s.prefill([100 + i % 1000 for i in range(context)])
    return s, int(np.argmax(logits))


def _emit(res: dict, json_path: str | None) -> None:
    """Print the timings, and write them as JSON to json_path when given."""
    print(json.dumps(res, indent=1))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)


def _graph_gpu_ms(rec, n: int) -> float:
    """GPU ms per replay of a captured step (its inputs as last written: fine for timing)."""
    import cupy as cp

    stream = rec.cap.stream
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(n):
        rec.graph.launch(stream)
    stop.record(stream)
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / n


def _batch_states(model, batch: int) -> tuple[list, list[int]]:
    """(the state lists, next positions) of `batch` sessions, each prefilled with its own 64 tokens."""
    sessions = [model.new_session(1024) for _ in range(batch)]
    for b, s in enumerate(sessions):
        s.prefill(list(range(100 + b, 164 + b)))
    return [s.states for s in sessions], [64] * batch


def _prefill(model, n: int, ncu: bool, json_path: str | None) -> None:
    """One prefill of n tokens from an empty context: under Nsight Compute, between cudaProfilerStart/Stop
    after a warm-up prefill of the same length; otherwise its wall time, best of three."""
    import cupy as cp

    tokens = [100 + i % 1000 for i in range(n)]
    walls = []
    for i in range(2 if ncu else 4):
        s = model.new_session(n + 16)
        cp.cuda.runtime.deviceSynchronize()
        if ncu and i == 1:
            cp.cuda.profiler.start()
        t0 = time.perf_counter()
        s.prefill(tokens, chunk=n)  # one pass, as `minecart bench` times it
        cp.cuda.runtime.deviceSynchronize()
        walls.append(time.perf_counter() - t0)
        if ncu and i == 1:
            cp.cuda.profiler.stop()
        del s
    if not ncu:
        best = min(walls[1:])
        _emit({"prefill_tokens": n, "wall_ms": best * 1e3, "tokens_per_s": n / best}, json_path)


def _profile_batch(model, batch: int) -> None:
    """One eager batched decode step of `batch` sequences (Executor.forward_batch, the scheduler's call)
    between cudaProfilerStart/Stop."""
    import cupy as cp

    states, pos = _batch_states(model, batch)
    ex = model.executor
    ex.use_graphs = False
    for _ in range(2):  # compiles anything new
        ex.forward_batch([[7]] * batch, states, [np.array([p]) for p in pos])
        pos = [p + 1 for p in pos]
    cp.cuda.runtime.deviceSynchronize()
    cp.cuda.profiler.start()
    ex.forward_batch([[7]] * batch, states, [np.array([p]) for p in pos])
    cp.cuda.runtime.deviceSynchronize()
    cp.cuda.profiler.stop()


def _time_batch(model, batch: int, json_path: str | None) -> None:
    """The graphed batched decode step (Executor.forward_batch as the scheduler calls it): wall ms a step,
    the GPU ms of its graph replayed alone, and the host copy of the (B, vocab) logits it returns."""
    import cupy as cp

    states, pos = _batch_states(model, batch)
    ex = model.executor
    be = model.backends["global"]

    def step():
        nonlocal pos
        out = ex.forward_batch([[7]] * batch, states, [np.array([p]) for p in pos])
        pos = [p + 1 for p in pos]
        return out

    for _ in range(3):  # eager, capture, replay
        out = step()
    n = 24
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        out = step()
    wall = (time.perf_counter() - t0) / n
    res: dict = {"batch": batch, "wall_ms_per_step": wall * 1e3, "graph_steps": ex.batch_graph_steps,
                 "logits_mb": out.nbytes / 1e6}
    prof = cProfile.Profile()  # the host's share of a step, by function (the GPU's wait included)
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    print("\n".join(ln for ln in text.getvalue().splitlines() if ln.strip())[-3000:])
    rec = next(iter(be._batch_graphs.values()), None)
    if rec is not None:
        res["graph_gpu_ms_per_step"] = _graph_gpu_ms(rec, n)
        host = rec.cap.outputs[-1]
        t0 = time.perf_counter()
        for _ in range(n):
            np.array(host)
        res["host_logits_copy_ms"] = (time.perf_counter() - t0) / n * 1e3
    _emit(res, json_path)


# ---- --ablate: the replayed step with one group of kernels stubbed out ----------------------------------

def _stubs() -> dict[str, dict]:
    """{group: {CupyBackend method name: stub}}. Each stub launches nothing: it returns zeros of the
    op's output shape, made once per shape (a graph bakes the address in), with their q8_1 blocks
    published (ops.register_quantized) as the real fused kernels do."""
    import cupy as cp
    from minecart.kernels import ops

    made: dict = {}

    def zeros(shape, q8: bool = True):
        shape = tuple(int(n) for n in shape)
        if shape not in made:
            z = cp.zeros(shape, cp.float32)
            rows, n = (int(np.prod(shape[:-1])), shape[-1]) if len(shape) > 1 else (1, shape[0])
            qz = (cp.zeros((rows, n), cp.int8), cp.zeros((rows, max(1, n // 32)), cp.float32),
                  cp.zeros((rows, max(1, n // 32)), cp.float32))
            made[shape] = (z, qz)
        z, qz = made[shape]
        if q8 and shape[-1] % 32 == 0:
            ops.register_quantized(z.reshape(-1, shape[-1]), qz)
        return z

    def rows(w) -> int:
        return int(w.q.rows)

    return {
        "norms (rms_norm, add_rms_norm)": {
            "rms_norm": lambda self, x, w, eps: zeros(x.shape),
            "add_rms_norm": lambda self, x, delta, w, eps: (x, zeros(x.shape)),
        },
        "Gated DeltaNet decode": {
            "gdn_decode": lambda self, mixed, z, b, alpha, *a, **k: zeros(z.shape),
        },
        "attention (prep, decode, merge)": {
            "gated_attention": lambda self, qg, k, v, *a, **kw: zeros((qg.shape[0], qg.shape[1] * v.shape[2])),
        },
        "swiglu": {"swiglu": lambda self, gate, up: zeros(gate.shape)},
        "MoE blocks (routing, routed and shared experts)": {
            "moe_block": lambda self, x, *a, **k: zeros(x.shape),
        },
        "matmuls (every GEMV)": {
            "matmul": lambda self, x, w: zeros((x.shape[0], rows(w)), q8=False),
            "matmul_many": lambda self, x, ws: [zeros((x.shape[0], rows(w)), q8=False) for w in ws],
            "matmul_add": lambda self, x, w, residual: zeros((x.shape[0], rows(w)), q8=False),
        },
    }


def _step_gpu_ms(model, s, tok: int, n: int = 64) -> tuple[float, float]:
    """(GPU ms per replay of the decode graph, wall ms per Session.step) of session s stepping with tok:
    the backend's graphs are dropped first, so the step is captured again with the ops as they are now
    (only the graphs: what the capture reads, RoPE tables and the like, must already exist)."""
    import cupy as cp

    be = model.backends["global"]
    be._graphs.clear()
    for _ in range(3):  # eager, capture, replay
        s.step(tok)
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        s.step(tok)
    wall = (time.perf_counter() - t0) / n
    rec = next(r for r in be._graphs.values() if r.states is s.states)
    return _graph_gpu_ms(rec, n), wall * 1e3


def _ablate(model, context: int, json_path: str | None) -> None:
    from minecart.engine.backends.cupy_backend import CupyBackend

    s, tok = _prefilled(model, context)  # one session for every group: at 16K the prefill is seconds
    base_gpu, base_wall = _step_gpu_ms(model, s, tok)
    res: dict = {"context": context, "whole step": {"gpu_ms": base_gpu, "wall_ms": base_wall}}
    print(f"whole step: graph {base_gpu:.3f} ms GPU, {base_wall:.3f} ms wall")
    for group, stubs in _stubs().items():
        saved = {name: CupyBackend.__dict__[name] for name in stubs}
        try:
            for name, fn in stubs.items():
                setattr(CupyBackend, name, fn)
            gpu, wall = _step_gpu_ms(model, s, tok)
        finally:
            for name, fn in saved.items():
                setattr(CupyBackend, name, fn)
        res[group] = {"gpu_ms": gpu, "wall_ms": wall, "cost_ms": base_gpu - gpu,
                      "share": (base_gpu - gpu) / base_gpu}
        print(f"without {group}: graph {gpu:.3f} ms GPU ({wall:.3f} wall): the group costs "
              f"{base_gpu - gpu:.3f} ms, {100 * (base_gpu - gpu) / base_gpu:.1f}% of the step")
    _emit(res, json_path)


def summarize(csv_path: str) -> None:
    import csv
    from collections import defaultdict

    tot: dict = defaultdict(float)
    cnt: dict = defaultdict(int)
    with open(csv_path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"].split("(")[0]
        unit = row.get("Metric Unit", "ns")
        v = float(row["Metric Value"].replace(",", ""))
        v *= {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, 1e-3)
        tot[name] += v
        cnt[name] += 1
    total = sum(tot.values())
    print(f"{'kernel':<40}{'count':>7}{'total us':>12}{'mean us':>10}{'share':>8}")
    for name, v in sorted(tot.items(), key=lambda kv: -kv[1]):
        print(f"{name[:40]:<40}{cnt[name]:>7}{v:>12.1f}{v / cnt[name]:>10.2f}{v / total:>8.1%}")
    print(f"{'all':<40}{sum(cnt.values()):>7}{total:>12.1f}")


if __name__ == "__main__":
    main()
