"""Per-card probe: which matmul path (DP4A int8, fp32 FMA or fp16 HFMA2) is fastest on this GPU, and its
ceilings.

Mining cards throttle different units (CMP 100-210: tensor cores; CMP 30HX-170HX: also DP4A or FMA,
some keeping full-rate fp16; Pascal consumer cards run fp16 at 1/64 rate), so the path is measured, not
assumed. `run_probe()` times the Q8_0 GEMV (decode) and GEMM (prefill) in every variant on random data
and returns a plain dict (stored per GPU UUID by engine/probe_cache.py); where a DP4A GEMM wins, it also
picks the K-quants' own prefill GEMM (`pick_kquant_gemm`: stage depth or requantized). It takes well under a second
after the kernels are compiled. Timings are GPU time (calls captured into a CUDA graph), not Python
launch overhead. A variant that raises or whose result differs from the fp32 FMA result on the probe's
own data by more than SANITY_REL_ERR (max abs error / max abs value) is excluded (`choose_fastest`).
`measure_ceilings()` measures copy bandwidth and the peak DP4A / FMA rates for `minecart bench`.

Not here: the cache file (engine/probe_cache.py) and the decision's use (engine/backends/cupy_backend.py).
`choose_fastest` needs no GPU (this module imports without CuPy, for tests on CPU-only machines).
"""

from __future__ import annotations

import math
import time

import numpy as np

try:
    import cupy as cp

    from . import gdn_chunk, kquant_layout, ops
except ImportError:  # CPU-only machine: only choose_fastest is usable
    cp = ops = gdn_chunk = kquant_layout = None

from .build import KV_CACHE_TYPES, get_kernel

GEMV_PATHS = ("dp4a", "fma", "hfma2")  # decode candidates
GEMM_PATHS = ("dp4a", "dp4a2", "fma", "hfma2")  # prefill candidates
SANITY_REL_ERR = 5e-2  # a variant further than this from the fp32 FMA result is broken on this card


def choose_fastest(times: dict, errors: dict, tol: float = SANITY_REL_ERR) -> str:
    """The fastest usable path. times: path -> seconds (None when the variant raised); errors: path ->
    relative error against fp32 FMA (None when unknown). A path is usable when it ran, its time is
    finite and positive, and its error is known, finite and at most `tol`. When nothing qualifies,
    "fma" (the reference kernel)."""
    ok = {}
    for p, t in times.items():
        e = errors.get(p)
        if t is None or e is None or not math.isfinite(t) or t <= 0 or not math.isfinite(e) or e > tol:
            continue
        ok[p] = t
    return min(ok, key=ok.get) if ok else "fma"


def _time(fn, reps: int) -> float:
    """Mean seconds per call of fn on the current stream (after one warm-up)."""
    fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / reps


def time_gpu(fn, reps: int = 20) -> float:
    """GPU seconds per call of fn, free of Python launch overhead: `reps` calls are captured into one
    CUDA graph, which is launched once to warm up and once timed."""
    stream = cp.cuda.Stream(non_blocking=False)
    fn()  # compile and warm the allocator outside the capture
    pool = cp.get_default_memory_pool()
    kept = []

    def keep_alloc(size):
        mem = pool.malloc(size)
        kept.append(mem)
        return mem

    with stream:
        cp.cuda.set_allocator(keep_alloc)
        try:
            begin_capture(stream)
            try:
                for _ in range(reps):
                    fn()
            finally:
                graph = stream.end_capture()
        finally:
            cp.cuda.set_allocator(pool.malloc)
        graph.launch(stream)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
    kept.clear()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / reps


def begin_capture(stream) -> None:
    """Start stream capture in relaxed mode (allocations may happen while capturing)."""
    mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)
    if mode is None:
        stream.begin_capture()
    else:
        stream.begin_capture(mode)


def random_q8_0(R: int, K: int, seed: int = 0) -> ops.QWeight:
    """A random Q8_0 matrix built directly on the device (for probes and benchmarks)."""
    rs = cp.random.RandomState(seed)
    wq = rs.randint(-127, 128, size=(R, K), dtype=cp.int32).astype(cp.int8).view(cp.uint8)
    d = (rs.random_sample((R, K // 32), dtype=cp.float32) * 0.01 + 0.001).astype(cp.float16)
    return ops.QWeight("Q8_0", R, K, 1, wq, d.view(cp.uint16))


def random_weight(type_name: str, R: int, K: int, seed: int = 0) -> ops.QWeight:
    """A random (R, K) matrix of Q8_0 or a K-quant, made and laid out on the device."""
    if type_name == "Q8_0":
        return random_q8_0(R, K, seed)
    if type_name not in kquant_layout.KQUANT_TYPES:
        raise ValueError(f"random_weight makes Q8_0 and the K-quants, not {type_name}")
    sb = kquant_layout.SUPER_BYTES[type_name]
    rs = cp.random.RandomState(seed)
    raw = rs.randint(0, 256, size=(R * (K // 256), sb), dtype=cp.int32).astype(cp.uint8)
    scale = cp.asarray(np.frombuffer(np.array([1e-3], "<f2").tobytes(), np.uint8))
    for off in ((208,) if type_name == "Q6_K" else (0, 2)):
        raw[:, off:off + 2] = scale
    wq, wd = ops._upload_kquant(raw.reshape(R, -1), type_name, K)
    return ops.QWeight(type_name, R, K, 1, wq, wd)


def measure_copy(n_bytes: int = 256 << 20, reps: int = 10) -> float:
    """Device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    n4 = n_bytes // 16
    src = cp.ones(n4 * 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    k = get_kernel("bench", "copy_f4")
    t = _time(lambda: k((sms * 8,), (512,), (src, dst, np.int64(n4))), reps)
    return 2 * n4 * 16 / t / 1e9


def _peak_rate(kernel: str, out_dtype, seed, iters: int) -> float:
    """Instructions per second of a bench.cu peak kernel (16 * 8 per thread and iteration)."""
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.zeros(1, dtype=out_dtype)
    blocks, threads = sms * 8, 256
    k = get_kernel("bench", kernel)
    t = _time(lambda: k((blocks,), (threads,), (out, np.int32(iters), seed)), 3)
    return blocks * threads * iters * 16 * 8 / t


def measure_dp4a(iters: int = 2048) -> float:
    """Peak DP4A rate in TOPS (8 int8 operations per instruction: 4 multiplies, 4 adds)."""
    return _peak_rate("peak_dp4a", cp.int32, np.int32(3), iters) * 8 / 1e12


def measure_fma(iters: int = 2048) -> float:
    """Peak fp32 FMA rate in TFLOP/s (2 flops per FMA)."""
    return _peak_rate("peak_fma", cp.float32, np.float32(1.0001), iters) * 2 / 1e12


def measure_ceilings(seconds: float = 0.3) -> dict:
    del seconds  # sizes are fixed; each measurement takes a few milliseconds
    return {"copy_gbs": measure_copy(), "dp4a_tops": measure_dp4a(), "fma_tflops": measure_fma()}


def _rel_err(y, ref) -> float:
    scale = float(cp.abs(ref).max())
    return float(cp.abs(y - ref).max()) / scale if scale > 0 else float("inf")


def run_probe() -> dict:
    """Time the DP4A, FMA and HFMA2 matmuls on this card; return the choices and the measurements.

    Record: gemv / gemm (chosen paths), gemv_us / gemm_us (microseconds per call of every variant that
    ran; a variant that raised is missing), gemv_err / gemm_err (relative error against fp32 FMA),
    gemv_excluded / gemm_excluded (variants left out and why), gemm_kquant / gemm_kquant_us /
    gemm_kquant_err (the K-quants' prefill GEMM when gemm is a DP4A path: pick_kquant_gemm), the ceilings, probe_s."""
    t_start = time.perf_counter()
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    R, K = 4096, 4096
    w = random_q8_0(R, K)
    x1 = cp.random.RandomState(1).standard_normal((1, K), dtype=cp.float32)
    xp = cp.random.RandomState(2).standard_normal((256, K), dtype=cp.float32)
    rec: dict = {"name": name, "cc": int(dev.compute_capability)}
    for label, x, paths in (("gemv", x1, GEMV_PATHS), ("gemm", xp, GEMM_PATHS)):
        ref = ops.matmul(x, w, "fma")
        times: dict = {}
        errs: dict = {}
        excluded: dict = {}
        for path in paths:
            try:
                errs[path] = 0.0 if path == "fma" else _rel_err(ops.matmul(x, w, path), ref)
                times[path] = time_gpu(lambda x=x, path=path: ops.matmul(x, w, path), 10)
            except Exception as exc:  # a variant that fails on this card is simply not used
                times[path] = None
                excluded[path] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            if not errs[path] <= SANITY_REL_ERR:
                excluded[path] = f"relative error {errs[path]:.2e} against fp32 FMA"
        rec[f"{label}_us"] = {p: round(t * 1e6, 1) for p, t in times.items() if t is not None}
        rec[f"{label}_err"] = {p: float(f"{e:.3g}") for p, e in errs.items()}
        if excluded:
            rec[f"{label}_excluded"] = excluded
        rec[label] = choose_fastest(times, errs)
    if rec["gemm"].startswith("dp4a"):
        rec.update(pick_kquant_gemm())
    rec.update(measure_ceilings())
    rec["dp4a_throttled"] = not rec["gemm"].startswith("dp4a") and rec["gemv"] != "dp4a"
    rec["probe_s"] = round(time.perf_counter() - t_start, 3)
    return rec


KQUANT_GEMM_PATHS = ("dp4a", "dp4a2", "dp4a_rq")  # pick_kquant_gemm's candidates


def pick_kquant_gemm(R: int = 4096, K: int = 4096, T: int = 1024) -> dict:
    """The prefill GEMM of the K-quants: gemm_dp4a with one quant block a barrier ("dp4a") or two
    ("dp4a2"), or the Q8_0 GEMM on the weights requantized ("dp4a_rq", ops.REQUANT_TYPES; the
    requantization included in its time), timed on a random Q4_K matrix at a prefill shape that fills
    the card (T tokens: 256 blocks of 128 x 128). The Q8_0 matrix the probe picks the path on needs two
    blocks a stage (its loads are a stage's only work), while a K-quant's expansion of its blocks is
    enough work between barriers for one: on the H100 and H200 Q4_K and Q6_K ran 1-3% faster with one,
    Q8_0 25% slower (docs/BENCHMARKS.md v26, v45). A candidate further than SANITY_REL_ERR from fp32 FMA
    is left out, as run_probe leaves them out. Record: gemm_kquant (the pick), gemm_kquant_us,
    gemm_kquant_err."""
    w = random_weight("Q4_K", R, K, 3)
    x = cp.random.RandomState(4).standard_normal((T, K), dtype=cp.float32)
    ref = ops.matmul(x, w, "fma")
    errs = {path: _rel_err(ops.matmul(x, w, path), ref) for path in KQUANT_GEMM_PATHS}
    times = {path: time_gpu(lambda path=path: ops.matmul(x, w, path), 10) for path in KQUANT_GEMM_PATHS}
    return {"gemm_kquant": choose_fastest(times, errs),
            "gemm_kquant_us": {p: round(t * 1e6, 1) for p, t in times.items()},
            "gemm_kquant_err": {p: float(f"{e:.3g}") for p, e in errs.items()}}


def op_breakdown(T: int = 4096, ctx: int = 18432) -> dict:
    """GPU time of the main kernels at Qwen3.5-9B shapes (for docs/kernels.md): prefill pieces at T
    tokens, decode pieces at context `ctx`. Milliseconds per call, plus achieved rates."""
    rs = cp.random.RandomState(5)
    res: dict = {"copy_gbs": measure_copy()}  # the ceiling the GB/s figures below are read against
    H, F = 4096, 12288
    for name, (R, K) in {"gemm_4096x4096": (4096, H), "gemm_12288x4096": (F, H), "gemm_4096x12288": (H, F)}.items():
        w = random_q8_0(R, K, 1)
        x = rs.standard_normal((T, K), dtype=cp.float32)
        for path in GEMM_PATHS:
            t = time_gpu(lambda x=x, w=w, path=path: ops.matmul(x, w, path), 3)
            res[f"{name}_{path}_ms"] = t * 1e3
            res[f"{name}_{path}_tops"] = 2 * T * R * K / t / 1e12
        x1 = rs.standard_normal((1, K), dtype=cp.float32)
        for path in GEMV_PATHS:
            t = time_gpu(lambda x1=x1, w=w, path=path: ops.matmul(x1, w, path), 50)
            res[f"gemv_{R}x{K}_{path}_us"] = t * 1e6
            res[f"gemv_{R}x{K}_{path}_gbs"] = w.nbytes / t / 1e9
    x = rs.standard_normal((T, H), dtype=cp.float32)
    t = time_gpu(lambda: ops.quantize_q8_1(x), 20)
    res["quantize_T_ms"] = t * 1e3
    nh, n_kv, D = 16, 4, 256
    q = rs.standard_normal((T, nh, D), dtype=cp.float32)
    kc = rs.standard_normal((max(T, ctx) + 1, n_kv, D), dtype=cp.float32)
    vc = rs.standard_normal((max(T, ctx) + 1, n_kv, D), dtype=cp.float32)
    t = time_gpu(lambda: ops.attention(q, kc, vc, 0, T, 1 / 16), 3)
    res["flash_prefill_ms"] = t * 1e3
    res["flash_prefill_tflops"] = 4 * nh * D * T * T / 2 / t / 1e12
    t = time_gpu(lambda: ops.attention(q, kc, vc, 0, T, 1 / 16, prefill="rows"), 3)
    res["flash_prefill_rows_ms"] = t * 1e3  # the older prefill kernel, for comparison
    q1 = rs.standard_normal((1, nh, D), dtype=cp.float32)
    t = time_gpu(lambda: ops.attention(q1, kc, vc, ctx - 1, ctx, 1 / 16), 20)
    res["flash_decode_ctx_us"] = t * 1e6
    res["flash_decode_ctx_gbs"] = 2 * ctx * n_kv * D * 4 / t / 1e9
    # decode attention at 16K over each cache type, GB/s of cache bytes read (compare with copy_gbs)
    from . import kvcache

    L = 16384
    for kv in ("f32",) + KV_CACHE_TYPES:
        if kv == "f32":
            kL = rs.standard_normal((L, n_kv, D), dtype=cp.float32)
            vL = rs.standard_normal((L, n_kv, D), dtype=cp.float32)
        else:
            kL, vL = kvcache.alloc(L, n_kv, D, kv), kvcache.alloc(L, n_kv, D, kv)
            kvcache.append(rs.standard_normal((L, n_kv, D), dtype=cp.float32),
                           rs.standard_normal((L, n_kv, D), dtype=cp.float32), kL, vL, kv, 0)
        t = time_gpu(lambda kL=kL, vL=vL, kv=kv: ops.attention(q1, kL, vL, L - 1, L, 1 / 16, kv_type=kv), 20)
        res[f"flash_decode_16k_{kv}_us"] = t * 1e6
        res[f"flash_decode_16k_{kv}_gbs"] = (kL.nbytes + vL.nbytes) / t / 1e9
        if kv == "f16":  # the context split: blocks per multiprocessor
            keep = ops.DECODE_BLOCKS_PER_SM
            try:
                for bps in (2, 3, 4, 8):
                    ops.DECODE_BLOCKS_PER_SM = bps
                    t = time_gpu(lambda kL=kL, vL=vL: ops.attention(q1, kL, vL, L - 1, L, 1 / 16, kv_type="f16"), 20)
                    res[f"flash_decode_16k_f16_{bps}bps_us"] = t * 1e6
            finally:
                ops.DECODE_BLOCKS_PER_SM = keep
        kern = get_kernel("attention" if kv == "f32" else f"attention_{kv}", ops.decode_kernel(D, nh, n_kv))
        res[f"flash_decode_{kv}_regs"] = kern.num_regs  # registers per thread and spill bytes (ptxas)
        res[f"flash_decode_{kv}_local_bytes"] = kern.local_size_bytes
        del kL, vL
    n_k, n_v, dk = 16, 32, 128
    qg = rs.standard_normal((T, n_k, dk), dtype=cp.float32) * 0.01
    kg = rs.standard_normal((T, n_k, dk), dtype=cp.float32) * 0.08
    vg = rs.standard_normal((T, n_v, dk), dtype=cp.float32)
    g = -cp.abs(rs.standard_normal((T, n_v), dtype=cp.float32))
    b = rs.random_sample((T, n_v), dtype=cp.float32)
    st = cp.zeros((n_v, dk, dk), dtype=cp.float32)
    t = time_gpu(lambda: ops.gdn_scan(qg, kg, vg, g, b, st), 2)
    res["gdn_scan_T_ms"] = t * 1e3
    t = time_gpu(lambda: gdn_chunk.gdn_chunked(qg, kg, vg, g, b, st), 3)
    res["gdn_chunk_T_ms"] = t * 1e3
    t = time_gpu(lambda: ops.gdn_scan(qg[:1], kg[:1], vg[:1], g[:1], b[:1], st), 50)
    res["gdn_step_us"] = t * 1e6
    return {k: round(v, 3) for k, v in res.items()}
