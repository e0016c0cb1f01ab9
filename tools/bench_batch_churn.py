"""Batched decode when the batch's members keep changing, as a server's batch does: B sequences decode
together through Executor.forward_batch (the scheduler's call), and every --every steps one of them
ends (its session closed) and a new request takes its place (a --prompt-token prompt prefilled, then it
decodes with the others). Prints the decode tokens/s of the steps (the prefills are not timed) and how
many steps replayed a batch graph (the others ran eagerly or captured one).

    python3 tools/bench_batch_churn.py MODEL.gguf [--device cuda:0] [--batch 8] [--every 4]
        [--steps 256] [--prompt 16] [--capacity 1024]

--every 0: no member changes (the steady batch of tools/bench_batch_gpu.py). What this is not: the
steady-batch benchmark with targets (tools/bench_batch_gpu.py) or a load test.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from minecart.engine import load_model


def run(model, batch: int, every: int, steps: int, prompt: int, capacity: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    vocab = int(model.config.vocab_size)
    ex = model.executor

    def start():
        s = model.new_session(capacity=capacity)
        s.prefill([int(t) for t in rng.integers(1, vocab, prompt)])
        return s

    sessions = [start() for _ in range(batch)]
    pos = [int(s.position) for s in sessions]
    graphed0 = ex.batch_graph_steps
    decode_s = 0.0
    replaced = 0
    for k in range(steps):
        if every and k and k % every == 0:  # one member ends, a new request takes its place
            i = replaced % batch
            sessions[i].close()
            sessions[i] = start()
            pos[i] = int(sessions[i].position)
            replaced += 1
        ids = [[int(t)] for t in rng.integers(1, vocab, batch)]
        t0 = time.perf_counter()
        model.executor.forward_batch(ids, [s.states for s in sessions], [np.array([p]) for p in pos], top=1)
        decode_s += time.perf_counter() - t0
        pos = [p + 1 for p in pos]
    for s in sessions:
        s.close()
    return {"batch": batch, "every": every, "steps": steps, "tok_s": batch * steps / decode_s,
            "step_ms": 1e3 * decode_s / steps, "graphed": ex.batch_graph_steps - graphed0, "replaced": replaced}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--every", default="0,16,4")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=1024)
    args = ap.parse_args(argv)
    model = load_model(args.model, devices=[args.device])
    run(model, args.batch, 0, 8, args.prompt, args.capacity, seed=1)  # warm-up: kernels, a capture
    for every in (int(e) for e in args.every.split(",")):
        r = run(model, args.batch, every, args.steps, args.prompt, args.capacity, seed=2)
        print(f"batch {r['batch']}, a member replaced every {r['every'] or '-'} steps ({r['replaced']} in all): "
              f"{r['tok_s']:.1f} tok/s, {r['step_ms']:.2f} ms a step, {r['graphed']}/{r['steps']} steps "
              "replayed a batch graph", flush=True)
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
