"""Where a decode token's time goes when a MoE model's routed experts sit in host RAM.

    python3 tools/diag_host_decode.py MODEL.gguf --cap 8GiB --expert-threads 8,16,4 [--steps 8]

Loads MODEL on cuda:0 capped at --cap with `experts="auto"` (as `minecart bench --experts-on auto
--experts-cap` does), then for each expert thread count times --steps greedy decode steps and reports
per token: the host MoE calls (host_moe, which run as host functions inside the decode graph; the GPU
routes), of which the routed experts on the CPU integer kernels (experts), and the time between one
host call's end and the next one's start (between: the GPU's work, the copies, the host function's
start-up, and from a token's last layer to the next token's first, the rest of the step). The BLAS thread count is
the process's (set OPENBLAS_NUM_THREADS before running to compare). Prints one line per thread count.

This times the host-function path (the expert pool is turned off here: its threads run compiled code
this tool cannot wrap). For the pool, `minecart bench --experts-on ...` prints the pool's own clock of
each step and the GPU's stamps of its calls (engine/expert_pool.py ExpertPool.profile).

What this is not: a benchmark with ceilings (`minecart bench` is); a diagnostic of one setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
from minecart.engine import cpu_experts, load_model
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.experts import ExpertsApart
from minecart.engine.rig import Rig

SPENT: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            SPENT[name] += time.perf_counter() - t
            CALLS[name] += 1
    return run


def between_calls(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, also adding the time from the end of one call to the start of the next to SPENT["between"]
    (the GPU's work between two host MoE layers, the copies and the host function's start)."""
    last = [0.0]

    def run(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        if last[0]:
            SPENT["between"] += t - last[0]
        try:
            return fn(*a, **kw)
        finally:
            last[0] = time.perf_counter()
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--cap", default="8GiB")
    p.add_argument("--expert-threads", default="8")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--copy", action="store_true",
                   help="then again with the host experts copied out of the file's memory map into "
                        "process memory (is the map's page cache what slows the CPU kernels?)")
    args = p.parse_args()
    t = time.perf_counter()
    model = load_model(args.model, devices=Rig.parse(f"cuda:0={args.cap}"), experts="auto")
    print(f"loaded in {time.perf_counter() - t:.1f} s; BLAS threads env "
          f"{os.environ.get('OPENBLAS_NUM_THREADS')}; numba threads at most "
          f"{cpu_experts._numba.config.NUMBA_NUM_THREADS}", flush=True)
    proxies = [b for b in model.backends.values() if isinstance(b, ExpertsApart)]
    proxy = proxies[0]
    for p_ in proxies:
        p_.use_pool = False  # host functions, which the timers below wrap
    host = proxy.experts
    assert isinstance(host, NumpyBackend)
    cpu_experts.routed_experts = timed("experts", cpu_experts.routed_experts)
    host.moe_routed = between_calls(timed("host_moe", host.moe_routed))
    s = model.new_session(256)
    logits = s.prefill([int(i) for i in np.arange(1, 17)])
    logits = s.step(int(np.argmax(logits)))  # compiles the kernels
    try:
        print("numba threading layer:", cpu_experts._numba.threading_layer(), flush=True)
    except ValueError as exc:
        print("numba threading layer: ?", exc)
    for where in ["file map"] + (["process memory"] if args.copy else []):
        if where == "process memory":
            t = time.perf_counter()
            n = 0
            for part, ws in model.weights.items():
                if part.endswith(".experts") and model.device_plan[part].startswith("cpu"):
                    for w in ws.values():
                        if w.role == "experts":
                            host.free(w)  # the backend's expert stacks over the old bytes go too
                            w.info = dataclasses.replace(w.info, raw=np.array(w.info.raw))
                            n += w.info.raw.nbytes
            print(f"copied {n / 1e9:.1f} GB of host experts into process memory in "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
        for threads in [int(x) for x in args.expert_threads.split(",")]:
            host.expert_threads = threads
            logits = s.step(int(np.argmax(logits)))
            SPENT.clear()
            CALLS.clear()
            t = time.perf_counter()
            for _ in range(args.steps):
                logits = s.step(int(np.argmax(logits)))
            dt = (time.perf_counter() - t) / args.steps
            per = {k: 1e3 * v / args.steps for k, v in SPENT.items()}
            calls = CALLS["host_moe"] / args.steps
            print(f"[{where}] expert threads {threads}: {1 / dt:.2f} tok/s, {1e3 * dt:.1f} ms/token; host MoE "
                  f"calls/token {calls:.0f}; ms/token: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items())),
                  flush=True)
    s.close()
    model.close()


if __name__ == "__main__":
    main()
