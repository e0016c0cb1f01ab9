"""gemv_kq_mt (kernels/gemv.cu, the multi-token K-quant GEMV of batched decode) emulated in NumPy, lane
by lane: its grid, warp and lane indexing, the loop over super-blocks (uniform over a warp, the 8 lanes
of a row group on one super-block), the shuffle gather of d / dmin, the integer dot products, the
8-lane reduction and the shared-memory epilogue, run on repacked random K-quant rows (kquant_layout.py)
and q8_1 activations, against dequantize-then-matmul in fp64. Also gemv_mt's loop (Q8_0: rows of any
number of 32-value blocks) and build.kq_passes, the split of T tokens into launches. The GPU itself runs the kernel in tests/gpu/test_gemv_multi.py."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.kernels import kquant_layout as L
from minecart.kernels.build import GEMV_KQ_MT, GEMV_KQ_MT_TOKENS, GEMV_MT, kq_passes

from tests.kernels.test_kquant_layout import emulate_block_ints, kq_dd_shift, random_blocks


def f16(bits: int) -> np.float32:
    return np.float32(np.array([bits], np.uint16).view(np.float16)[0])


def quantize_q8_1(x: np.ndarray):
    """quantize_q8_1 (common.cuh q8_1_block): int8 per 32 values, d = amax / 127, s = d * sum(q)."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32).astype(np.float32)
    d = (np.abs(xb).max(axis=2) / np.float32(127.0)).astype(np.float32)
    q = np.where(d[..., None] > 0, np.rint(xb / np.where(d > 0, d, 1)[..., None]), 0).astype(np.int8)
    s = (d * q.astype(np.float32).sum(axis=2)).astype(np.float32)
    return q.reshape(T, K), d, s


def emulate_gemv_kq_mt(wq, wd, type_name: str, R: int, K: int, xq, xd, xs, NT: int, WPR: int, NU: int,
                       res=None) -> np.ndarray:
    """y (NT, R) as gemv_kq_mt<QT, NT, WPR, NU> computes it (fp32 arithmetic in its order)."""
    RPB = 16 // WPR
    nb, nsb = K // 32, K // 256
    y = np.full((NT, R), np.nan, np.float32)
    n_blocks = -(-R * WPR // 16)  # ops.matmul's grid
    for bx in range(n_blocks):
        part = np.full((4, 4, NT), np.nan, np.float32)
        for warp in range(4):
            sub = warp % WPR
            acc = np.zeros((32, NT), np.float32)
            rows = [bx * RPB + (warp // WPR) * 4 + (lane >> 3) for lane in range(32)]
            trips = 0
            for j0 in range(sub, nsb, WPR * NU):
                for u in range(NU):
                    j = j0 + WPR * u
                    if j >= nsb:
                        break
                    trips += 1
                    blocks = [8 * j + (lane & 7) for lane in range(32)]
                    # the shuffle gather: lane s shifts its entry's top nibble into place, xor 1, 2, 4
                    dd = [0] * 32
                    if type_name != "Q6_K":
                        for lane in range(32):
                            e = int(wd[rows[lane], blocks[lane]]) if rows[lane] < R else 0
                            dd[lane] = ((e >> 12) & 15) << kq_dd_shift(lane & 7)
                        for step in (1, 2, 4):
                            dd = [dd[lane] | dd[lane ^ step] for lane in range(32)]
                    for lane in range(32):
                        row, b = rows[lane], blocks[lane]
                        if row >= R:
                            continue  # loads nothing: every term 0
                        ints, d_bits = emulate_block_ints(wq, wd, type_name, K, row, b)
                        q = np.array(ints, "<u4").view(np.int8 if type_name == "Q6_K" else np.uint8).astype(np.int64)
                        e = int(wd[row, b])
                        if type_name == "Q6_K":
                            d = f16(d_bits)
                            sc = np.array([e & 0xFF, e >> 8], np.uint8).view(np.int8).astype(np.float32)
                            dlo, dhi = np.float32(d * sc[0]), np.float32(d * sc[1])
                        else:
                            dl = np.float32(f16(dd[lane] & 0xFFFF) * np.float32(e & 63))
                            m = -np.float32(f16(dd[lane] >> 16) * np.float32((e >> 6) & 63))
                        for t in range(NT):
                            xb = t * nb + b
                            xv = xq[t, 32 * b:32 * b + 32].astype(np.int64)
                            if type_name == "Q6_K":
                                lo = int(q[:16] @ xv[:16])
                                hi = int(q[16:] @ xv[16:])
                                inner = np.float32(np.float32(dlo * np.float32(lo)) + np.float32(dhi * np.float32(hi)))
                                acc[lane, t] = np.float32(acc[lane, t] + np.float32(xd[t, b] * inner))
                            else:
                                s = int(q @ xv)
                                acc[lane, t] = np.float32(acc[lane, t] + np.float32(np.float32(xd[t, b] * dl) * np.float32(s)))
                                acc[lane, t] = np.float32(acc[lane, t] + np.float32(m * xs.reshape(-1)[xb]))
            assert trips == len(range(sub, nsb, WPR)), "every super-block of the warp's share once"
            for step in (1, 2, 4):  # the row group's reduction; every lane ends with the group's sums
                acc = (acc + acc[[lane ^ step for lane in range(32)]]).astype(np.float32)
            for grp in range(4):
                part[warp, grp] = acc[8 * grp]
        for i in range(128):  # the epilogue threads
            if i >= RPB * NT:
                continue
            r, t = i // NT, i % NT
            w0, g = (r >> 2) * WPR, r & 3
            orow = bx * RPB + r
            if orow < R:
                v = part[w0, g, t]
                for k in range(1, WPR):
                    v = np.float32(v + part[w0 + k, g, t])
                assert np.isfinite(v), "the epilogue read a partial sum no warp wrote"
                y[t, orow] = v + res[t, orow] if res is not None else v
    return y


def sane_raw(type_name: str, R: int, K: int, rng) -> np.ndarray:
    raw = random_blocks(type_name, R, K, rng).reshape(-1, L.SUPER_BYTES[type_name])
    for off in ((208,) if type_name == "Q6_K" else (0, 2)):
        raw[:, off:off + 2] = (rng.uniform(0.5, 1.5, len(raw)) * 1e-3).astype("<f2").view(np.uint8).reshape(-1, 2)
    return raw.reshape(R, -1)


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
@pytest.mark.parametrize("wpr,nu", GEMV_KQ_MT)
def test_emulated_kernel_is_the_matmul(type_name, wpr, nu):
    """Odd row counts (37: the last block's rows past R; 5: one partial row group), K = 256 x 9 (Q6_K: a
    tail group of one super-block past the first 8), NT = 3, with and without the residual."""
    rng = np.random.default_rng(hash((type_name, wpr, nu)) % 2**32)
    for R, K, NT in ((37, 2304, 3), (5, 256, 2)):
        raw = sane_raw(type_name, R, K, rng)
        wq, wd = L.repack(raw, type_name, K)
        w = L.unpack(wq, wd, type_name, K).astype(np.float64)
        x = rng.standard_normal((NT, K)).astype(np.float32)
        xq, xd, xs = quantize_q8_1(x)
        xr = (xq.reshape(NT, -1, 32).astype(np.float64) * xd[..., None]).reshape(NT, K)
        want = xr @ w.T
        res = rng.standard_normal((NT, R)).astype(np.float32)
        for r in (None, res):
            got = emulate_gemv_kq_mt(wq, wd, type_name, R, K, xq, xd, xs, NT, wpr, nu, r)
            ref = want + (r if r is not None else 0)
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert err < 2e-6, f"{type_name} {R}x{K} NT={NT} {wpr}x{nu}: error {err:.2e}"


def test_passes_cover_the_tokens_in_compiled_sizes():
    for T in range(2, 65):
        p = kq_passes(T)
        assert len(p) == -(-T // 8)
        assert [t0 for t0, _ in p] == list(np.cumsum([0] + [n for _, n in p])[:-1])
        assert sum(n for _, n in p) == T
        assert all(n in GEMV_KQ_MT_TOKENS for _, n in p), (T, p)
        assert max(n for _, n in p) - min(n for _, n in p) <= 1
    with pytest.raises(ValueError):
        kq_passes(1)


@pytest.mark.parametrize("wpr,nu", GEMV_MT)
def test_gemv_mt_visits_every_block_once(wpr, nu):
    """gemv_mt's loop (gemv.cu): over the WPR warps of a row group, each of a row's nb blocks is read
    once, by lane s = b & 7 of the group, also when nb is not a multiple of 8 (the last round partial)."""
    for nb in (1, 7, 8, 9, 128, 129, 385):
        n8 = (nb + 7) >> 3
        seen = np.zeros(nb, np.int64)
        for sub in range(wpr):
            for j0 in range(sub, n8, wpr * nu):
                for u in range(nu):
                    for s in range(8):
                        b = 8 * (j0 + wpr * u) + s
                        if b < nb:  # the kernel's guard: lanes past the row end load and add nothing
                            assert b & 7 == s
                            seen[b] += 1
        assert (seen == 1).all(), f"nb={nb}: blocks visited {np.unique(seen)} times"
