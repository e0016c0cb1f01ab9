"""The host's share of a pick, per call, on the CPU: what the scheduler's thread does for each row of
a batched step between two steps (engine/scheduler.py _Pass.pick_token), and what a step on the CPU
does for each row it returns (top_logits).

    python3 tools/bench_host_picks.py [--vocab 248320] [--cases 50] [--seed 0]

Prints, in microseconds a call (the median of five timings, each over every case):
- `pick_penalized`: the app's default sampler (resources/default_settings.json: top-k 40, top-p 0.9,
  min-p 0.05, repetition 1.05) from a step's 64 candidates, 8 of them in a 400-token history; the
  candidates decide the pick.
- `pick_penalized, whole row`: the same with 40-64 of the candidates in the history and a 1.3
  repetition penalty, so that they do not decide and the pick reads the whole row.
- `draw_from_top`: a top-k 20 sampled pick (temperature 0.7, top-p 0.8) from a step's 20 candidates.
- `top_logits`: the 64 largest of 1 and of 8 rows of the vocabulary (a CPU step's rows for a sampler
  that takes top-k candidates).
- `a whole row, top-k off`: a sampler without top-k (temperature 0.7, top-p 0.95) picking from a whole
  row (Sampler.pick: a request that turns top-k off reads its own row every step).

Rows are Gaussian logits (scale 3). To compare two trees, run this file with each tree's package first
on PYTHONPATH. What this is not: the scheduler's share of a step (tools/bench_generate.py
--stub-step-ms is).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from minecart.engine.sampling import (
    PenaltyView,
    PickSpec,
    Sampler,
    SamplingParams,
    TopLogits,
    draw_from_top,
    pick_penalized,
    top_logits,
)


def _us(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--cases", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    V = args.vocab

    def picks(seen_lo: int, seen_hi: int, repetition: float) -> list[tuple[TopLogits, PickSpec, PenaltyView]]:
        out = []
        for _ in range(args.cases):
            row = (rng.standard_normal(V) * 3).astype(np.float32)
            vals, ids = top_logits(row, 64)
            view = PenaltyView(rng.integers(0, V, 300).tolist())
            seen = rng.choice(ids[0], int(rng.integers(seen_lo, seen_hi + 1)), replace=False)
            view.add(rng.integers(0, V, 100 - seen.size % 100).tolist() + seen.tolist())
            spec = PickSpec(float(rng.random()), 0.7, 0.9, 0.05, top_k=40, repetition=repetition)
            out.append((TopLogits(vals, ids, fetch=lambda _r, row=row: row), spec, view))
        return out

    decided, whole = picks(8, 8, 1.05), picks(40, 64, 1.3)
    print(f"pick_penalized: {_us(lambda: [pick_penalized(*c, 64) for c in decided], len(decided)):.1f} us")
    print(f"pick_penalized, whole row: {_us(lambda: [pick_penalized(*c, 64) for c in whole], len(whole)):.1f} us")
    tops = [top_logits((rng.standard_normal(V) * 3).astype(np.float32), 20) for _ in range(args.cases)]
    spec = PickSpec(0.5, 0.7, 0.8)
    print(f"draw_from_top: {_us(lambda: [draw_from_top(v[0], i[0], spec) for v, i in tops], len(tops)):.1f} us")
    for rows in (1, 8):
        x = (rng.standard_normal((rows, V)) * 3).astype(np.float32)
        print(f"top_logits, {rows} row(s): {_us(lambda x=x: top_logits(x, 64), 1):.0f} us")
    rows = [(rng.standard_normal(V) * 3).astype(np.float32) for _ in range(max(1, args.cases // 5))]
    sampler = Sampler(SamplingParams(temperature=0.7, top_k=0, top_p=0.95, seed=args.seed))
    print(f"a whole row, top-k off: {_us(lambda: [sampler.pick(r) for r in rows], len(rows)):.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
