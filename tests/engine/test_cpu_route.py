"""engine/cpu_experts.route: one decode token's MoE routing without BLAS, against the NumPy backend's
moe_route (the reference), and the backend's one-token MoE path that uses it.

Routers and tokens are fresh random float32 values of several sizes; the tie tests build exact ties on
purpose (dyadic values whose float64 dot products are exact in any summation order, and duplicated
router rows straddling the top-k cut), so both sides see the very same probabilities and only the
tie rule (lower index first) decides.
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import cpu_experts as C
from minecart.engine import quants as Q
from minecart.engine.backends.numpy_backend import NumpyBackend, NumpyWeight
from minecart.engine.gguf_file import TensorInfo

pytestmark = pytest.mark.skipif(not C.numba_available(), reason="numba is not installed")

SIZES = [(256, 2048, 8), (128, 512, 8), (60, 96, 4), (17, 32, 1), (5, 64, 5), (1, 32, 1)]


def _router(w: np.ndarray) -> NumpyWeight:
    """A float32 router weight (E, H) as the NumPy backend holds one."""
    w = np.ascontiguousarray(w, np.float32)
    return NumpyWeight(TensorInfo("router", Q.F32, "F32", w.shape, w.view(np.uint8), w.nbytes),
                       "matmul", w)


def _reference(x: np.ndarray, router: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids, w = NumpyBackend(int_experts=False).moe_route(x[None, :], _router(router), k)
    return ids[0], w[0]


def _check_same(x, router, k):
    ids_r, w_r = _reference(x, router, k)
    for fast in (True, False):
        ids, w = C.route(x, router, k, fast=fast)
        assert ids.dtype == np.int64 and w.dtype == np.float64 and ids.shape == w.shape == (k,)
        np.testing.assert_array_equal(ids, ids_r)
        np.testing.assert_allclose(w, w_r, rtol=1e-12, atol=0)
    return ids_r, w_r


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("E,H,k", SIZES)
def test_route_equals_moe_route(E, H, k, seed):
    rng = np.random.default_rng(seed)
    router = (rng.standard_normal((E, H)) * rng.uniform(0.01, 0.2)).astype(np.float32)
    for _ in range(2):
        x = (rng.standard_normal(H) * rng.uniform(0.5, 4)).astype(np.float32)
        ids, w = _check_same(x, router, k)
        assert len(set(ids.tolist())) == k and abs(w.sum() - 1) < 1e-12
        # the chosen are the k most probable
        logits = router.astype(np.float64) @ x.astype(np.float64)
        assert logits[ids].min() >= np.delete(logits, ids).max(initial=-np.inf)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("E,H,k", [(256, 2048, 8), (40, 64, 4), (9, 32, 3)])
def test_exact_ties_go_to_the_lower_index(E, H, k, seed):
    rng = np.random.default_rng(100 + seed)
    # values in 1/16 steps: every product and partial sum is exact in float64, in any order
    router = (rng.integers(-8, 9, (E, H)) / 16).astype(np.float32)
    x = (rng.integers(-8, 9, H) / 16).astype(np.float32)
    logits = router.astype(np.float64) @ x.astype(np.float64)
    order = np.argsort(-logits, kind="stable")
    # tie the k-th best with rows before and after it, and the best with one more row
    kth = int(order[k - 1])
    others = rng.choice(np.delete(np.arange(E), kth), size=min(3, E - 1), replace=False)
    router[others] = router[kth]
    if E > 4:
        top = int(np.argsort(-(router.astype(np.float64) @ x.astype(np.float64)), kind="stable")[0])
        router[rng.choice(np.delete(np.arange(E), [top, kth, *others]))] = router[top]
    ids, _ = _check_same(x, router, k)
    logits = router.astype(np.float64) @ x.astype(np.float64)
    tied = np.flatnonzero(logits == logits[kth])
    assert tied.size >= 2
    cut = logits[ids].min()
    chosen_at_cut = sorted(int(e) for e in ids if logits[e] == cut)
    at_cut = np.flatnonzero(logits == cut)
    assert chosen_at_cut == at_cut[: len(chosen_at_cut)].tolist()  # the lowest indices of the tie


def test_all_equal_logits_take_the_first_k():
    router = np.ones((12, 32), np.float32)
    x = np.full(32, 0.5, np.float32)
    ids, w = _check_same(x, router, 4)
    assert ids.tolist() == [0, 1, 2, 3] and np.all(w == 0.25)


def test_non_finite_token_gives_nan_weights_as_the_reference():
    rng = np.random.default_rng(7)
    router = rng.standard_normal((16, 64)).astype(np.float32)
    for bad in (np.nan, np.inf):
        x = rng.standard_normal(64).astype(np.float32)
        x[5] = bad
        with np.errstate(invalid="ignore"):  # inf - inf in the reference's softmax
            ids_r, w_r = _reference(x, router, 3)
        ids, w = C.route(x, router, 3)
        np.testing.assert_array_equal(ids, ids_r)
        assert np.isnan(w).all() and np.isnan(w_r).all()


def test_bad_input_is_refused():
    router = np.zeros((8, 32), np.float32)
    with pytest.raises(ValueError, match="cannot choose 0 of 8"):
        C.route(np.zeros(32, np.float32), router, 0)
    with pytest.raises(ValueError, match="cannot choose 9 of 8"):
        C.route(np.zeros(32, np.float32), router, 9)
    with pytest.raises(ValueError, match="token of 48 values"):
        C.route(np.zeros(48, np.float32), router, 2)


# ------------------------------------------------------------------------------------------------
# the NumPy backend's one-token MoE: routed by cpu_experts.route, never by moe_route's matrix product


def _expert_weight(rng, name, t, shape):
    bv, bb = Q.BLOCK_SIZES[t]
    raw = rng.integers(0, 256, (shape[0] * shape[1] * shape[2] // bv, bb), dtype=np.uint8)
    raw[:, 0:2] = (rng.standard_normal((raw.shape[0], 1)) * 1e-2).astype("<f2").view(np.uint8)
    raw = raw.reshape(shape[0], shape[1], -1)
    return NumpyWeight(TensorInfo(name, t, Q.type_name(t), shape, raw, raw.nbytes), "experts", None)


class _NoRefRoute(NumpyBackend):
    def moe_route(self, x, router, k):
        if np.asarray(x).shape[0] == 1:
            raise AssertionError("one token on the integer path must not route through moe_route")
        return super().moe_route(x, router, k)


def test_backend_one_token_moe_routes_with_the_kernel():
    rng = np.random.default_rng(3)
    E, H, F, k = 16, 64, 32, 4
    gate = _expert_weight(rng, "gate", Q.Q8_0, (E, F, H))
    up = _expert_weight(rng, "up", Q.Q8_0, (E, F, H))
    down = _expert_weight(rng, "down", Q.Q8_0, (E, H, F))
    router_w = (rng.standard_normal((E, H)) * 0.3).astype(np.float32)
    router = _router(router_w)
    be = _NoRefRoute(int_experts=True, expert_threads=2)
    x = rng.standard_normal((1, H)).astype(np.float32)
    y = be.moe(x, router, gate, up, down, k)
    ids, w = C.route(x[0], router_w, k)
    np.testing.assert_array_equal(ids, _reference(x[0], router_w, k)[0])
    stacks = [C.ExpertStack(np.asarray(m.info.raw), Q.Q8_0, m.shape[2]) for m in (gate, up, down)]
    expect = C.routed_experts(x[0], ids, w, *stacks, threads=2)
    np.testing.assert_array_equal(y, expect[None, :])
    # several tokens keep the reference route
    y2 = be.moe(np.repeat(x, 2, axis=0), router, gate, up, down, k)
    assert y2.shape == (2, H) and np.isfinite(y2).all()
