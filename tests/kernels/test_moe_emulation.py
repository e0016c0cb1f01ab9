"""NumPy twins of the MoE kernels of kernels/moe.cu, emulating their index maths, run on the CPU.

- `emulate_moe_sort`: moe_sort lane by lane (warp segments, the ballot-built match masks, per-warp
  ranks, the warp-0 scans, the tile list), checked against a stable argsort and the tile bound.
- `emulate_grouped_matmul`: moe_gemm_dp4a's tiles (64 sorted rows x 128 columns, clamped loads, gathered
  activation rows, scattered output rows), with the products in float64: every pair's row is written
  once and equals x[p // k] @ W[ids[p]]^T.
- `emulate_gate_up` / `emulate_down_sum`: the column and (slot, block) item maps of the decode kernels.
- `q8_1`: the q8_1 block quantization (common.cuh q8_1_block).
The whole DP4A MoE chain built from these agrees with the NumPy backend's float MoE. The GPU tests
(tests/gpu/test_moe_kernels.py) compare the kernels with these twins on the same int8 inputs.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BM, BN = 64, 128  # moe.cu MOE_BM / MOE_BN (checked below)
F32 = np.float32


def q8_1(x: np.ndarray):
    """(q int8, d f32, s f32) per 32-value block of the rows of x, as q8_1_block computes them."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32).astype(F32)
    amax = np.abs(xb).max(axis=2)
    d = (amax / F32(127.0)).astype(F32)
    safe = np.where(amax > 0, d, F32(1))[..., None]
    q = np.where(amax[..., None] > 0, np.rint((xb / safe).astype(F32)), 0).astype(np.int8)
    s = (d * q.astype(F32).sum(axis=2)).astype(F32)
    return q.reshape(T, K), d, s


def q8_values(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The values a q8_1 row stands for, float64 (T, K)."""
    T, K = q.shape
    return (q.reshape(T, K // 32, 32).astype(np.float64) * d[..., None].astype(np.float64)).reshape(T, K)


# ---- moe_sort ------------------------------------------------------------------------------------

def _match(keys: list[int], valid: list[bool], nbits: int) -> list[int]:
    """moe_match: per lane, the bit mask of valid lanes with its key, built one key bit at a time."""
    def ballot(pred):
        return sum(1 << i for i in range(32) if pred[i])

    m = [ballot(valid)] * 32
    for b in range(nbits):
        bits = [(k >> b) & 1 for k in keys]
        bal = ballot(bits)
        m = [m[i] & (bal if bits[i] else ~bal & 0xFFFFFFFF) for i in range(32)]
    return m


def max_tiles(P: int, E: int) -> int:
    return P // BM + min(E, P)


def emulate_moe_sort(ids: np.ndarray, E: int, nw: int):
    """moe_sort with nw warps -> (counts, offsets, perm, tiles [(e, r0)], n_tiles)."""
    ids = [int(v) for v in ids]
    P = len(ids)
    nt_max = max_tiles(P, E)
    nbits = max(0, (E - 1).bit_length())
    hist = np.zeros((nw, E), np.int64)
    seg = (P + nw - 1) // nw

    def walk(w, place):
        s0 = min(P, w * seg)
        s1 = min(P, s0 + seg)
        for base in range(s0, s1, 32):
            idx = [base + lane for lane in range(32)]
            valid = [i < s1 for i in idx]
            keys = [ids[i] if v else 0 for i, v in zip(idx, valid, strict=True)]
            m = _match(keys, valid, nbits)
            firsts = {lane: hist[w, keys[lane]] for lane in range(32) if valid[lane]}  # read before the update
            for lane in range(32):
                if not valid[lane]:
                    continue
                lt = (1 << lane) - 1
                if place is not None:
                    place[soff[keys[lane]] + firsts[lane] + bin(m[lane] & lt).count("1")] = idx[lane]
                if m[lane] & lt == 0:
                    hist[w, keys[lane]] += bin(m[lane]).count("1")

    soff = np.zeros(E + 1, np.int64)
    for w in range(nw):
        walk(w, None)
    counts = np.zeros(E, np.int64)
    for e in range(E):
        run = 0
        for v in range(nw):
            h = hist[v, e]
            hist[v, e] = run
            run += h
        counts[e] = run
    carry = tcarry = 0
    stile = np.zeros(E + 1, np.int64)
    for e0 in range(0, E, 32):  # warp 0's chunked scans
        c = [int(counts[e]) if e < E else 0 for e in range(e0, e0 + 32)]
        nt = [(v + BM - 1) // BM for v in c]
        inc, tinc = np.cumsum(c), np.cumsum(nt)
        for lane in range(32):
            if e0 + lane < E:
                soff[e0 + lane] = carry + inc[lane] - c[lane]
                stile[e0 + lane] = tcarry + tinc[lane] - nt[lane]
        carry += int(inc[31])
        tcarry += int(tinc[31])
    soff[E] = carry
    n_tiles = min(tcarry, nt_max)
    tiles: list[tuple[int, int] | None] = [None] * max(nt_max, 1)
    for e in range(E):
        for j in range((int(counts[e]) + BM - 1) // BM):
            t = int(stile[e]) + j
            if t < nt_max:
                tiles[t] = (e, j * BM)
    perm = np.full(P, -1, np.int64)
    for w in range(nw):
        walk(w, perm)
    return counts, soff.copy(), perm, tiles[:n_tiles], n_tiles


# ---- the tiled products ---------------------------------------------------------------------------

def emulate_grouped_matmul(x: np.ndarray, W: np.ndarray, srt, x_div: int, gather: bool, scatter: bool):
    """moe_gemm_dp4a's tiles over the products, float64. x: (rows, K) activation values; W (E, R, K).
    srt: emulate_moe_sort's result. Returns (y (P, R), writes per element)."""
    counts, offsets, perm, tiles, n_tiles = srt
    P = len(perm)
    _, R, _ = W.shape
    y = np.full((P, R), np.nan)
    writes = np.zeros((P, R), np.int64)
    for tile in range(n_tiles):
        e, r0 = tiles[tile]
        s_base = offsets[e] + r0
        nrows = min(BM, offsets[e + 1] - s_base)
        for by in range(math.ceil(R / BN)):
            c0 = by * BN
            wrows = [min(c0 + lr, R - 1) for lr in range(BN)]  # clamped weight loads
            xrows = []
            for lr in range(BM):
                s = s_base + min(lr, nrows - 1)  # clamped activation loads
                xrows.append(perm[s] // x_div if gather else s)
            tile_y = x[xrows] @ W[e][wrows].T  # (BM, BN)
            for m in range(BM):
                if m >= nrows:
                    continue
                s = s_base + m
                yrow = perm[s] if scatter else s
                for j in range(BN):
                    c = c0 + j
                    if c < R:
                        y[yrow, c] = tile_y[m, j]
                        writes[yrow, c] += 1
    return y, writes


def silu(v):
    return v / (1.0 + np.exp(-v))


def emulate_gate_up(x: np.ndarray, Wg: np.ndarray, Wu: np.ndarray, up0: int, F: int, ids, x_div: int):
    """moe_gate_up_q8's blocks (32 columns of h per pair), float64: Wg (E, RG, K), Wu (E, RU, K)."""
    P = len(ids)
    h = np.full((P, F), np.nan)
    for p in range(P):
        e = int(ids[p])
        xr = x[p // x_div]
        for cb in range(F // 32):
            for w in range(8):
                for jj in (0, 2):
                    for j in (cb * 32 + w * 4 + jj, cb * 32 + w * 4 + jj + 1):
                        h[p, j] = silu(Wg[e, j] @ xr) * (Wu[e, up0 + j] @ xr)
    return h


def emulate_down_sum(h: np.ndarray, Wd: np.ndarray, ids, wts, T: int, k: int):
    """moe_down_sum's lane walk over (slot, block) items, float64: h (P, F) values, Wd (E, H, F)."""
    _, H, F = Wd.shape
    nb = F // 32
    n = k * nb
    out = np.full((T, H), np.nan)
    for t in range(T):
        for c in range(H):
            acc = np.zeros(32)
            for lane in range(32):
                for i0 in range(lane, n, 128):
                    for u in range(4):
                        i = i0 + 32 * u
                        if i >= n:
                            break
                        p, b = t * k + i // nb, i % nb
                        sl = slice(32 * b, 32 * b + 32)
                        acc[lane] += wts[p] * (Wd[int(ids[p]), c, sl] @ h[p, sl])
            out[t, c] = acc.sum()
    return out


def route(rng, T: int, E: int, k: int, how: str):
    """(ids (T k,), wts (T k,)) with distinct experts per token: random, all on the first k experts,
    or skewed toward a few."""
    if how == "one" or T == 0:
        ids = np.tile(np.arange(k), T)
    else:
        p = None
        if how == "skewed":
            p = 1.0 / np.arange(1, E + 1) ** 1.5
            p /= p.sum()
        ids = np.concatenate([rng.choice(E, size=k, replace=False, p=p) for _ in range(T)])
    w = rng.random((T, k)) + 0.05
    return ids.astype(np.int32), (w / w.sum(axis=1, keepdims=True)).reshape(-1).astype(F32)


# ---- tests ---------------------------------------------------------------------------------------

def test_constants_match_the_kernel_source():
    cu = (ROOT / "kernels" / "moe.cu").read_text()
    py = (ROOT / "kernels" / "moe.py").read_text()
    assert re.search(r"#define MOE_BM (\d+)", cu).group(1) == str(BM)
    assert re.search(r"#define MOE_BN (\d+)", cu).group(1) == str(BN)
    assert f"MOE_BM = {BM}" in py and f"MOE_BN = {BN}" in py


@pytest.mark.parametrize("E", [1, 3, 8, 40, 256])
@pytest.mark.parametrize("P", [0, 1, 5, 33, 130, 700])
@pytest.mark.parametrize("nw", [1, 3, 16])
def test_sort_is_a_stable_counting_sort(E, P, nw):
    rng = np.random.default_rng(E * 1000 + P * 7 + nw)
    for ids in (rng.integers(0, E, P), np.full(P, E - 1), np.minimum(rng.geometric(0.3, P) - 1, E - 1)):
        counts, offsets, perm, tiles, n_tiles = emulate_moe_sort(ids, E, nw)
        ref = np.bincount(ids, minlength=E)
        assert np.array_equal(counts, ref)
        assert np.array_equal(offsets, np.concatenate([[0], np.cumsum(ref)]))
        assert np.array_equal(perm, np.argsort(ids, kind="stable"))
        want = [(e, r0) for e in range(E) for r0 in range(0, int(ref[e]), BM)]
        assert tiles == want and n_tiles == len(want) <= max_tiles(P, E)


def test_tile_bound_is_tight():
    """Every expert one row past a tile: the most tiles a routing can need, exactly the bound."""
    E = 7
    ids = np.repeat(np.arange(E), BM + 1)
    *_, n_tiles = emulate_moe_sort(ids, E, 4)
    assert n_tiles == 2 * E == max_tiles(len(ids), E)


@pytest.mark.parametrize("T,k,E,how", [(9, 1, 4, "random"), (70, 8, 16, "random"), (50, 8, 8, "one"),
                                       (130, 2, 32, "skewed"), (13, 3, 64, "random")])
@pytest.mark.parametrize("R", [96, 130])
def test_grouped_tiles_cover_every_pair_once(T, k, E, how, R):
    rng = np.random.default_rng(T * k + E + R)
    K = 64
    ids, _ = route(rng, T, E, k, how)
    x = rng.standard_normal((T, K))
    W = rng.standard_normal((E, R, K))
    srt = emulate_moe_sort(ids, E, 5)
    ref = np.stack([W[ids[p]] @ x[p // k] for p in range(T * k)])
    # gate/up: gathered inputs, sorted outputs
    y, writes = emulate_grouped_matmul(x, W, srt, k, gather=True, scatter=False)
    assert np.all(writes == 1)
    assert np.allclose(y, ref[srt[2]], rtol=1e-12, atol=1e-12)
    # down: sorted inputs, outputs back in pair order
    xs = x[srt[2] // k]
    y2, writes2 = emulate_grouped_matmul(xs, W, srt, 1, gather=False, scatter=True)
    assert np.all(writes2 == 1)
    assert np.allclose(y2, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k,F", [(1, 32), (8, 64), (3, 96), (8, 512), (2, 4096)])
def test_decode_kernels_cover_every_column_and_item(k, F):
    rng = np.random.default_rng(k * F)
    T, E, H, K = 2, 9, 5, 64
    ids, wts = route(rng, T, E, k, "random")
    x = rng.standard_normal((T, K))
    fused = rng.standard_normal((E, 2 * F, K))
    h = emulate_gate_up(x, fused, fused, F, F, ids, k)
    ref = np.stack([silu(fused[ids[p], :F] @ x[p // k]) * (fused[ids[p], F:] @ x[p // k])
                    for p in range(T * k)])
    assert np.allclose(h, ref, rtol=1e-12, atol=1e-12)
    Wd = rng.standard_normal((E, H, F))
    out = emulate_down_sum(h, Wd, ids, wts, T, k)
    want = np.stack([sum(wts[t * k + s] * (Wd[ids[t * k + s]] @ h[t * k + s]) for s in range(k))
                     for t in range(T)])
    assert np.allclose(out, want, rtol=1e-10, atol=1e-10)


def test_q8_1_twin_round_trip():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 96)) * 3).astype(F32)
    x[1, :32] = 0.0  # an all-zero block: d = 0, q = 0
    q, d, s = q8_1(x)
    assert d[1, 0] == 0 and not q[1, :32].any()
    assert np.abs(q8_values(q, d) - x).max() <= np.abs(x).max() / 127 / 2 * 1.0001
    assert np.allclose(s, d * q.reshape(3, 3, 32).sum(axis=2))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("T,k", [(1, 1), (6, 2), (20, 4)])
def test_dp4a_moe_chain_matches_the_float_moe(fused, T, k):
    """The DP4A chain (q8_1 x, sort, grouped gate/up, SwiGLU, q8_1 h, grouped down, combine in slot
    order) in NumPy against the NumPy backend's MoE (dequantize, float64): the design is the MoE."""
    from minecart.engine import quants as Q
    from minecart.engine.backends.numpy_backend import NumpyBackend
    from minecart.engine.gguf_file import TensorInfo

    rng = np.random.default_rng(T * 10 + k + fused)
    E, H, F = 8, 256, 96

    def tensor(name, shape, tid, std):
        raw = Q.quantize((rng.standard_normal(shape) * std).astype(F32), tid)
        return TensorInfo(name=name, ggml_type=tid, type_name=Q.type_name(tid), shape=shape,
                          raw=raw.reshape(-1, raw.shape[-1]), n_bytes=int(raw.nbytes))

    router = tensor("router", (E, H), Q.F32, 0.5)
    gate = tensor("gate", (E, 2 * F if fused else F, H), Q.Q8_0, 0.1)
    up = None if fused else tensor("up", (E, F, H), Q.Q4_0, 0.1)
    down = tensor("down", (E, H, F), Q.Q8_0, 0.1)
    x = rng.standard_normal((T, H)).astype(F32)
    nb = NumpyBackend(int_experts=False)
    ws = [nb.load_weight(router)] + [None if t is None else nb.load_weight(t, role="experts")
                                     for t in (gate, up, down)]
    ref = nb.moe(x, ws[0], ws[1], ws[2], ws[3], k)
    ids2, w2 = nb.moe_route(x, ws[0], k)
    ids, wts = ids2.reshape(-1), w2.reshape(-1)
    Wg = Q.dequantize(gate).astype(np.float64)
    Wu = Wg[:, F:] if fused else Q.dequantize(up).astype(np.float64)
    Wg = Wg[:, :F]
    Wd = Q.dequantize(down).astype(np.float64)
    srt = emulate_moe_sort(ids, E, 2)
    xv = q8_values(*q8_1(x)[:2])
    g, _ = emulate_grouped_matmul(xv, Wg, srt, k, True, False)
    u, _ = emulate_grouped_matmul(xv, Wu, srt, k, True, False)
    hq, hd, _ = q8_1(silu(g).astype(F32) * u.astype(F32))
    y, _ = emulate_grouped_matmul(q8_values(hq, hd), Wd, srt, 1, False, True)
    out = np.stack([sum(wts[t * k + s] * y[t * k + s] for s in range(k)) for t in range(T)])
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 3e-2
