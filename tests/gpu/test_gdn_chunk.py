"""The chunked Gated DeltaNet prefill kernels (kernels/gdn_chunk.py) against the token-serial scan
(ops.gdn_scan) and the NumPy specification, plus a timing print of both for the 9B shape.

Run with -s to see the numbers: max relative errors of outputs and final state, and ms per layer.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._reference import gdn_inputs as make_inputs

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


def max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the GPU result (an output left unwritten?)"
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def norm_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_both(inputs):
    from minecart.kernels import gdn_chunk, ops

    q, k, v, g, beta, s0 = (cp.asarray(a) for a in inputs)
    s_scan, s_chunk = s0.copy(), s0.copy()
    y_scan = ops.gdn_scan(q, k, v, g, beta, s_scan)
    # poison the pool so that an output or scratch row the kernels forget shows up as NaN
    cp.full(64 << 20, cp.nan, dtype=cp.float32)
    y_chunk = gdn_chunk.gdn_chunked(q, k, v, g, beta, s_chunk)
    return [cp.asnumpy(a) for a in (y_scan, s_scan, y_chunk, s_chunk)]


@pytest.mark.parametrize("T,n_k,n_v,dk,dv", [
    (1, 1, 3, 32, 32), (63, 1, 3, 64, 64), (64, 1, 3, 128, 128), (65, 1, 3, 128, 128),
    (200, 1, 3, 128, 128), (333, 2, 4, 32, 40), (257, 1, 3, 64, 72),
    (2048, 16, 32, 128, 128), (2049, 16, 32, 128, 128), (4096, 16, 32, 128, 128),
])
def test_chunked_matches_scan(T, n_k, n_v, dk, dv):
    rng = np.random.default_rng(T * 7 + dk + dv)
    inputs = make_inputs(rng, T, n_k, n_v, dk, dv)
    y_scan, s_scan, y_chunk, s_chunk = run_both(inputs)
    eo, es = max_rel(y_chunk, y_scan), max_rel(s_chunk, s_scan)
    print(f"\ngdn_chunk vs gdn_scan T={T} n_k={n_k} n_v={n_v} dk={dk} dv={dv}: "
          f"out max rel {eo:.2e} (norm {norm_rel(y_chunk, y_scan):.2e}), "
          f"state max rel {es:.2e} (norm {norm_rel(s_chunk, s_scan):.2e})")
    assert eo < 3e-4 and es < 3e-4
    assert norm_rel(y_chunk, y_scan) < 3e-5 and norm_rel(s_chunk, s_scan) < 3e-5


def test_chunked_reads_unaligned_views():
    """q and k as contiguous views that start 4 bytes into their buffers (the prep kernel reads their rows
    with 16-byte loads): the same results as from fresh arrays."""
    from minecart.kernels import gdn_chunk

    rng = np.random.default_rng(5)
    T, n_k, n_v, dk, dv = 300, 2, 4, 64, 64
    q, k, v, g, beta, s0 = (cp.asarray(a) for a in make_inputs(rng, T, n_k, n_v, dk, dv))
    views = []
    for a in (q, k):
        buf = cp.empty(a.size + 1, dtype=cp.float32)
        view = buf[1:].reshape(a.shape)
        view[...] = a
        assert view.flags.c_contiguous and view.data.ptr % 16 != 0
        views.append(view)
    s_ref, s_view = s0.copy(), s0.copy()
    y_ref = gdn_chunk.gdn_chunked(q, k, v, g, beta, s_ref)
    y_view = gdn_chunk.gdn_chunked(views[0], views[1], v, g, beta, s_view)
    assert cp.array_equal(y_ref, y_view) and cp.array_equal(s_ref, s_view)


@pytest.mark.parametrize("T", [70, 300])
def test_chunked_matches_numpy_spec(T):
    from minecart.engine.backends.numpy_backend import NumpyBackend

    rng = np.random.default_rng(T)
    inputs = make_inputs(rng, T, 2, 4, 128, 128)
    _, _, y_chunk, s_chunk = run_both(inputs)
    q, k, v, g, beta, s0 = inputs
    s_ref = s0.copy()
    ref = NumpyBackend().gdn_chunk(q, k, v, g, beta, s_ref)
    print(f"\ngdn_chunk vs NumPy spec T={T}: out {norm_rel(y_chunk, ref):.2e}, state {norm_rel(s_chunk, s_ref):.2e}")
    assert norm_rel(y_chunk, ref) < 1e-5 and norm_rel(s_chunk, s_ref) < 1e-5


def test_backend_dispatch_and_continuation():
    """CupyBackend.gdn_chunk takes the chunked path for long runs; decode continues from its state."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.backends.numpy_backend import NumpyBackend
    from minecart.kernels.gdn_chunk import GDN_CHUNK_MIN_TOKENS

    gb, nb = CupyBackend("cuda:0", probe=False), NumpyBackend()
    T = GDN_CHUNK_MIN_TOKENS + 37
    rng = np.random.default_rng(11)
    q, k, v, g, beta, s0 = make_inputs(rng, T + 3, 2, 4, 128, 128)
    s_np, s_gp = s0.copy(), gb.asarray(s0)
    ref = nb.gdn_chunk(q[:T], k[:T], v[:T], g[:T], beta[:T], s_np)
    y = gb.to_numpy(gb.gdn_chunk(*(gb.asarray(a[:T]) for a in (q, k, v, g, beta)), s_gp))
    assert norm_rel(y, ref) < 1e-5
    assert norm_rel(gb.to_numpy(s_gp), s_np) < 1e-5
    for t in range(T, T + 3):
        sl = slice(t, t + 1)
        r = nb.gdn_step(q[sl], k[sl], v[sl], g[sl], beta[sl], s_np)
        o = gb.gdn_step(*(gb.asarray(a[sl]) for a in (q, k, v, g, beta)), s_gp)
        assert norm_rel(gb.to_numpy(o), r) < 1e-5
    assert norm_rel(gb.to_numpy(s_gp), s_np) < 1e-5


def time_both(T: int) -> tuple[float, float]:
    """GPU seconds per call of (scan, chunked) for the 9B shape (n_k=16, n_v=32, dk=dv=128)."""
    from minecart.kernels import gdn_chunk, ops
    from minecart.kernels.probe import time_gpu

    n_k, n_v, dk = 16, 32, 128
    rs = cp.random.RandomState(3)
    q = rs.standard_normal((T, n_k, dk), dtype=cp.float32) * 0.01
    k = rs.standard_normal((T, n_k, dk), dtype=cp.float32) * 0.08
    v = rs.standard_normal((T, n_v, dk), dtype=cp.float32)
    g = -cp.abs(rs.standard_normal((T, n_v), dtype=cp.float32))
    b = rs.random_sample((T, n_v), dtype=cp.float32)
    st = cp.zeros((n_v, dk, dk), dtype=cp.float32)
    reps = 2 if T > 4096 else 5
    return (time_gpu(lambda: ops.gdn_scan(q, k, v, g, b, st), reps),
            time_gpu(lambda: gdn_chunk.gdn_chunked(q, k, v, g, b, st), reps))


def test_timing_scan_vs_chunk():
    """Prints ms per layer of both paths for the 9B shape."""
    for T in (128, 256, 512, 4096, 18432):
        t_scan, t_chunk = time_both(T)
        print(f"\nGDN 9B shape T={T}: scan {t_scan * 1e3:.3f} ms, chunked {t_chunk * 1e3:.3f} ms "
              f"({t_scan / t_chunk:.2f}x)")
