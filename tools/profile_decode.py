"""Where one decode step's time goes on a GPU (9B shape by default): wall time per Session.step, GPU
time of the replayed CUDA graph alone, and (under Nsight Compute, `ncu`) every kernel of one eager
step. Run on the GPU machine from the repo root with minecart importable:

    python3 tools/profile_decode.py [--layers N] [--json OUT]
    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python3 tools/profile_decode.py --ncu > kernels.csv

With --ncu the script runs one eager decode step between cudaProfilerStart/Stop, so only that step's
kernels are measured; without it, it prints the timings and writes them as JSON.
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
    be = model.backends["global"]
    s = model.new_session(4096)
    logits = s.prefill(list(range(100, 164)))
    for _ in range(3):
        logits = s.step(int(np.argmax(logits)))
    if args.batch > 1:
        if args.ncu:
            _profile_batch(model, args.batch)
        else:
            _time_batch(model, args.batch, args.json)
        return
    if args.ncu:
        be.use_graphs = False
        s.step(int(np.argmax(logits)))  # eager once more (compiles anything new)
        cp.cuda.runtime.deviceSynchronize()
        cp.cuda.profiler.start()
        s.step(int(np.argmax(logits)))
        cp.cuda.runtime.deviceSynchronize()
        cp.cuda.profiler.stop()
        return
    n = 48
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        logits = s.step(int(np.argmax(logits)))
    wall = (time.perf_counter() - t0) / n
    res = {"wall_ms_per_step": wall * 1e3, "graphs": len(be._graphs)}
    rec = next(iter(be._graphs.values()), None)
    if rec is not None:
        res["graph_gpu_ms_per_step"] = _graph_gpu_ms(rec, n)
        try:
            res["graph_nodes"] = len(rec.graph.get_nodes()) if hasattr(rec.graph, "get_nodes") else None
        except Exception:  # noqa: BLE001
            res["graph_nodes"] = None
    # host-side pieces of a step
    t0 = time.perf_counter()
    for _ in range(n):
        np.argmax(logits)
    res["host_argmax_ms"] = (time.perf_counter() - t0) / n * 1e3
    _emit(res, args.json)


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
