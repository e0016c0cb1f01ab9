"""Single-token decode attention on a GPU, as a captured decode step runs it (fused.attention_decode_gated
with the context length read from the device, the context split sized for the cache's capacity): GPU
microseconds a call and the cache bytes it reads a second, against the copy bandwidth measured in the
same run. Run on the GPU machine from the repo root with minecart importable:

    python3 tools/bench_decode_attention.py [--ctx 1024,4096,16384] [--kv f16,q8_0] [--heads 16/4,24/4]
        [--bps 2,3,4]

--heads takes query heads / KV heads pairs (16/4: the 9B, 24/4: the 27B, 16/2: the 35B-A3B); the head
dim is 256 (--dim); --bps tries context splits of that many blocks per multiprocessor
(ops.DECODE_BLOCKS_PER_SM), each checked against the first. The figures are what issue 16's long-context
decode target turns on: the step at 16K pays this kernel in every full-attention layer.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="1024,4096,16384")
    ap.add_argument("--kv", default="f16,q8_0")
    ap.add_argument("--heads", default="16/4,24/4")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--bps", default="", help="context slices: blocks per multiprocessor to try (default: ops')")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import cupy as cp
    from minecart.kernels import fused, kvcache, ops, probe

    keep_bps = ops.DECODE_BLOCKS_PER_SM

    copy = probe.measure_copy()
    print(f"copy bandwidth {copy:.0f} GB/s")
    rows = []
    rs = cp.random.RandomState(3)
    D = args.dim
    for heads in args.heads.split(","):
        nh, n_kv = (int(x) for x in heads.split("/"))
        for kv in args.kv.split(","):
            for ctx in (int(c) for c in args.ctx.split(",")):
                cap = ctx + 1024
                kc, vc = kvcache.alloc(cap, n_kv, D, kv), kvcache.alloc(cap, n_kv, D, kv)
                kvcache.append(rs.standard_normal((ctx, n_kv, D), dtype=cp.float32),
                               rs.standard_normal((ctx, n_kv, D), dtype=cp.float32), kc, vc, kv, 0)
                q = rs.standard_normal((1, nh, D), dtype=cp.float32)
                qg = rs.standard_normal((1, nh, 2, D), dtype=cp.float32)
                length = cp.array([ctx - 1], dtype=cp.int32)  # the length before this token's append

                def call(q=q, qg=qg, kc=kc, vc=vc, length=length, kv=kv, cap=cap):
                    return fused.attention_decode_gated(q, qg, kc, vc, cap, 1 / 16, kv_len_ptr=length,
                                                        want_q8=True, kv_type=kv)

                ref = None
                for bps in [int(b) for b in args.bps.split(",") if b] or [keep_bps]:
                    ops.DECODE_BLOCKS_PER_SM = bps
                    out = call()[0]
                    ref = out if ref is None else ref  # the other splits of the context against the first
                    err = float(cp.abs(out - ref).max() / (cp.abs(ref).max() + 1e-30))
                    t = probe.time_gpu(call, args.reps)
                    read = (kc.nbytes + vc.nbytes) * ctx / cap
                    row = {"heads": heads, "kv": kv, "ctx": ctx, "bps": bps, "us": round(t * 1e6, 2),
                           "cache_gbs": round(read / t / 1e9, 1), "of_copy": round(read / t / 1e9 / copy, 3),
                           "rel_err_vs_first": err}
                    rows.append(row)
                    print(f"{heads:>6} {kv:>5} ctx {ctx:>6} bps {bps}: {row['us']:8.2f} us  "
                          f"{row['cache_gbs']:7.1f} GB/s  {row['of_copy']:.2f} of copy  err {err:.1e}", flush=True)
                ops.DECODE_BLOCKS_PER_SM = keep_bps
                del kc, vc
                cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
