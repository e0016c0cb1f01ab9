"""NumPy twins of the MoE decode-block kernels of kernels/moe.cu (moe_dec_*), run on the CPU.

- `emulate_route`: the top-k routing every moe_dec_gate_up block runs (each warp's logits ranked among
  themselves, its first k the candidates, the candidates ranked among themselves; ties to the lower
  index), checked against a stable argsort of the logits and the NumPy backend's weights, on random
  rows, ties inside a warp and across warps, a whole top-k in one warp, -inf logits, E below and above
  the warp width, k = 1 .. 32.
- `router_rows` / `gate_up_columns` / `down_items`: the index maps of moe_dec_router, moe_dec_gate_up and
  moe_dec_down, each output written once, each item read once.
- The decode block as a whole (routing, routed experts, shared expert, residual) in float64 from these
  maps equals the NumPy backend's composed MoE block (base.compose_moe_block).
The GPU tests (tests/gpu/test_moe_decode.py) check the kernels themselves against float64 math.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DEC_MAX_K = 32  # moe.cu MOE_DEC_MAXK, moe.py DEC_MAX_K (checked below)
DEC_MAX_E = 512  # moe.py DEC_MAX_E: one logit a thread of moe_dec_gate_up's 512 (checked below)
DOWN_U = 5  # moe.cu MOE_DEC_DOWN_U: moe_dec_down's items a lane in flight (checked below)
WARPS_GATE_UP = 16  # warps of a moe_dec_gate_up / moe_dec_router block (512 threads)
NAN = np.float32(np.nan)


def _ranks(vals: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """moe_dec_rank for every pair: how many pairs rank before it (a larger value, or an equal one at a
    lower index); NaN ranks before nothing."""
    c, v = vals[None, :], vals[:, None]
    return ((c > v) | ((c == v) & (idx[None, :] < idx[:, None]))).sum(axis=1)


def emulate_route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (k,), wts (k,)) of one token as moe_dec_gate_up selects them: each warp's 32 logits ranked
    among themselves (their first k are the candidates), the candidates ranked among themselves, ranks
    below k taken; warp 0's softmax max and sum; ranks no logit fills get expert E - 1 at -inf."""
    E = logits.size
    assert E <= DEC_MAX_E
    nw = -(-E // 32)
    v = np.full(32 * nw, NAN)
    v[:E] = logits.astype(np.float32)
    cand_v = np.full(nw * k, NAN)
    cand_i = np.zeros(nw * k, np.int64)
    for w in range(nw):
        wv, wi = v[32 * w:32 * w + 32], np.arange(32 * w, 32 * w + 32)
        for lane, r in enumerate(_ranks(wv, wi)):
            if r < k and not np.isnan(wv[lane]):
                cand_v[w * k + r], cand_i[w * k + r] = wv[lane], wi[lane]
    sel_v, sel_i = np.full(k, -np.inf, np.float32), np.full(k, E - 1)
    for c, r in enumerate(_ranks(cand_v, cand_i)):
        if r < k and not np.isnan(cand_v[c]):
            sel_v[r], sel_i[r] = cand_v[c], cand_i[c]
    sp = logits.astype(np.float32)
    mx = np.float32(np.max(sp))
    s = np.float32(np.exp((sp - mx).astype(np.float64)).sum())
    ps = [np.float32(np.exp(np.float64(bv) - np.float64(mx))) / s for bv in sel_v]
    sel = np.float32(sum(ps))
    wts = np.array(ps, np.float32) * np.float32(1.0 / max(sel, np.float32(6.1e-5)))
    return sel_i, wts


def reference_route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy backend's routing (moe_route) on given logits, float64."""
    lg = logits.astype(np.float64)
    p = np.exp(lg - lg.max())
    p /= p.sum()
    ids = np.argsort(-p, kind="stable")[:k]
    w = p[ids] / max(p[ids].sum(), 6.1e-5)
    return ids, w


def router_rows(E: int, shared: bool, H: int = 2048) -> list[int]:
    """moe_dec_router: the logit rows its router blocks write (block bx: rows 4 bx + lane for lanes < 4
    of warp 0), each checked to be summed from all H / 4 float4 columns exactly once by its 4 warps."""
    nr = E + int(shared)
    nrb = -(-nr // 4)
    rows = []
    for bx in range(nrb):
        cols: dict[int, list[int]] = {}
        for w in range(16):
            r = bx * 4 + w // 4
            if r >= nr:
                continue
            part = w % 4
            for lane in range(32):
                for i0 in range(part * 32 + lane, H // 4, 128 * 4):
                    cols.setdefault(r, []).extend(i0 + 128 * u for u in range(4) if i0 + 128 * u < H // 4)
        for lane in range(4):
            r = bx * 4 + lane
            if r < nr:
                assert sorted(cols[r]) == list(range(H // 4))
                rows.append(r)
    return rows


def gate_up_columns(F: int) -> list[int]:
    """moe_dec_gate_up / moe_dec_router's shared blocks: the h columns block cb's warps write."""
    return [cb * 32 + 2 * w + j for cb in range(F // 32) for w in range(WARPS_GATE_UP) for j in range(2)]


def down_items(k: int, nb: int, nbs: int) -> tuple[list[tuple[int, int]], list[int]]:
    """moe_dec_down: the (slot, block) routed items and the shared blocks one warp's lanes read."""
    nr, n = k * nb, k * nb + nbs
    routed, shared = [], []
    for lane in range(32):
        for i0 in range(lane, n, 32 * DOWN_U):
            for u in range(DOWN_U):
                i = i0 + 32 * u
                if i >= n:
                    break
                if i < nr:
                    routed.append((i // nb, i % nb))
                else:
                    shared.append(i - nr)
    return routed, shared


# ---- tests ---------------------------------------------------------------------------------------

def test_constants_match_the_kernel_source():
    cu = (ROOT / "kernels" / "moe.cu").read_text()
    py = (ROOT / "kernels" / "moe.py").read_text()
    assert re.search(r"#define MOE_DEC_MAXK (\d+)", cu).group(1) == str(DEC_MAX_K)
    assert f"DEC_MAX_K = {DEC_MAX_K}" in py
    assert f"DEC_MAX_E = {DEC_MAX_E}" in py and DEC_MAX_E == 32 * 16
    assert re.search(r"#define MOE_DEC_DOWN_U (\d+)", cu).group(1) == str(DOWN_U)
    # 16 warps, two columns each: one q8_1 block of h per block
    assert "__launch_bounds__(512) moe_dec_gate_up" in cu and "__launch_bounds__(512) moe_dec_router" in cu
    assert "(F // 32, P), (512,)" in py


@pytest.mark.parametrize("E,k", [(256, 8), (8, 2), (3, 3), (100, 8), (512, 10), (64, 32), (40, 1), (33, 33)])
@pytest.mark.parametrize("seed", [0, 1])
def test_route_equals_a_stable_top_k(E, k, seed):
    if k > DEC_MAX_K:
        pytest.skip("above the decode block's top-k")
    rng = np.random.default_rng(seed * 1000 + E + k)
    logits = rng.standard_normal(E).astype(np.float32)
    ids, wts = emulate_route(logits, k)
    rid, rw = reference_route(logits, k)
    assert np.array_equal(ids, rid)
    np.testing.assert_allclose(wts, rw, rtol=1e-5)


@pytest.mark.parametrize("how", ["same_warp", "across_warps", "one_warp", "all_equal", "neg_inf", "many_ties"])
def test_route_ties_go_to_the_lower_expert(how):
    rng = np.random.default_rng(7)
    E, k = 256, 8
    logits = rng.standard_normal(E).astype(np.float32)
    if how == "same_warp":  # experts 5, 9 and 30 share warp 0 and the top value
        logits[[30, 5, 9]] = 9.0
    elif how == "across_warps":  # 200, 3 and 40 in three warps
        logits[[200, 3, 40]] = 9.0
    elif how == "one_warp":  # the whole top-8 in warp 2, two of them tied
        logits[64:72] = [5.0, 9.0, 7.0, 7.0, 6.0, 8.0, 10.0, 4.5]
    elif how == "all_equal":
        logits[:] = 0.5
    elif how == "neg_inf":  # only 3 finite logits: the rest ties at -inf, taken in index order
        logits[:] = -np.inf
        logits[[250, 17, 100]] = [1.0, 2.0, 1.0]
    else:  # a few values shared by many experts
        logits = rng.integers(0, 4, E).astype(np.float32)
    ids, wts = emulate_route(logits, k)
    stable = np.argsort(-logits.astype(np.float64), kind="stable")[:k]
    assert np.array_equal(ids, stable)
    assert len(set(ids.tolist())) == k
    if how != "neg_inf":
        np.testing.assert_allclose(wts, reference_route(logits, k)[1], rtol=1e-5)
    else:
        assert np.all(wts[3:] == 0) and np.isclose(wts[:3].sum(), 1.0)


@pytest.mark.parametrize("E,shared,H", [(256, True, 2048), (256, False, 32), (8, True, 160), (17, False, 4096)])
def test_router_rows_written_once(E, shared, H):
    rows = router_rows(E, shared, H)
    assert sorted(rows) == list(range(E + int(shared)))


@pytest.mark.parametrize("F", [32, 96, 512])
def test_gate_up_columns_written_once(F):
    assert sorted(gate_up_columns(F)) == list(range(F))


@pytest.mark.parametrize("k,nb,nbs", [(8, 16, 16), (8, 16, 0), (2, 1, 1), (1, 3, 5), (10, 48, 16)])
def test_down_items_read_once(k, nb, nbs):
    routed, shared = down_items(k, nb, nbs)
    assert sorted(routed) == [(s, b) for s in range(k) for b in range(nb)]
    assert sorted(shared) == list(range(nbs))


def test_decode_block_maps_match_the_composed_block():
    """The block built from these maps in float64 (per-pair h, weighted down items, shared expert,
    residual) equals NumpyBackend's composed moe_block on the same weights."""
    from minecart.engine.backends.base import MoeShared, compose_moe_block
    from minecart.engine.backends.numpy_backend import NumpyBackend

    rng = np.random.default_rng(3)
    T, H, E, k, F, Fs = 3, 64, 12, 3, 64, 32
    x = rng.standard_normal((T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32)
    router, sgi = rng.standard_normal((E, H)).astype(np.float32) * 0.3, rng.standard_normal((1, H)).astype(np.float32)
    Wg, Wu, Wd = (rng.standard_normal(s).astype(np.float32) * 0.2 for s in ((E, F, H), (E, F, H), (E, H, F)))
    Sg, Su, Sd = (rng.standard_normal(s).astype(np.float32) * 0.2 for s in ((Fs, H), (Fs, H), (H, Fs)))

    # the maps, float64
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    logits = np.concatenate([x.astype(np.float64) @ router.T.astype(np.float64),
                             x.astype(np.float64) @ sgi.T.astype(np.float64)], axis=1)
    assert sorted(router_rows(E, True, H)) == list(range(E + 1))
    out = np.zeros((T, H))
    for t in range(T):
        ids, wts = reference_route(logits[t, :E], k)
        h = np.zeros((k, F))
        for s, e in enumerate(ids):
            for j in gate_up_columns(F):
                h[s, j] = silu(Wg[e, j] @ x[t].astype(np.float64)) * (Wu[e, j] @ x[t].astype(np.float64))
        hs = np.zeros(Fs)
        for j in gate_up_columns(Fs):
            hs[j] = silu(Sg[j] @ x[t].astype(np.float64)) * (Su[j] @ x[t].astype(np.float64))
        routed_items, shared_items = down_items(k, F // 32, Fs // 32)
        for c in range(H):
            acc = sum(wts[s] * (Wd[ids[s], c, 32 * b:32 * b + 32] @ h[s, 32 * b:32 * b + 32]) for s, b in routed_items)
            acc_s = sum(Sd[c, 32 * b:32 * b + 32] @ hs[32 * b:32 * b + 32] for b in shared_items)
            out[t, c] = res[t, c] + (acc + acc_s / (1 + np.exp(-logits[t, E])))

    be = NumpyBackend(int_experts=False)

    def nw(a):
        from minecart.engine.gguf_file import TensorInfo

        raw = np.ascontiguousarray(a).view(np.uint8).reshape(*a.shape[:-1], a.shape[-1] * 4)
        info = TensorInfo(name="w", ggml_type=0, type_name="F32", shape=a.shape, raw=raw, n_bytes=int(a.nbytes))
        return be.load_weight(info, role="experts" if a.ndim == 3 else "matmul")

    shared = MoeShared(nw(sgi), nw(Sg), nw(Su), nw(Sd))
    ref = compose_moe_block(be, x, nw(router), nw(Wg), nw(Wu), nw(Wd), k, shared, res)
    np.testing.assert_allclose(out, np.asarray(ref, np.float64), rtol=2e-4, atol=2e-4)
