"""Per-token time of one MoE layer's routed experts on the CPU: the expert pool (engine/expert_pool.py,
posted from the host as a GPU would post) against the one-call kernel (cpu_experts.routed_experts, numba
parallel regions), for several thread counts, on a layer of Qwen3.6-35B-A3B's shape with random blocks.

    python3 tools/bench_expert_pool.py [--threads 8,15,16] [--tokens 300] [--experts 256]

Each token picks 8 random experts, so their blocks come from RAM as a decode token's do. The host
poster is a Python thread spinning on the answer (a GPU posts without a thread of the host's); with as
many pool threads as cores it competes with them, which the GPU never does.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from bench_moe_cpu import random_info  # tools/ is the script's folder
from minecart.engine import cpu_experts as C
from minecart.engine import expert_pool as P
from minecart.engine import quants as Q


def random_stack(rng, t: int, n_experts: int, n_out: int, n_in: int) -> C.ExpertStack:
    """Random blocks of type t (bench_moe_cpu.random_info's) as an expert stack."""
    return C.ExpertStack(random_info(rng, "exps", t, (n_experts, n_out, n_in)).raw, t, n_in)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="8,15,16")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--k", type=int, default=8)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    E, H, F, k = a.experts, a.hidden, a.ffn, a.k
    g, u, d = (random_stack(rng, Q.Q4_K, E, F, H), random_stack(rng, Q.Q4_K, E, F, H),
               random_stack(rng, Q.Q6_K, E, H, F))
    mb = (g.active_bytes(k) + u.active_bytes(k) + d.active_bytes(k)) / 1e6
    x = rng.standard_normal(H).astype(np.float32)
    tokens = []
    for _ in range(a.tokens):
        ids = rng.permutation(E)[:k].astype(np.float32)
        tokens.append(np.ascontiguousarray(np.concatenate([x, ids, rng.random(k).astype(np.float32)])[None]))
    y = np.empty((1, H), np.float32)
    print(f"layer: {E} experts, hidden {H}, expert ffn {F}, k {k}: {mb:.2f} MB of blocks a token")
    for n in (int(t) for t in a.threads.split(",")):
        pool = P.ExpertPool(n)
        e = pool.add_entry(g, u, d)
        ch = pool.channel()
        ch.post(e, tokens[0], y)
        C.routed_experts(x, tokens[0][0, H : H + k], tokens[0][0, H + k :], g, u, d, threads=n)
        for rep in range(2):
            t0 = time.perf_counter()
            for r in tokens:
                ch.post(e, r, y)
            tp = (time.perf_counter() - t0) / len(tokens)
            t0 = time.perf_counter()
            for r in tokens:
                C.routed_experts(x, r[0, H : H + k], r[0, H + k :], g, u, d, threads=n)
            tk = (time.perf_counter() - t0) / len(tokens)
            print(f"threads {pool.threads:2d} run {rep}: pool {tp * 1e6:7.1f} us ({mb / tp / 1e3:5.1f} GB/s), "
                  f"one-call kernel {tk * 1e6:7.1f} us ({mb / tk / 1e3:5.1f} GB/s)", flush=True)
        pool.close()


if __name__ == "__main__":
    main()
