"""Prefill attention kernels (kernels/attention.cu flash_prefill_g, the default, and the older
flash_prefill) against an fp64 softmax reference, and their speed on the 9B shape.

Cache rows past the context are NaN and the output starts as NaN, so a stray read or a missed write
shows up. Run with -s to see the errors and the timings:
    pytest -s tests/gpu/test_attention_prefill.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._reference import attention_reference as reference

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

KERNELS = ("tiled", "rows")


def run_case(rng, T, start, D, G, window, n_kv=2, kernel="tiled", q_scale=1.0):
    from minecart.kernels import ops

    nh = n_kv * G
    kv_len = start + T
    q = (rng.standard_normal((T, nh, D)) * q_scale).astype(np.float32)
    kc = rng.standard_normal((kv_len + 5, n_kv, D)).astype(np.float32)
    vc = rng.standard_normal((kv_len + 5, n_kv, D)).astype(np.float32)
    kc[kv_len:] = np.nan
    vc[kv_len:] = np.nan
    scale = D ** -0.5
    out = cp.full((T, nh, D), cp.nan, dtype=cp.float32)
    ops.flash_prefill(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), out, start, kv_len, scale, window, kernel)
    y = cp.asnumpy(out).astype(np.float64)
    ref = reference(q, kc, vc, start, kv_len, scale, window)
    assert np.all(np.isfinite(y)), f"non-finite output T={T} start={start} D={D} G={G} window={window}"
    nerr = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    maxrel = float(np.abs(y - ref).max() / np.abs(ref).max())
    return nerr, maxrel


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_prefill_matches_reference(kernel, D, G):
    rng = np.random.default_rng(1000 * D + G)
    worst = (0.0, 0.0, None)
    for T in (1, 5, 33, 64, 100, 257):
        for start in (0, 37):
            for window in (0, 16):
                nerr, maxrel = run_case(rng, T, start, D, G, window, kernel=kernel)
                if nerr > worst[0]:
                    worst = (nerr, maxrel, (T, start, window))
                assert nerr < 2e-5 and maxrel < 1e-4, (kernel, T, start, D, G, window, nerr, maxrel)
    print(f"\nflash_prefill[{kernel}] D={D} G={G}: worst norm rel err {worst[0]:.2e} "
          f"(max rel {worst[1]:.2e}) at T, start, window = {worst[2]}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("T,start,window,G,n_kv", [(1000, 37, 0, 4, 4), (1000, 37, 100, 4, 4),
                                                    (777, 0, 200, 3, 2), (300, 500, 70, 1, 3),
                                                    (129, 5, 0, 16, 1)])
def test_prefill_long_and_odd_groups(kernel, T, start, window, G, n_kv):
    """Many key tiles, windows that skip whole tiles, GQA groups that do not divide 64, and sharper
    softmax (queries scaled by 3)."""
    rng = np.random.default_rng(T + start + window)
    nerr, maxrel = run_case(rng, T, start, 256, G, window, n_kv=n_kv, kernel=kernel, q_scale=3.0)
    print(f"\nflash_prefill[{kernel}] T={T} start={start} window={window} G={G} n_kv={n_kv} D=256: "
          f"norm rel err {nerr:.2e}, max rel {maxrel:.2e}")
    assert nerr < 2e-5 and maxrel < 1e-4


@pytest.mark.parametrize("T", [4096, 18432])
def test_prefill_speed_9b_shape(T):
    """9B shape: 16 query heads, 4 KV heads, head dim 256, causal, start 0. Prints both kernels."""
    from minecart.kernels import ops
    from minecart.kernels.probe import time_gpu

    nh, n_kv, D = 16, 4, 256
    rs = cp.random.RandomState(0)
    q = rs.standard_normal((T, nh, D), dtype=cp.float32)
    kc = rs.standard_normal((T + 1, n_kv, D), dtype=cp.float32)
    vc = rs.standard_normal((T + 1, n_kv, D), dtype=cp.float32)
    flops = 4 * nh * D * T * T / 2
    res = {}
    for kernel in KERNELS:
        out = cp.empty((T, nh, D), dtype=cp.float32)
        t = time_gpu(lambda kernel=kernel, out=out: ops.flash_prefill(q, kc, vc, out, 0, T, 1 / 16, 0, kernel),
                     3 if T <= 4096 else 1)
        res[kernel] = (t, out)
        print(f"\nflash_prefill[{kernel}] 9B shape T={T}: {t * 1e3:.2f} ms/layer, {flops / t / 1e12:.2f} TFLOP/s")
    print(f"speed-up tiled/rows at T={T}: {res['rows'][0] / res['tiled'][0]:.2f}x")
    a, b = res["tiled"][1], res["rows"][1]
    assert float(cp.abs(a - b).max()) < 1e-4 * float(cp.abs(b).max())
