"""Time one decode token's routed experts on the CPU: the integer kernels (engine/cpu_experts.py) against
the NumPy backend's dequantize-then-matmul reference, on one MoE layer of a real model's dimensions.

    python3 tools/bench_moe_cpu.py                      # Qwen3.6-35B-A3B layer: 256 experts, 8 used,
    python3 tools/bench_moe_cpu.py --types q4_k,q8_0    # hidden 2048, expert FFN 512; Q4_K experts
    python3 tools/bench_moe_cpu.py --threads 1,2,4 --json out.json

The expert stacks are random blocks with sane fp16 scales (the values do not matter for speed), large
enough that 8 random experts of 256 are read from RAM, not from a cache, as in a real decode. Per token:
routing (router logits, softmax, top-k), the routed-expert block on the kernels per thread count, the
same on the kernels' NumPy twins, the reference as the NumPy backend runs it (every chosen expert
dequantized to float32, then the matrix products), and the matrix products alone on experts kept in
float32 (four times the memory: 1.6 GB per layer of this shape, which is why the backend does not); bytes/s is the experts' active bytes (k experts x gate, up, down) over the time,
beside the machine's copy bandwidth measured in the same run (`minecart bench`'s cpu_ceilings: bytes
read + written per second of a 256 MiB copy), which is the decode ceiling `minecart bench` uses.

What this is not: part of CI, or a model run (docs/moe-cpu.md has the numbers and how they were taken).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
from minecart.engine import cpu_experts as C
from minecart.engine import quants as Q
from minecart.engine.backends.numpy_backend import NumpyBackend, NumpyWeight
from minecart.engine.cli.bench_cmd import cpu_ceilings
from minecart.engine.gguf_file import TensorInfo

TYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
SCALE_AT = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_info(rng: np.random.Generator, name: str, t: int, shape: tuple[int, int, int]) -> TensorInfo:
    """A TensorInfo of random blocks: uniform quants and sub-scales, fp16 scales ~ N(0, 1e-3)."""
    bv, bb = Q.BLOCK_SIZES[t]
    n_blocks = shape[0] * shape[1] * shape[2] // bv
    raw = rng.integers(0, 256, (n_blocks, bb), dtype=np.uint8)
    for at in SCALE_AT[t]:
        raw[:, at : at + 2] = (rng.standard_normal((n_blocks, 1)) * 1e-3).astype("<f2").view(np.uint8)
    raw = raw.reshape(shape[0], shape[1], -1)
    raw.flags.writeable = False  # as a file's memory map
    return TensorInfo(name, t, Q.type_name(t), shape, raw, raw.nbytes)


def best_ms(fn: Callable[[np.ndarray], object], tokens: list[np.ndarray], repeat: int) -> tuple[float, float]:
    """(median, best) milliseconds of fn over `repeat` calls, each on the next token."""
    times = []
    for i in range(repeat):
        run = tokens[i % len(tokens)]
        t = time.perf_counter()
        fn(run)
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times)), 1e3 * min(times)


def bench_type(t: int, rng: np.random.Generator, router: NumpyWeight, tokens: list[np.ndarray],
               args: argparse.Namespace, copy_gbs: float) -> list[dict]:
    """Print and return the table of one expert type."""
    E, k, H, F = args.experts, args.used, args.hidden, args.ffn
    infos = [random_info(rng, n, t, s) for n, s in (("gate", (E, F, H)), ("up", (E, F, H)), ("down", (E, H, F)))]
    gate, up, down = (NumpyWeight(i, "experts", None) for i in infos)
    stacks = [C.ExpertStack(np.asarray(i.raw), t, i.shape[2]) for i in infos]
    active = sum(s.active_bytes(k) for s in stacks)
    ref_be = NumpyBackend(int_experts=False)
    dense_router = router.dense()
    route_ms = best_ms(lambda x: C.route(x[0], dense_router, k), tokens, args.repeat)

    def kernels(x: np.ndarray, threads: int, fast: bool = True) -> np.ndarray:
        # routed as the backend's one-token path does: no BLAS call (an idle BLAS pool's spinning threads
        # would slow the kernels' own threads)
        ids, w = C.route(x[0], dense_router, k, fast=fast)
        return C.routed_experts(x[0], ids, w, stacks[0], stacks[1], stacks[2], fast=fast, threads=threads)

    rows = []
    for n in (int(s) for s in args.threads.split(",")):
        kernels(tokens[0], n)  # compile (or load from numba's cache)
        rows.append((f"int8 kernels, {n} thread{'s' if n > 1 else ''}",
                     best_ms(lambda x, n=n: kernels(x, n), tokens, args.repeat)))
    rows.append(("NumPy twins", best_ms(lambda x: kernels(x, 1, fast=False), tokens, max(3, args.repeat // 8))))
    g32, u32, d32 = (NumpyWeight(i, "experts", Q.dequantize(i)) for i in infos)
    rows.append(("float32 experts resident", best_ms(lambda x: ref_be.moe(x, router, g32, u32, d32, k),
                                                     tokens, max(3, args.repeat // 4))))
    rows.append(("dequantize + matmul", best_ms(lambda x: ref_be.moe(x, router, gate, up, down, k), tokens,
                                                max(3, args.repeat // 4))))
    print(f"\n{Q.type_name(t)}: active expert bytes per token {active / 1e6:.2f} MB; routing "
          f"{route_ms[0]:.2f} ms (median; included below)")
    print(f"{'path':<26}{'median ms':>10}{'best ms':>9}{'GB/s':>8}{'of copy':>9}")
    xa = C.quantize_rows(np.repeat(tokens[0], k, axis=0))
    ids = rng.choice(E, k, replace=False)
    _, gemv_best = best_ms(lambda x: C.expert_matvec(stacks[0], ids, xa, threads=1), tokens, args.repeat)
    print(f"gate GEMV alone, 1 thread ({k} x {F} x {H}): best {gemv_best:.3f} ms, "
          f"{k * F * H / gemv_best / 1e6:.1f} G multiply-adds/s, {stacks[0].active_bytes(k) / gemv_best / 1e6:.2f} GB/s")
    if args.phases:
        phases(stacks, dense_router, tokens, args)
    out = []
    for label, (med, best) in rows:
        gbs = active / (med / 1e3) / 1e9
        print(f"{label:<26}{med:>10.2f}{best:>9.2f}{gbs:>8.2f}{gbs / copy_gbs:>9.1%}")
        out.append({"type": Q.type_name(t), "path": label, "median_ms": med, "best_ms": best,
                    "active_bytes": active, "gbs": gbs, "copy_gbs": copy_gbs, "routing_ms": route_ms[0]})
    return out


def phases(stacks: list, router: np.ndarray, tokens: list[np.ndarray], args: argparse.Namespace) -> None:
    """Median microseconds of each step of routed_experts, per thread count (--phases): where the
    time of a token goes beside the two parallel regions (gate+up; down with the weighted sum).
    routed_experts is one compiled call, so its regions are timed alone, called as it calls them,
    with the same experts of a copy of the stacks (so from RAM alike: each was last read 16 tokens
    ago); "beside the regions" is the median whole less their medians.
    The small steps are then timed alone (on data in cache) to say what the rest is."""
    k = args.used
    gate, up, down = stacks
    if up.ggml_type != gate.ggml_type:
        raise SystemExit("--phases times gate and up of one type (one region)")
    empty = _empty_region()
    F, H = gate.n_out, gate.n_in
    g2, u2, d2 = (C.ExpertStack(np.array(s.raw), s.ggml_type, s.n_in) for s in stacks)
    for n in (int(s) for s in args.threads.split(",")):
        steps: dict[str, list[float]] = {}

        def lap(name: str, t0: float, steps: dict[str, list[float]] = steps) -> float:
            t1 = time.perf_counter()
            steps.setdefault(name, []).append(1e6 * (t1 - t0))
            return t1

        C.set_threads(n)
        for i in range(args.repeat):
            x = tokens[i % len(tokens)][0]
            t = time.perf_counter()
            ids, w = C.route(x, router, k)
            t = lap("route", t)
            C.routed_experts(x, ids, w, gate, up, down, threads=n)
            t = lap("routed_experts (whole)", t)
            idx, w32 = np.empty(k, np.int64), np.empty(k, np.float32)
            xq, xd, xs = C._row_buffers(1, H)
            t = time.perf_counter()
            C._token_nb(x.reshape(1, -1), ids, w, gate.n_experts, idx, w32, xq, xd, xs)
            t = lap("ids + quantize x", t)
            gu = np.empty((2, k, F), np.float32)
            t = time.perf_counter()
            C._MATVEC[gate.ggml_type](g2.raw, u2.raw, 2, idx, xq, xd, xs, 0, C._F16_TABLE, gu)
            t = lap("gate+up region", t)
            hq, hd, hs = C._row_buffers(k, F)
            C._swiglu_quantize_nb(gu, 1, 0, F, hq, hd, hs)
            t = lap("swiglu + quantize h", t)
            o = np.empty(H, np.float32)
            C._DOWN_SUM[down.ggml_type](d2.raw, idx, w32, hq, hd, hs, C._F16_TABLE, n, o)
            t = lap("down + weighted sum region", t)
            empty(np.zeros(4 * n))
            lap("empty parallel region", t)
        med = {name: float(np.median(v)) for name, v in steps.items()}
        beside = med["routed_experts (whole)"] - med["gate+up region"] - med["down + weighted sum region"]
        print(f"  phases at {n} thread(s), median us: " + ", ".join(f"{name} {v:.0f}" for name, v in med.items())
              + f"; beside the regions {beside:.0f}")


def _empty_region():
    """A numba parallel loop doing nothing: what starting a region on the threads costs."""
    import numba

    @numba.njit(parallel=True, cache=False)
    def run(a):  # pragma: no cover - compiled
        for i in numba.prange(a.size):
            a[i] += 1.0

    run(np.zeros(4))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="q4_k", help="expert types, comma-separated: " + ", ".join(TYPES))
    ap.add_argument("--threads", default="1,2", help="kernel thread counts to time, comma-separated")
    ap.add_argument("--experts", type=int, default=256, help="experts per layer")
    ap.add_argument("--used", type=int, default=8, help="experts per token")
    ap.add_argument("--hidden", type=int, default=2048, help="model width")
    ap.add_argument("--ffn", type=int, default=512, help="expert FFN width")
    ap.add_argument("--repeat", type=int, default=40, help="timed tokens per measurement")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--phases", action="store_true", help="also time each step of a token's experts")
    args = ap.parse_args()
    E, k, H, F = args.experts, args.used, args.hidden, args.ffn
    rng = np.random.default_rng(0)
    ceil = cpu_ceilings()
    print(f"copy bandwidth {ceil['copy_gbs']:.1f} GB/s; layer: {E} experts, {k} used, hidden {H}, "
          f"expert FFN {F}")
    router_f32 = (rng.standard_normal((E, H)) * 0.05).astype(np.float32)
    router = NumpyWeight(TensorInfo("router", Q.F32, "F32", (E, H), router_f32.view(np.uint8),
                                    router_f32.nbytes), "matmul", router_f32)
    tokens = [rng.standard_normal((1, H)).astype(np.float32) for _ in range(16)]
    results = []
    for tname in args.types.split(","):
        results += bench_type(TYPES[tname.strip()], rng, router, tokens, args, ceil["copy_gbs"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
