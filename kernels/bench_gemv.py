"""Decode GEMV benchmark: the single-token DP4A GEMV of each weight format at the 9B decode shapes, every
kernel variant, as GPU time, GB/s of weight bytes and % of the copy bandwidth measured in the same run.

`python -m minecart.kernels.bench_gemv` (about 30 s on an H200, compiles included). Weights are random
blocks made on the device (sane fp16 scales); several copies of each matrix are cycled (>= 256 MB per
shape) so that they come from HBM, not L2, as in a decode step. Q8_0 runs gemv_dp4a ("old"),
gemv_dp4a_split and gemv_dp4a_stream (ops.GEMV_VARIANT); the K-quants run gemv_kq in each compiled
shape, gemv_kq_stream ("sN") and the generic kernels over the same layout ("split",
ops.GEMV_KQ_VARIANT). The bytes counted are the device bytes
(`QWeight.nbytes`: the file's, Q6_K plus the padding of a tail group). The last lines weight each
shape by its launches per 9B decode step.

`--multi` times the multi-token matmuls of a batched decode step instead (T = 1, 2, 4, 8, 16, 32 tokens,
one per sequence, at the same shapes): "auto" (what ops.matmul picks: gemm_batch from GEMM_BATCH_MIN_T
tokens), "batch" (gemm_batch at every T), "gemv" (the multi-token GEMVs, K-quants: ops._gemv_kq_mt,
passes of gemv_kq_mt up to 32 tokens; Q8_0: ops._gemv_mt, gemv_mt up to 8), each compiled shape of those
kernels and "old" (the kernels before them: gemv_dp4a launches of 8/4/2/1 tokens up to 8, the tiled GEMM
above); per line the GPU time per call, per token, the GB/s of weight bytes
against the copy bandwidth, and the time over the single-token call; then the GEMV time of a 9B batched
decode step per T and variant. About a minute on an H200.

`--prefill T` times the prefill GEMM (gemm_dp4a, one and two quant blocks a stage; and the requantized
path "dp4a_rq" for the formats other than Q8_0) of T tokens at the
same shapes but the LM head, in TOPS against the DP4A rate measured in the same run, and the GEMM time
of a 9B prefill of T tokens.

Not here: correctness (tests/gpu/test_kquant_gemv.py, tests/gpu/test_gemv_multi.py, tests/gpu/test_fused.py)
and the choice of the default variant (ops._gemv_kq, ops._gemv_split, ops._gemv_kq_mt).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

import cupy as cp
import numpy as np

from . import ops
from .build import GEMV_KQ_MT, GEMV_MT
from .probe import measure_copy, measure_dp4a, random_weight, time_gpu

# (rows, row length, residual epilogue) of the 9B single-token GEMVs: attention output / FFN down with
# the residual, the fused GDN input projections, gate+up, the fused attention q/k/v/gate, the LM head
SHAPES_9B = ((4096, 4096, True), (12352, 4096, False), (24576, 4096, False), (10240, 4096, False),
             (4096, 12288, True), (248320, 4096, False))
CALLS_9B = {(4096, 4096): 32, (12352, 4096): 24, (24576, 4096): 32, (10240, 4096): 8, (4096, 12288): 32,
            (248320, 4096): 1}  # launches per 9B decode step
TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")
Q8_VARIANTS = ("old", "split1", "split2", "split4", "stream1", "stream2", "auto")


@dataclass(frozen=True)
class Row:
    type_name: str
    R: int
    K: int
    residual: bool
    variant: str  # Q8_0: ops.GEMV_VARIANT; K-quants: ops.GEMV_KQ_VARIANT
    kernel: str  # the instantiation "auto" resolved to
    seconds: float  # GPU time per launch
    gbs: float  # weight bytes / time, 1e9 B/s
    copy_share: float  # gbs / copy bandwidth


def _kernel_name(w: ops.QWeight) -> str:
    one = ops._single_gemv(w, w.rows, w.cols)
    return "gemv_dp4a" if one is None else f"{one[0]} x{one[2]}"


def run(shapes=SHAPES_9B, types=TYPES, cycle_bytes: int = 256 << 20, reps: int = 5,
        copy: float | None = None, out=None) -> list[Row]:
    """Time every variant of every type at every shape; print a line each to `out` (None: silent)."""
    copy = copy if copy is not None else measure_copy()
    if out is not None:
        print(f"copy bandwidth {copy:.0f} GB/s", file=out)
    rows: list[Row] = []
    saved = (ops.GEMV_VARIANT, ops.GEMV_KQ_VARIANT)
    rng = np.random.default_rng(0)
    try:
        for type_name in types:
            variants = Q8_VARIANTS if type_name == "Q8_0" else ("auto", "split", *ops._kq_variants())
            for R, K, with_res in shapes:
                first = random_weight(type_name, R, K, 0)
                per = first.nbytes
                ws = [first] + [random_weight(type_name, R, K, i) for i in range(1, max(1, math.ceil(cycle_bytes / per)))]
                x = cp.asarray(rng.standard_normal((1, K)).astype(np.float32))
                res = cp.asarray(rng.standard_normal((1, R)).astype(np.float32)) if with_res else None
                ops.register_quantized(x, ops.quantize_q8_1(x))

                def call(ws=ws, x=x, res=res):
                    for w in ws:
                        ops.matmul(x, w, "dp4a", residual=res)

                for v in variants:
                    if type_name == "Q8_0":
                        ops.GEMV_VARIANT = v
                    else:
                        ops.GEMV_VARIANT, ops.GEMV_KQ_VARIANT = "auto", v
                    t = time_gpu(call, reps) / len(ws)
                    gbs = per / t / 1e9
                    row = Row(type_name, R, K, with_res, v, _kernel_name(first), t, gbs, gbs / copy)
                    rows.append(row)
                    if out is not None:
                        print(f"{type_name} {R}x{K}{' +res' if with_res else ''} {v:7s} {row.kernel:28s} "
                              f"{t * 1e6:8.1f} us {gbs:6.0f} GB/s {100 * row.copy_share:4.0f}% of copy", file=out)
                del ws, first
                cp.get_default_memory_pool().free_all_blocks()
    finally:
        ops.GEMV_VARIANT, ops.GEMV_KQ_VARIANT = saved
    if out is not None:
        for type_name in types:
            auto = [r for r in rows if r.type_name == type_name and r.variant == "auto" and (r.R, r.K) in CALLS_9B]
            if auto:
                step = sum(r.seconds * CALLS_9B[(r.R, r.K)] for r in auto)
                byt = sum(r.seconds * r.gbs * 1e9 * CALLS_9B[(r.R, r.K)] for r in auto)
                print(f"{type_name}: GEMV time per 9B decode step (auto) {step * 1e3:.3f} ms, "
                      f"{byt / step / 1e9:.0f} GB/s = {100 * byt / step / 1e9 / copy:.0f}% of copy", file=out)
    return rows


TOKENS_MULTI = (1, 2, 4, 8, 16, 32)  # sequences of a batched decode step (--multi)


@dataclass(frozen=True)
class MultiRow:
    type_name: str
    R: int
    K: int
    T: int
    residual: bool
    variant: str  # ops.GEMV_KQ_MT_VARIANT ("old" above 8 tokens: the tiled GEMM)
    seconds: float  # GPU time per call (all T tokens)
    gbs: float  # weight bytes / time, 1e9 B/s
    copy_share: float  # gbs / copy bandwidth
    over_one: float  # seconds / the single-token call's seconds (auto), same shape


def run_multi(shapes=SHAPES_9B, types=TYPES, tokens=TOKENS_MULTI,
              cycle_bytes: int = 256 << 20, reps: int = 5, copy: float | None = None, out=None) -> list[MultiRow]:
    """Time the DP4A matmul of T tokens in every variant (module docstring) at every shape and T;
    print a line each to `out` (None: silent) and the GEMV time of a 9B batched decode step per T."""
    copy = copy if copy is not None else measure_copy()
    if out is not None:
        print(f"copy bandwidth {copy:.0f} GB/s", file=out)
    rows: list[MultiRow] = []
    saved = (ops.GEMV_VARIANT, ops.GEMV_KQ_VARIANT, ops.GEMV_KQ_MT_VARIANT, ops.GEMV_MT_VARIANT,
             ops.GEMM_BATCH_VARIANT)
    rng = np.random.default_rng(0)
    try:
        ops.GEMV_VARIANT, ops.GEMV_KQ_VARIANT = "auto", "auto"
        for type_name in types:
            for R, K, with_res in shapes:
                first = random_weight(type_name, R, K, 0)
                per = first.nbytes
                ws = [first] + [random_weight(type_name, R, K, i) for i in range(1, max(1, math.ceil(cycle_bytes / per)))]
                one = 0.0
                for T in tokens:
                    x = cp.asarray(rng.standard_normal((T, K)).astype(np.float32))
                    res = cp.asarray(rng.standard_normal((T, R)).astype(np.float32)) if with_res else None
                    ops.register_quantized(x, ops.quantize_q8_1(x))

                    def call(ws=ws, x=x, res=res):
                        for w in ws:
                            ops.matmul(x, w, "dp4a", residual=res)

                    shapes_mt = GEMV_MT if type_name == "Q8_0" else GEMV_KQ_MT
                    top = ops.GEMV_MAX_T if type_name == "Q8_0" else max(ops.GEMV_MAX_T, ops.KQ_PASSES_MAX_T)
                    variants = ["auto"] if T == 1 else ["auto", "batch", "gemv", "old"]
                    if 1 < T <= top:
                        variants += [f"{a}x{b}" for a, b in shapes_mt]
                    for v in variants:
                        # "batch": gemm_batch at any T; "gemv" and the rest: the kernels before it
                        ops.GEMM_BATCH_VARIANT = {"auto": "auto", "batch": "on"}.get(v, "off")
                        mt = "auto" if v in ("batch", "gemv") else v
                        if type_name == "Q8_0":  # gemv_mt up to GEMV_MAX_T tokens, the GEMM above
                            ops.GEMV_MT_VARIANT = mt
                        else:
                            ops.GEMV_KQ_MT_VARIANT = mt
                        t = time_gpu(call, reps) / len(ws)
                        if T == 1 and v == "auto":
                            one = t
                        gbs = per / t / 1e9
                        row = MultiRow(type_name, R, K, T, with_res, v, t, gbs, gbs / copy, t / one if one else 0.0)
                        rows.append(row)
                        if out is not None:
                            print(f"{type_name} {R}x{K}{' +res' if with_res else ''} T={T:<2d} {v:5s} "
                                  f"{t * 1e6:8.1f} us {t * 1e6 / T:7.2f} us/token {gbs:6.0f} GB/s "
                                  f"{100 * row.copy_share:4.0f}% of copy {row.over_one:5.2f}x T=1", file=out)
                    del x, res
                del ws, first
                cp.get_default_memory_pool().free_all_blocks()
    finally:
        (ops.GEMV_VARIANT, ops.GEMV_KQ_VARIANT, ops.GEMV_KQ_MT_VARIANT, ops.GEMV_MT_VARIANT,
         ops.GEMM_BATCH_VARIANT) = saved
    if out is not None:
        for type_name in types:
            for T in tokens:
                for v in ("auto", "batch", "gemv", "old") + tuple(f"{a}x{b}" for a, b in sorted(set(GEMV_KQ_MT) | set(GEMV_MT))):
                    sel = [r for r in rows if r.type_name == type_name and r.T == T and r.variant == v
                           and (r.R, r.K) in CALLS_9B]
                    if len(sel) == len({(R, K) for R, K, _ in shapes} & set(CALLS_9B)) and sel:
                        step = sum(r.seconds * CALLS_9B[(r.R, r.K)] for r in sel)
                        print(f"{type_name}: GEMV time of a 9B decode step of {T:2d} sequences ({v}) "
                              f"{step * 1e3:.3f} ms, {step * 1e3 / T:.3f} ms per sequence", file=out)
    return rows


@dataclass(frozen=True)
class PrefillRow:
    type_name: str
    R: int
    K: int
    T: int
    path: str  # ops.matmul's: "dp4a" (gemm_dp4a, one quant block a stage), "dp4a2" (two) or "dp4a_rq" (requantized)
    seconds: float  # GPU time per call
    tops: float  # 2 T R K / seconds, 1e12 int8 operations a second
    dp4a_share: float  # tops / the DP4A rate measured in the same run


def _prefill_paths(type_name: str) -> tuple[str, ...]:
    return ("dp4a", "dp4a2", "dp4a_rq") if type_name in ops.REQUANT_TYPES else ("dp4a", "dp4a2")


def run_prefill(shapes=SHAPES_9B, types=TYPES, T: int = 4096, reps: int = 3, out=None) -> list[PrefillRow]:
    """Time the prefill GEMM (gemm_dp4a, both stage depths, and for the formats other than Q8_0 the
    Q8_0 GEMM on the weights requantized, ops.REQUANT_TYPES, requantization included) of T tokens at every
    shape but the LM head
    (a prefill computes its last row only); print a line each and the GEMM time of a 9B prefill of T
    tokens per format and path, against the DP4A rate measured in the same run."""
    rate = measure_dp4a()
    if out is not None:
        print(f"DP4A {rate:.1f} TOPS", file=out)
    rows: list[PrefillRow] = []
    rng = np.random.default_rng(0)
    for type_name in types:
        for R, K, with_res in shapes:
            if R > 100_000:
                continue
            w = random_weight(type_name, R, K, 0)
            x = cp.asarray(rng.standard_normal((T, K)).astype(np.float32))
            res = cp.asarray(rng.standard_normal((T, R)).astype(np.float32)) if with_res else None
            for path in _prefill_paths(type_name):
                t = time_gpu(lambda w=w, x=x, res=res, path=path: ops.matmul(x, w, path, residual=res), reps)
                tops = 2 * T * R * K / t / 1e12
                row = PrefillRow(type_name, R, K, T, path, t, tops, tops / rate)
                rows.append(row)
                if out is not None:
                    print(f"{type_name} {R}x{K}{' +res' if with_res else ''} T={T} {path:7s} {t * 1e3:8.3f} ms "
                          f"{tops:6.1f} TOPS {100 * row.dp4a_share:4.0f}% of DP4A", file=out)
            del w, x, res
            cp.get_default_memory_pool().free_all_blocks()
    if out is not None:
        for type_name in types:
            for path in _prefill_paths(type_name):
                sel = [r for r in rows if r.type_name == type_name and r.path == path and (r.R, r.K) in CALLS_9B]
                if sel:
                    step = sum(r.seconds * CALLS_9B[(r.R, r.K)] for r in sel)
                    ops_ = sum(2 * T * r.R * r.K * CALLS_9B[(r.R, r.K)] for r in sel)
                    print(f"{type_name}: GEMM time of a 9B prefill of {T} tokens ({path}) {step * 1e3:.1f} ms, "
                          f"{ops_ / step / 1e12:.1f} TOPS = {100 * ops_ / step / 1e12 / rate:.0f}% of DP4A", file=out)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minecart.kernels.bench_gemv", description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=",".join(TYPES), help=f"comma-separated formats (default {','.join(TYPES)})")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    p.add_argument("--multi", action="store_true",
                   help="time the multi-token matmuls of a batched decode step (T = 1..32 tokens) instead "
                        "of the single-token GEMVs")
    p.add_argument("--prefill", type=int, default=0, metavar="T",
                   help="time the prefill GEMM of T tokens (both stage depths) against the DP4A rate instead")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS_MULTI)),
                   help=f"with --multi: comma-separated token counts (default {','.join(map(str, TOKENS_MULTI))})")
    p.add_argument("--shapes", default="",
                   help="comma-separated ROWSxCOLS of the 9B shapes to run (default all: "
                        + ",".join(f"{R}x{K}" for R, K, _ in SHAPES_9B) + "); a profiler's view of one")
    args = p.parse_args(argv)
    known = {f"{R}x{K}": (R, K, res) for R, K, res in SHAPES_9B}
    picked = [s for s in args.shapes.split(",") if s]
    if [s for s in picked if s not in known]:
        p.error(f"--shapes {args.shapes!r}: choose from {', '.join(known)}")
    shapes = tuple(known[s] for s in picked) or SHAPES_9B
    types = tuple(t for t in args.types.split(",") if t)
    bad = [t for t in types if t not in TYPES]
    if bad:
        p.error(f"unknown format(s) {', '.join(bad)}; choose from {', '.join(TYPES)}")
    rows: list[Row] | list[MultiRow] | list[PrefillRow]
    if args.prefill > 0:
        rows = run_prefill(shapes=shapes, types=types, T=args.prefill, out=sys.stdout)
    elif args.multi:
        try:
            tokens = tuple(int(t) for t in args.tokens.split(",") if t)
        except ValueError:
            p.error(f"--tokens {args.tokens!r}: comma-separated whole numbers")
        if not tokens or min(tokens) < 1:
            p.error("--tokens: at least one count, each 1 or more")
        rows = run_multi(shapes=shapes, types=types, tokens=tokens, out=sys.stdout)
    else:
        rows = run(shapes=shapes, types=types, out=sys.stdout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
