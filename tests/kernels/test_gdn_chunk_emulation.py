"""A NumPy emulation of the chunked Gated DeltaNet kernels (kernels/gdn.cu gdn_chunk_prep and
gdn_chunk_state, launched by kernels/gdn_chunk.py), against the specification
(NumpyBackend.gdn_chunk and the token-by-token gdn_step).

The emulation follows the kernels' blocks, flat scratch layout and index formulas (segments, chunk rows
rb = (j * nch + c) * 64, zero rows past the end, the 32-column slices of the sequential part with the
value dim not a multiple of 32), so layout and algebra mistakes show up on the CPU. Runs without a GPU.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.kernels.gdn_chunk import GDN_CHUNK, GDN_CHUNK_SEGMENT, scratch_shapes, use_chunked

F32 = np.float32
CH = GDN_CHUNK


def prep_block(c, j, nch, q, k, v, g, beta, scr, t_begin, T, n_k, n_v, DK, DV):
    """gdn_chunk_prep for blockIdx = (c, j): fills this chunk's rows of the flat scratch arrays."""
    qf, kf, vf, gf, bf = (a.reshape(-1) for a in (q, k, v, g, beta))
    kh = j % n_k
    t0 = t_begin + c * CH
    n = min(CH, T - t0)
    tid = np.arange(CH)
    valid = tid < n
    tok = np.where(valid, t0 + tid, 0)
    gam = np.where(valid, gf[tok * n_v + j], 0).astype(F32)
    bet = np.where(valid, bf[tok * n_v + j], 0).astype(F32)
    s = F32(0)
    for i in range(CH):  # thread 0's serial sum
        s = F32(s + gam[i])
        gam[i] = s
    scr["decay"][j * nch + c] = np.exp(s)
    eg = np.exp(gam)
    ed = np.exp(gam[CH - 1] - gam)
    cols = np.arange(DK)
    src = ((tok[:, None] * n_k + kh) * DK + cols[None, :])  # (64, DK) flat indices
    Ks = np.where(valid[:, None], kf[src], 0).astype(F32)
    Qs = np.where(valid[:, None], qf[src], 0).astype(F32)
    aK, aQ = Ks @ Ks.T, Qs @ Ks.T
    i, jj = np.meshgrid(tid, tid, indexing="ij")
    d = np.where(jj <= i, np.exp(np.where(jj <= i, gam[i] - gam[jj], 0)), 0).astype(F32)
    As = np.where(jj < i, bet[i] * aK * d, 0).astype(F32)
    Ps = (aQ * d).astype(F32)
    # Tm = (I + A)^-1, thread m forward-substitutes column m
    Tm = np.zeros((CH, CH), F32)
    for m in range(CH):
        Tm[m, m] = 1
        for r in range(m + 1, CH):
            Tm[r, m] = -(As[r, m:r] @ Tm[m:r, m])
    R = (Ps @ Tm).astype(F32)
    # X = [beta e^gamma K | beta V], 32 columns per tile; [W | U] = Tm X, R X = [P W | P U]
    vsrc = (tok[:, None] * n_v + j) * DV + np.arange(DV)[None, :]
    X = np.concatenate([bet[:, None] * eg[:, None] * Ks,
                        np.where(valid[:, None], bet[:, None] * vf[vsrc], 0)], axis=1).astype(F32)
    x = np.zeros_like(X)
    y = np.zeros_like(X)
    for col0 in range(0, DK + DV, 32):
        tile = X[:, col0:col0 + 32]
        x[:, col0:col0 + 32] = Tm @ tile
        y[:, col0:col0 + 32] = R @ tile
    rb = (j * nch + c) * CH
    rows = rb + tid[:, None]
    scr["W"][rows * DK + cols] = x[:, :DK]
    scr["Mq"][rows * DK + cols] = eg[:, None] * Qs - y[:, :DK]
    scr["Kd"][rows * DK + cols] = Ks * ed[:, None]
    vcols = np.arange(DV)
    scr["U"][rows * DV + vcols] = x[:, DK:]
    scr["PU"][rows * DV + vcols] = y[:, DK:]


def state_block(blk, nch, scr, state, out, t_begin, T, n_v, DK, DV):
    """gdn_chunk_state for one block: value head j, 32 columns from c0 (masked past DV)."""
    slices = math.ceil(DV / 32)
    j, c0 = blk // slices, (blk % slices) * 32
    sp = state.reshape(-1)
    of = out.reshape(-1)
    cols = c0 + np.arange(32)
    live = cols < DV
    ccols = np.where(live, cols, 0)
    rows_k = np.arange(DK)
    base = j * DK * DV
    Sr = np.where(live[None, :], sp[base + rows_k[:, None] * DV + ccols[None, :]], 0).astype(F32)
    for c in range(nch):
        rb = (j * nch + c) * CH
        r = rb + np.arange(CH)
        Wc = scr["W"][r[:, None] * DK + rows_k[None, :]]
        Mc = scr["Mq"][r[:, None] * DK + rows_k[None, :]]
        acc = np.concatenate([Wc, Mc]) @ Sr  # (128, 32)
        t0 = t_begin + c * CH
        n = min(CH, T - t0)
        u = np.where(live[None, :], scr["U"][r[:, None] * DV + ccols[None, :]], 0)
        pu = np.where(live[None, :], scr["PU"][r[:, None] * DV + ccols[None, :]], 0)
        Vs = (u - acc[:CH]).astype(F32)
        o = acc[CH:] + pu
        for rr in range(n):
            dst = ((t0 + rr) * n_v + j) * DV + cols[live]
            of[dst] = o[rr, live]
        Kd = scr["Kd"][r[:, None] * DK + rows_k[None, :]]
        Sr = (scr["decay"][j * nch + c] * Sr + Kd.T @ Vs).astype(F32)
    sp[base + rows_k[:, None] * DV + cols[None, live]] = Sr[:, live]


def state_block_threads(blk, nch, scr, state, out, t_begin, T, n_v, DK, DV):
    """gdn_chunk_state for one block thread by thread: its 256 threads' index formulas (every thread at
    once, as arrays over tid), the staging buffer's tiles as the kernel stashes and reads them (a tile's
    float4 loads in flight while the one before is used), the state slice in Ss and the corrected values
    in Vs. The staging buffer is poisoned with NaN before each stash, so a read of an entry the stash
    did not write shows up in the results; a stash writing one entry twice fails at once."""
    RA = NKT = DK // 32
    NTILE, LDW, LDK, LDV = NKT + 2, 36, DK + 4, 36
    KQ = DK // 4
    KDL = 32 * KQ // 256
    stage = max(128 * LDW, 32 * LDK)
    tid = np.arange(256)
    tx, ty = tid & 7, tid >> 3
    wr, wk, kt, kk4 = tid >> 3, tid & 7, tid // KQ, tid % KQ
    f4 = np.arange(4)
    slices = math.ceil(DV / 32)
    j, c0 = blk // slices, (blk % slices) * 32
    sp, of = state.reshape(-1), out.reshape(-1)
    W, Mq, Kd = scr["W"], scr["Mq"], scr["Kd"]
    base = j * DK * DV
    col = c0 + 4 * tx[:, None] + f4[None, :]  # (256, 4): a thread's columns
    live = col < DV
    ccol = np.where(live, col, 0)
    srow = RA * ty[:, None] + np.arange(RA)[None, :]  # (256, RA): its state rows
    Sr = np.where(live[:, None, :], sp[base + srow[:, :, None] * DV + ccol[:, None, :]], 0).astype(F32)
    Ss = np.full(DK * 32, np.nan, F32)
    Ss[(srow * 32)[:, :, None] + 4 * tx[:, None, None] + f4] = Sr
    Vs = np.full(64 * LDV, np.nan, F32)

    def fetch(c, q):
        rb = (j * nch + c) * CH
        pf = np.zeros((256, 4, 4), F32)
        if q < NKT:
            w0 = (rb + wr) * DK + 32 * q + 4 * wk
            for i, (src, off) in enumerate(((W, 0), (W, 32 * DK), (Mq, 0), (Mq, 32 * DK))):
                pf[:, i] = src[(w0 + off)[:, None] + f4]
        else:
            k0 = (rb + 32 * (q - NKT) + kt) * DK + 4 * kk4
            for i in range(KDL):
                pf[:, i] = Kd[(k0 + (256 // KQ) * i * DK)[:, None] + f4]
        return pf

    def stash(q, pf, St):
        St[:] = np.nan
        if q < NKT:
            idx = np.stack([((wr + 32 * i) * LDW + 4 * wk)[:, None] + f4 for i in range(4)], 1)
            vals = pf
        else:
            idx = np.stack([((kt + (256 // KQ) * i) * LDK + 4 * kk4)[:, None] + f4 for i in range(KDL)], 1)
            vals = pf[:, :KDL]
        assert np.unique(idx).size == idx.size, "a stash writes an entry twice"
        St[idx] = vals

    St = np.full(stage, np.nan, F32)
    pf = fetch(0, 0) if nch > 0 else None
    a4 = np.arange(4)
    for c in range(nch):
        rb = (j * nch + c) * CH
        urow = rb + ty[:, None] + 32 * np.arange(2)[None, :]  # (256, 2)
        uu = np.where(live[:, None, :], scr["U"][urow[:, :, None] * DV + ccol[:, None, :]], 0).astype(F32)
        pp = np.where(live[:, None, :], scr["PU"][urow[:, :, None] * DV + ccol[:, None, :]], 0).astype(F32)
        dc = scr["decay"][j * nch + c]
        acc = np.zeros((256, 4, 4), F32)
        t0 = t_begin + c * CH
        n = min(CH, T - t0)
        for q in range(NTILE):
            if q == NKT:
                vrow = ty[:, None] + 32 * np.arange(2)[None, :]
                Vs[(vrow * LDV)[:, :, None] + 4 * tx[:, None, None] + f4] = uu - acc[:, :2]
                for a in range(2):
                    r = ty + 32 * a
                    ok = (r[:, None] < n) & live
                    dst = ((t0 + r[:, None]) * n_v + j) * DV + col
                    of[dst[ok]] = (acc[:, 2 + a] + pp[:, a])[ok]
                Sr = (Sr * dc).astype(F32)
            stash(q, pf, St)
            if q + 1 < NTILE:
                pf = fetch(c, q + 1)
            elif c + 1 < nch:
                pf = fetch(c + 1, 0)
            if q < NKT:
                s0 = 32 * q
                for kk in range(0, 32, 4):
                    w = St[((ty[:, None] + 32 * a4[None, :]) * LDW + kk)[:, :, None] + f4]  # (256, a, i)
                    sv = Ss[((s0 + kk + f4) * 32)[None, :, None] + 4 * tx[:, None, None] + f4]  # (256, i, b)
                    for i in range(4):
                        acc = (acc + w[:, :, i, None] * sv[:, None, i, :]).astype(F32)
            else:
                h = 32 * (q - NKT)
                for tt in range(32):
                    kv = St[(tt * LDK + RA * ty)[:, None] + np.arange(RA)]  # (256, RA)
                    vv = Vs[((h + tt) * LDV + 4 * tx)[:, None] + f4]  # (256, 4)
                    Sr = (Sr + kv[:, :, None] * vv[:, None, :]).astype(F32)
        Ss[(srow * 32)[:, :, None] + 4 * tx[:, None, None] + f4] = Sr
    dst = base + srow[:, :, None] * DV + ccol[:, None, :]
    keep = np.broadcast_to(live[:, None, :], dst.shape)
    sp[dst[keep]] = Sr[keep]


def emulate(q, k, v, g, beta, state, segment=GDN_CHUNK_SEGMENT, state_fn=state_block):
    """gdn_chunk.gdn_chunked with the two launches replaced by the block emulations above (state_fn: the
    sequential part's, block by block or thread by thread)."""
    T, n_k, DK = q.shape
    _, n_v, DV = v.shape
    out = np.full((T, n_v, DV), np.nan, F32)
    full = scratch_shapes(T, n_v, DK, DV)
    full = {name: tuple(min(s, math.ceil(segment / CH)) if i == 1 else s for i, s in enumerate(shape))
            for name, shape in full.items()}
    scr = {name: np.full(math.prod(shape), np.nan, F32) for name, shape in full.items()}
    for t_begin in range(0, T, segment):
        nch = math.ceil(min(segment, T - t_begin) / CH)
        for j in range(n_v):
            for c in range(nch):
                prep_block(c, j, nch, q, k, v, g, beta, scr, t_begin, T, n_k, n_v, DK, DV)
        for blk in range(n_v * math.ceil(DV / 32)):
            state_fn(blk, nch, scr, state, out, t_begin, T, n_v, DK, DV)
    return out


def make_inputs(rng, T, n_k, n_v, dk, dv):
    def unit(a):
        return a / np.linalg.norm(a, axis=-1, keepdims=True)

    q = (unit(rng.standard_normal((T, n_k, dk))) / np.sqrt(dk)).astype(F32)
    k = unit(rng.standard_normal((T, n_k, dk))).astype(F32)
    v = rng.standard_normal((T, n_v, dv)).astype(F32)
    g = -np.exp(rng.uniform(-4, 1, (T, n_v))).astype(F32)
    beta = rng.uniform(0, 1, (T, n_v)).astype(F32)
    s0 = (rng.standard_normal((n_v, dk, dv)) * 0.1).astype(F32)
    return q, k, v, g, beta, s0


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values (an output left unwritten?)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("T,n_k,n_v,dk,dv,segment", [
    (1, 1, 3, 32, 32, GDN_CHUNK_SEGMENT),
    (63, 1, 3, 32, 40, GDN_CHUNK_SEGMENT),
    (64, 2, 4, 64, 32, GDN_CHUNK_SEGMENT),
    (65, 1, 3, 32, 32, GDN_CHUNK_SEGMENT),
    (200, 2, 4, 32, 72, 128),
    (300, 1, 2, 128, 128, 128),
])
def test_emulation_matches_spec(T, n_k, n_v, dk, dv, segment):
    rng = np.random.default_rng(T + dk + dv)
    q, k, v, g, beta, s0 = make_inputs(rng, T, n_k, n_v, dk, dv)
    nb = NumpyBackend()
    s_ref = s0.copy()
    ref = nb.gdn_chunk(q, k, v, g, beta, s_ref)
    s_emu = s0.copy()
    y = emulate(q, k, v, g, beta, s_emu, segment)
    assert rel(y, ref) < 2e-5
    assert rel(s_emu, s_ref) < 2e-5
    # and the token-by-token recurrence
    s_step = s0.copy()
    step = nb.gdn_step(q, k, v, g, beta, s_step)
    assert rel(y, step) < 2e-5
    assert rel(s_emu, s_step) < 2e-5


@pytest.mark.parametrize("T,n_k,n_v,dk,dv,segment", [
    (1, 1, 2, 32, 32, GDN_CHUNK_SEGMENT),
    (70, 1, 2, 32, 40, GDN_CHUNK_SEGMENT),
    (130, 2, 2, 64, 72, 128),
    (129, 1, 1, 128, 128, GDN_CHUNK_SEGMENT),
])
def test_state_threads_match_the_block(T, n_k, n_v, dk, dv, segment):
    """gdn_chunk_state's thread-level schedule (16-byte tiles, the next one in flight, rows ty + 32a of
    [W; Mq] S0 and state rows RA ty .., columns 4 tx ..) computes what the block emulation does."""
    rng = np.random.default_rng(T * 3 + dk + dv)
    q, k, v, g, beta, s0 = make_inputs(rng, T, n_k, n_v, dk, dv)
    s_blk, s_thr = s0.copy(), s0.copy()
    y_blk = emulate(q, k, v, g, beta, s_blk, segment)
    y_thr = emulate(q, k, v, g, beta, s_thr, segment, state_fn=state_block_threads)
    assert rel(y_thr, y_blk) < 1e-5
    assert rel(s_thr, s_blk) < 1e-5


def test_dispatch_rule():
    assert not use_chunked(1, 128, 128)
    assert not use_chunked(100, 128, 128)
    assert use_chunked(4096, 128, 128)
    assert not use_chunked(4096, 16, 16)  # no chunked instantiation for dk = 16
    assert GDN_CHUNK_SEGMENT % GDN_CHUNK == 0
