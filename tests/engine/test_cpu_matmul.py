"""engine/cpu_matmul.py: the few-rows float32 matmul of a batched CPU decode step, against float64
products and its NumPy twin, over odd and tail sizes (rows not a multiple of 4, weight rows not a
multiple of the block or of 4), several seeds; NaN propagation; bad shapes; the backend's routing."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import cpu_matmul as cm
from minecart.engine.backends.numpy_backend import NumpyBackend, NumpyWeight

needs_numba = pytest.mark.skipif(not cm.available(), reason="numba is not installed")


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


@needs_numba
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("T", [2, 3, 4, 5, 7, 8, 13, 16])
@pytest.mark.parametrize("N,K", [(1, 1), (3, 5), (17, 33), (64, 640), (261, 130)])
def test_kernel_matches_float64(seed, T, N, K):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    got = cm.rows_matmul(x, w)
    assert got.shape == (T, N) and got.dtype == np.float32
    assert _rel(got, ref) < 1e-6 * max(1.0, np.sqrt(K))
    assert _rel(got, cm.rows_matmul_twin(x, w)) < 1e-6 * max(1.0, np.sqrt(K))


@needs_numba
def test_parallel_kernel_equals_serial():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 96)).astype(np.float32)
    w = rng.standard_normal((1000, 96)).astype(np.float32)
    # the same per-element arithmetic, only the blocks shared among threads
    np.testing.assert_array_equal(cm.rows_matmul(x, w, threads=2), cm.rows_matmul(x, w, threads=1))


def test_python_kernel_blocking_tiny():
    """The kernel's Python source (no numba) on tiny sizes: the 4 x 4 tiles, the 1-3 weight rows left
    in a block and the zero padding of the activation rows cover every output exactly once."""
    rng = np.random.default_rng(4)
    for T4, N, K in [(4, 1, 3), (8, 19, 5), (4, 35, 2)]:
        x = rng.standard_normal((T4, K)).astype(np.float32)
        w = rng.standard_normal((N, K)).astype(np.float32)
        out = np.full((T4, N), np.nan, np.float32)  # poisoned: a skipped output stays NaN
        cm._kernel(x, w, out)
        np.testing.assert_allclose(out, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-5,
                                   atol=1e-5)


@needs_numba
def test_nan_and_inf_propagate():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 40)).astype(np.float32)
    w = rng.standard_normal((9, 40)).astype(np.float32)
    x[1, 7] = np.nan
    w[4, 2] = np.inf
    got = cm.rows_matmul(x, w)
    ref = x @ w.T
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))


@needs_numba
def test_bad_input_is_refused():
    w = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="2..16 rows"):
        cm.rows_matmul(np.ones((1, 8), np.float32), w)
    with pytest.raises(ValueError, match="2..16 rows"):
        cm.rows_matmul(np.ones((17, 8), np.float32), w)
    with pytest.raises(ValueError, match=r"x \(T, K\) and w \(N, K\)"):
        cm.rows_matmul(np.ones((2, 7), np.float32), w)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        cm.rows_matmul(np.ones((2, 8), np.float32), w.astype(np.float64))
    with pytest.raises(ValueError, match="C-contiguous float32"):
        cm.rows_matmul(np.ones((2, 4), np.float32), np.zeros((8, 4), np.float32).T.copy().T)


class _Info:
    """The few fields of a GGUF tensor record a NumpyWeight reads."""

    def __init__(self, data: np.ndarray):
        self.name = "blk.0.ffn_up.weight"
        self.type_name = "F32"
        self.shape = data.shape
        self.n_bytes = data.nbytes


@pytest.mark.parametrize("rows", [1, 2, 8, 16, 17, 40])
def test_backend_matmul_routes_and_agrees(rows):
    """NumpyBackend.matmul: 2-16 rows through the kernel (where numba is), others through BLAS; every
    shape equals BLAS's product to float32 rounding, with the kernel switched on or off."""
    rng = np.random.default_rng(rows)
    data = rng.standard_normal((300, 64)).astype(np.float32)
    w = NumpyWeight(_Info(data), "matmul", data)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    ref = x.astype(np.float64) @ data.astype(np.float64).T
    on, off = NumpyBackend(), NumpyBackend(rows_kernel=False)
    assert _rel(on.matmul(x, w), ref) < 1e-5
    np.testing.assert_array_equal(off.matmul(x, w), x @ data.T)
