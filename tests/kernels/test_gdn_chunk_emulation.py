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


def emulate(q, k, v, g, beta, state, segment=GDN_CHUNK_SEGMENT):
    """gdn_chunk.gdn_chunked with the two launches replaced by the block emulations above."""
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
            state_block(blk, nch, scr, state, out, t_begin, T, n_v, DK, DV)
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


def test_dispatch_rule():
    assert not use_chunked(1, 128, 128)
    assert not use_chunked(100, 128, 128)
    assert use_chunked(4096, 128, 128)
    assert not use_chunked(4096, 16, 16)  # no chunked instantiation for dk = 16
    assert GDN_CHUNK_SEGMENT % GDN_CHUNK == 0
