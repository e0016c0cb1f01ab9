"""Aggregate decode tokens/s of B concurrent sequences through Executor.forward_batch (B = 1, 4, 8).

Run by hand, not by pytest: `python tests/load/bench_batch_decode.py [MODEL.gguf ...]` (default: the
demo model and the Qwen3.5 fixture). Every sequence first prefills its own prompt (different
lengths), then all decode together for --steps greedy steps; the rate is B * steps / seconds of the
decode steps only. One sequence alone runs through the same call (a batch of one is Executor.forward).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from minecart.engine.model import load_model


def decode_rate(model, batch: int, steps: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    sessions = [model.new_session(capacity=512) for _ in range(batch)]
    logits = [s.prefill(list(rng.integers(10, 1000, 8 + 5 * b))) for b, s in enumerate(sessions)]
    positions = [s.position for s in sessions]
    states = [s.states for s in sessions]
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = [[int(np.argmax(row))] for row in logits]
        out = model.executor.forward_batch(tokens, states, [np.array([p]) for p in positions])
        positions = [p + 1 for p in positions]
        logits = list(out)
    seconds = time.perf_counter() - t0
    for s in sessions:
        s.close()
    return batch * steps / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="GGUF files (default: demo model and Qwen3.5 fixture)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    ap.add_argument("--batches", default="1,4,8", help="batch sizes, comma separated")
    args = ap.parse_args()
    paths = [Path(p) for p in args.models]
    if not paths:
        from minecart.engine.demo import demo_model_path

        paths = [demo_model_path(), Path("/work/shared/fixtures/dense/qwen35-tiny-dense-f16.gguf")]
    for path in paths:
        model = load_model(path, devices=["cpu:0"])
        decode_rate(model, 1, 2)  # warm-up
        rates = {b: decode_rate(model, b, args.steps) for b in (int(x) for x in args.batches.split(","))}
        base = rates[min(rates)]
        print(f"{path.name}: " + ", ".join(f"B={b}: {r:.1f} tok/s ({r / base:.2f}x)"
                                          for b, r in rates.items()), flush=True)
        model.close()


if __name__ == "__main__":
    main()
