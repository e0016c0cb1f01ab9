"""The MoE kernels of kernels/moe.cu against NumPy, on fresh random inputs, every DP4A expert format.

Each kernel is checked on the int8 inputs it was given (the q8_1 activations the GPU made, so only the
kernel's own arithmetic is compared: 2e-5, the DP4A tolerance of tests/gpu/test_kernels.py against its
exact emulation), and the whole routed-experts path against the float MoE (dequantized weights,
float64: 3e-2, as test_kernels.py's test_moe asks of DP4A). Awkward routings: experts with no pair, all
pairs on one expert (k = 1) or on the same k experts, T not a multiple of the 64-row tile, k = 1 and 8,
the decode (T <= 8) and prefill kernels, rows not a multiple of the 128-column tile. Outputs are
poisoned with NaN first (fixture `poison`).
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.gguf_file import TensorInfo

from tests.kernels.test_moe_emulation import BM, q8_1, q8_values, route, silu

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

TYPES = {"Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_K": Q.Q4_K, "Q6_K": Q.Q6_K}
# (gate, up or None for a fused gate/up stack, down) formats and (H, F) sizes they allow (K-quants need
# rows of 256 values); the Q8_0/Q4_0 sizes leave partial 128-column tiles (160 rows, 2 x 96 rows)
FORMATS = [("Q8_0", None, "Q8_0", 160, 96), ("Q4_0", "Q4_0", "Q4_0", 160, 96),
           ("Q4_K", None, "Q6_K", 512, 256), ("Q6_K", "Q6_K", "Q4_K", 256, 256),
           ("Q4_K", "Q4_K", "Q8_0", 256, 96), ("Q8_0", "Q8_0", "Q4_0", 256, 96)]
FMT_IDS = [f"{g}-{u or 'fused'}-{d}" for g, u, d, _, _ in FORMATS]


def nerr(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the GPU result (an output left unwritten?)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def gb():
    from minecart.engine.backends.cupy_backend import CupyBackend

    return CupyBackend("cuda:0", probe=False)


def stack(gb, rng, type_name: str, E: int, R: int, K: int, std: float = 0.1):
    """A random expert stack (E, R, K) in `type_name`: (QWeight on the device, dense float64)."""
    vals = (rng.standard_normal((E, R, K)) * std).astype(np.float32)
    raw = Q.quantize(vals, TYPES[type_name])
    info = TensorInfo(name="exps", ggml_type=TYPES[type_name], type_name=type_name, shape=(E, R, K),
                      raw=raw.reshape(-1, raw.shape[-1]), n_bytes=int(raw.nbytes))
    return gb.load_weight(info, role="experts").q, Q.dequantize(info).astype(np.float64)


def dev_q8(x: np.ndarray):
    """The GPU's q8_1 of x and the float64 values it stands for."""
    from minecart.kernels import ops

    q8 = ops.quantize_q8_1(cp.asarray(x))
    return q8, q8_values(cp.asnumpy(q8[0]), cp.asnumpy(q8[1]))


# ---- moe_sort ------------------------------------------------------------------------------------

@pytest.mark.parametrize("E,T,k,how", [(8, 1, 1, "random"), (256, 4096, 8, "random"), (64, 100, 8, "one"),
                                       (300, 37, 8, "skewed"), (3, 1000, 1, "random"), (16, 0, 4, "random"),
                                       (512, 700, 10, "random"), (2000, 50, 8, "random")])
def test_sort(poison, E, T, k, how):
    from minecart.kernels import moe

    rng = np.random.default_rng(E + T + k)
    ids, _ = route(rng, T, E, k, how)
    poison()
    srt = moe.sort_pairs(cp.asarray(ids), E)
    ref = np.bincount(ids, minlength=E)
    assert np.array_equal(cp.asnumpy(srt.counts), ref)
    assert np.array_equal(cp.asnumpy(srt.offsets), np.concatenate([[0], np.cumsum(ref)]))
    assert np.array_equal(cp.asnumpy(srt.perm), np.argsort(ids, kind="stable"))
    want = [(e, r0) for e in range(E) for r0 in range(0, int(ref[e]), BM)]
    n = int(cp.asnumpy(srt.n_tiles)[0])
    assert n == len(want) <= srt.max_tiles
    got = list(zip(cp.asnumpy(srt.tile_e)[:n].tolist(), cp.asnumpy(srt.tile_r0)[:n].tolist(), strict=True))
    assert got == want


# ---- the grouped GEMM -----------------------------------------------------------------------------

@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("T,k,E,how", [(9, 1, 4, "random"), (70, 8, 16, "random"), (130, 8, 8, "one"),
                                       (300, 1, 5, "one"), (200, 2, 64, "skewed")])
@pytest.mark.parametrize("nblk", [1, 2])
def test_grouped_matmul(gb, poison, type_name, T, k, E, how, nblk):
    from minecart.kernels import moe

    rng = np.random.default_rng(hash((type_name, T, k, nblk)) % 2**32)
    K = 512 if type_name in ("Q4_K", "Q6_K") else 96
    R = 200 if type_name in ("Q4_K", "Q6_K") else 130
    w, W = stack(gb, rng, type_name, E, R, K)
    ids, _ = route(rng, T, E, k, how)
    P = T * k
    srt = moe.sort_pairs(cp.asarray(ids), E)
    perm = cp.asnumpy(srt.perm)
    # gate/up: activation rows gathered by token, outputs in sorted order
    x = rng.standard_normal((T, K)).astype(np.float32)
    q8, xv = dev_q8(x)
    poison()
    y = cp.asnumpy(moe.grouped_matmul(q8, w, srt, k, gather=True, scatter=False, nblk=nblk))
    ref = np.stack([W[ids[p]] @ xv[p // k] for p in perm])
    assert y.shape == (P, R) and nerr(y, ref) < 2e-5
    # down: activation rows already sorted, outputs back in pair order
    xs = rng.standard_normal((P, K)).astype(np.float32)
    q8s, xsv = dev_q8(xs)
    poison()
    y2 = cp.asnumpy(moe.grouped_matmul(q8s, w, srt, 1, gather=False, scatter=True, nblk=nblk))
    ref2 = np.empty((P, R))
    ref2[perm] = np.stack([W[ids[p]] @ xsv[s] for s, p in enumerate(perm)])
    assert nerr(y2, ref2) < 2e-5


def test_swiglu_q8(poison):
    from minecart.kernels import moe, ops

    rng = np.random.default_rng(1)
    P, F = 77, 96
    gu = cp.asarray((rng.standard_normal((P, 2 * F)) * 3).astype(np.float32))
    poison()
    h, (hq, hd, hs) = moe.swiglu_q8(gu[:, :F], gu[:, F:], F, want_h=True)
    g, u = cp.asnumpy(gu[:, :F]).astype(np.float64), cp.asnumpy(gu[:, F:]).astype(np.float64)
    assert nerr(cp.asnumpy(h), silu(g) * u) < 1e-5  # __expf
    rq, rd, rs = ops.quantize_q8_1(h)  # the same q8_1_block: bit-identical
    assert np.array_equal(cp.asnumpy(hq), cp.asnumpy(rq))
    assert np.array_equal(cp.asnumpy(hd), cp.asnumpy(rd)) and np.array_equal(cp.asnumpy(hs), cp.asnumpy(rs))


# ---- decode kernels --------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("T,k", [(1, 1), (1, 8), (3, 2), (8, 8)])
def test_decode_gate_up(gb, poison, fmt, T, k):
    from minecart.kernels import moe, ops

    gt, ut, _, H, F = fmt
    rng = np.random.default_rng(hash((fmt, T, k)) % 2**32)
    E = 12
    gate, Wg = stack(gb, rng, gt, E, F if ut else 2 * F, H)
    up, Wu = stack(gb, rng, ut, E, F, H) if ut else (None, Wg[:, F:])
    Wg = Wg[:, :F]
    ids, _ = route(rng, T, E, k, "random")
    q8, xv = dev_q8(rng.standard_normal((T, H)).astype(np.float32))
    poison()
    h, (hq, hd, hs) = moe.gate_up_q8(q8, gate, up, cp.asarray(ids), k, want_h=True)
    ref = np.stack([silu(Wg[ids[p]] @ xv[p // k]) * (Wu[ids[p]] @ xv[p // k]) for p in range(T * k)])
    assert nerr(cp.asnumpy(h), ref) < 2e-5
    rq, rd, rs = ops.quantize_q8_1(h)
    assert np.array_equal(cp.asnumpy(hq), cp.asnumpy(rq))
    assert np.array_equal(cp.asnumpy(hd), cp.asnumpy(rd)) and np.array_equal(cp.asnumpy(hs), cp.asnumpy(rs))


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("T,k", [(1, 1), (1, 8), (5, 3), (8, 8)])
def test_decode_down_sum(gb, poison, type_name, T, k):
    from minecart.kernels import moe

    rng = np.random.default_rng(hash((type_name, T, k)) % 2**32)
    E, H = 10, 130
    F = 256 if type_name in ("Q4_K", "Q6_K") else 96
    down, Wd = stack(gb, rng, type_name, E, H, F)
    ids, wts = route(rng, T, E, k, "random")
    hq8, hv = dev_q8(rng.standard_normal((T * k, F)).astype(np.float32))
    poison()
    out = cp.asnumpy(moe.down_sum(hq8, down, cp.asarray(ids), cp.asarray(wts), T, k))
    ref = np.stack([sum(float(wts[t * k + s]) * (Wd[ids[t * k + s]] @ hv[t * k + s]) for s in range(k))
                    for t in range(T)])
    assert out.shape == (T, H) and nerr(out, ref) < 2e-5


# ---- the whole routed-experts path ----------------------------------------------------------------

def float_moe(x, ids, wts, Wg, Wu, Wd, k):
    T = x.shape[0]
    x = x.astype(np.float64)
    out = np.zeros((T, Wd.shape[1]))
    for p in range(T * k):
        e, t = ids[p], p // k
        out[t] += wts[p] * (Wd[e] @ (silu(Wg[e] @ x[t]) * (Wu[e] @ x[t])))
    return out


def q8_chain(xv, ids, wts, Wg, Wu, Wd, k):
    """The DP4A path's arithmetic: the GPU's int8 x, h in fp32 requantized to q8_1, exact products."""
    T = xv.shape[0]
    h = np.stack([(silu(Wg[ids[p]] @ xv[p // k]) * (Wu[ids[p]] @ xv[p // k])) for p in range(T * k)])
    hq, hd, _ = q8_1(h.astype(np.float32))
    hv = q8_values(hq, hd)
    out = np.zeros((T, Wd.shape[1]))
    for p in range(T * k):
        out[p // k] += wts[p] * (Wd[ids[p]] @ hv[p])
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("T,k,how", [(1, 8, "random"), (8, 1, "one"), (9, 8, "random"), (77, 1, "one"),
                                     (130, 8, "one"), (300, 8, "skewed")])
def test_routed_experts(gb, poison, fmt, T, k, how):
    from minecart.kernels import moe

    gt, ut, dt, H, F = fmt
    rng = np.random.default_rng(hash((fmt, T, k, how)) % 2**32)
    E = 16
    gate, Wg = stack(gb, rng, gt, E, F if ut else 2 * F, H)
    up, Wu = stack(gb, rng, ut, E, F, H) if ut else (None, Wg[:, F:])
    Wg = Wg[:, :F]
    down, Wd = stack(gb, rng, dt, E, H, F)
    assert moe.supported(gate, up, down)
    ids, wts = route(rng, T, E, k, how)
    x = rng.standard_normal((T, H)).astype(np.float32)
    _, xv = dev_q8(x)
    poison()
    out = cp.asnumpy(moe.routed_experts(cp.asarray(x), cp.asarray(ids), cp.asarray(wts), gate, up, down, k))
    assert out.shape == (T, H)
    e_float = nerr(out, float_moe(x, ids, wts, Wg, Wu, Wd, k))
    e_chain = nerr(out, q8_chain(xv, ids, wts, Wg, Wu, Wd, k))
    print(f"\nrouted experts {fmt[:3]} T={T} k={k} {how}: vs float {e_float:.2e}, vs q8 chain {e_chain:.2e}")
    assert e_float < 3e-2
    # h is requantized: an h value within fp32 noise of a rounding tie may land on the other int8 step
    # (one such step moves one token's output by ~2e-3 at F = 96); nothing else differs
    assert e_chain < 5e-3


@pytest.mark.parametrize("fmt", FORMATS[:3], ids=FMT_IDS[:3])
def test_decode_and_prefill_kernels_agree(gb, fmt):
    """The same 8 tokens through the decode kernels (T = 8) and, with a ninth token, the prefill ones."""
    from minecart.kernels import moe

    gt, ut, dt, H, F = fmt
    rng = np.random.default_rng(5)
    E, k = 16, 8
    gate, _ = stack(gb, rng, gt, E, F if ut else 2 * F, H)
    up = stack(gb, rng, ut, E, F, H)[0] if ut else None
    down, _ = stack(gb, rng, dt, E, H, F)
    ids, wts = route(rng, 9, E, k, "random")
    x = cp.asarray(rng.standard_normal((9, H)).astype(np.float32))
    dec = moe.routed_experts(x[:8].copy(), cp.asarray(ids[:64]), cp.asarray(wts[:64]), gate, up, down, k)
    pre = moe.routed_experts(x, cp.asarray(ids), cp.asarray(wts), gate, up, down, k)
    assert nerr(cp.asnumpy(pre[:8]), cp.asnumpy(dec)) < 2e-3  # h requantized, as above


@pytest.mark.parametrize("T", [1, 8, 40])
def test_routed_experts_in_a_cuda_graph(gb, T):
    """Captured once (as the decode step is), replayed on new activations and routings: equal to eager
    runs. Nothing may synchronize or size an allocation by the routing while capturing."""
    from minecart.kernels import moe
    from minecart.kernels.probe import begin_capture

    rng = np.random.default_rng(T)
    E, k, H, F = 16, 8, 256, 256
    gate, _ = stack(gb, rng, "Q4_K", E, 2 * F, H)
    down, _ = stack(gb, rng, "Q6_K", E, H, F)
    ids0, wts0 = route(rng, T, E, k, "random")
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    ids, wts = cp.asarray(ids0), cp.asarray(wts0)
    stream = cp.cuda.Stream(non_blocking=False)
    pool = cp.get_default_memory_pool()
    kept: list = []

    def keep_alloc(size):
        mem = pool.malloc(size)
        kept.append(mem)
        return mem

    moe.routed_experts(x.copy(), ids, wts, gate, None, down, k)  # modules compiled and loaded before capture
    cp.cuda.Device().synchronize()
    with stream:
        cp.cuda.set_allocator(keep_alloc)
        try:
            begin_capture(stream)
            try:
                out = moe.routed_experts(x, ids, wts, gate, None, down, k)
            finally:
                graph = stream.end_capture()
        finally:
            cp.cuda.set_allocator(pool.malloc)
        for rep in range(3):
            new_ids, new_wts = route(rng, T, E, k, "one" if rep == 1 else "random")
            x[...] = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
            ids[...] = cp.asarray(new_ids)
            wts[...] = cp.asarray(new_wts)
            graph.launch(stream)
            stream.synchronize()
            eager = moe.routed_experts(x.copy(), ids, wts, gate, None, down, k)
            stream.synchronize()
            assert nerr(cp.asnumpy(out), cp.asnumpy(eager)) < 1e-6


def test_mixed_gate_up_formats_are_not_taken(gb):
    """moe_gate_up_q8 exists for equal gate/up formats only: others are refused (the backend then takes
    the per-pair GEMVs, as test_kernels.py's test_moe checks)."""
    from minecart.kernels import moe

    rng = np.random.default_rng(2)
    gate, _ = stack(gb, rng, "Q8_0", 4, 32, 256)
    up, _ = stack(gb, rng, "Q4_K", 4, 32, 256)
    down, _ = stack(gb, rng, "Q8_0", 4, 256, 32)
    assert not moe.supported(gate, up, down) and moe.supported(gate, None, down)
    ids, wts = route(rng, 2, 4, 2, "random")
    with pytest.raises(ValueError, match="one format"):
        moe.routed_experts(cp.zeros((2, 256), cp.float32), cp.asarray(ids), cp.asarray(wts), gate, up, down, 2)


@pytest.mark.parametrize("T", [1, 6, 40])
def test_backend_moe_matches_numpy(gb, T):
    """CupyBackend.moe (router, top-k, these kernels) against the NumPy backend's float MoE."""
    from minecart.engine.backends.numpy_backend import NumpyBackend

    rng = np.random.default_rng(T + 100)
    E, H, F, k = 16, 256, 256, 4

    def info(name, shape, tid, std):
        raw = Q.quantize((rng.standard_normal(shape) * std).astype(np.float32), tid)
        return TensorInfo(name=name, ggml_type=tid, type_name=Q.type_name(tid), shape=shape,
                          raw=raw.reshape(-1, raw.shape[-1]), n_bytes=int(raw.nbytes))

    infos = [info("router", (E, H), Q.F32, 0.5), info("gate", (E, F, H), Q.Q4_K, 0.1),
             info("up", (E, F, H), Q.Q4_K, 0.1), info("down", (E, H, F), Q.Q6_K, 0.1)]
    x = rng.standard_normal((T, H)).astype(np.float32)
    nb = NumpyBackend(int_experts=False)
    wn = [nb.load_weight(infos[0])] + [nb.load_weight(i, role="experts") for i in infos[1:]]
    ref = nb.moe(x, *wn, k)
    wg = [gb.load_weight(infos[0], role="matmul")] + [gb.load_weight(i, role="experts") for i in infos[1:]]
    got = gb.to_numpy(gb.moe(gb.asarray(x), *wg, k))
    assert nerr(got, ref) < 3e-2


def test_bench_moe_smoke(gb):
    """bench_moe runs both paths, and they agree (a small shape; the 35B-A3B one is for the lead)."""
    from minecart.kernels import moe

    recs = moe.bench_moe(tokens=(1, 8, 100), H=256, E=16, k=4, F=256, repeats=2)
    assert [r["T"] for r in recs] == [1, 8, 100]
    for r in recs:
        assert r["old_ms"] > 0 and r["new_ms"] > 0 and r["max_rel_diff"] < 3e-2
