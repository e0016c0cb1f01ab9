"""engine/cpu_experts.py: the numba integer kernels against their NumPy twins (bit for bit), the twins
against `gguf.quants` dequantization and float64 products, and the tiny MoE model decoding on them.

Blocks are fresh random bytes of every type with random fp16 scales (finite, of both signs), odd row
counts and repeated expert ids. The bound used for twin vs gguf is derived in `_bounds`.
"""

from __future__ import annotations

import re
from dataclasses import replace

import gguf
import numpy as np
import pytest
from minecart.engine import cpu_experts as C
from minecart.engine import quants as Q
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.model import load_model

from tests._moe import tiny_moe_file

TYPES = [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_1, Q.Q5_1, Q.IQ4_NL, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]
SUPER_BLOCK_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)  # 256 values a block
U = 2.0**-24  # float32 unit roundoff


def _f16_bytes(rng, shape, scale):
    return (rng.standard_normal(shape) * scale).astype("<f2").view(np.uint8).reshape(*shape[:-1], 2)


def random_stack(rng, t, n_experts, n_out, n_in):
    """Random blocks of type t: random quants and sub-scales, random finite fp16 scales."""
    bv, bb = Q.BLOCK_SIZES[t]
    raw = rng.integers(0, 256, (n_experts, n_out, n_in // bv, bb), dtype=np.uint8)
    sh = (n_experts, n_out, n_in // bv, 1)
    if t in (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.IQ4_NL):
        raw[..., 0:2] = _f16_bytes(rng, sh, 0.02)
    elif t in (Q.Q4_1, Q.Q5_1):  # d and m
        raw[..., 0:2] = _f16_bytes(rng, sh, 0.02)
        raw[..., 2:4] = _f16_bytes(rng, sh, 0.1)
    elif t == Q.IQ4_XS:
        raw[..., 0:2] = _f16_bytes(rng, sh, 2e-3)
    elif t in (Q.Q4_K, Q.Q5_K):
        raw[..., 0:2] = _f16_bytes(rng, sh, 2e-3)
        raw[..., 2:4] = _f16_bytes(rng, sh, 2e-3)
    else:  # Q6_K: d at the end
        raw[..., 208:210] = _f16_bytes(rng, sh, 2e-4)
    return C.ExpertStack(raw.reshape(n_experts, n_out, -1), t, n_in)


def _n_in(t, seed=0):
    """Row lengths: K types 2, 1 or 3 super-blocks; the others 3, 10 or 17 blocks (the kernels take
    them 8 at a time, then one at a time: the tail alone, both, and two groups plus a tail)."""
    if t in SUPER_BLOCK_TYPES:
        return [512, 256, 768][seed]
    return [96, 320, 544][seed]


def _gguf_dense(w: C.ExpertStack) -> np.ndarray:
    deq = gguf.quants.dequantize(np.asarray(w.raw), gguf.GGMLQuantizationType(w.ggml_type))
    return np.asarray(deq, np.float64).reshape(w.n_experts, w.n_out, w.n_in)


_QUANTS_FROM = {Q.Q4_K: 16, Q.Q5_K: 16, Q.Q4_1: 4, Q.Q5_1: 4}  # affine types: where the quants start


def _offsets(w: C.ExpertStack) -> np.ndarray:
    """|offset| per weight of an affine type (0 for the others): dmin*m of a K-affine type, m of Q4_1 /
    Q5_1, decoded by gguf from the same blocks with every quant set to 0 (x = d*sc*0 - dmin*m, d*0 + m)."""
    if w.ggml_type not in _QUANTS_FROM:
        return np.zeros((w.n_experts, w.n_out, w.n_in))
    bb = Q.BLOCK_SIZES[w.ggml_type][1]
    raw = np.array(w.raw).reshape(w.n_experts, w.n_out, -1, bb)
    raw[..., _QUANTS_FROM[w.ggml_type]:] = 0
    return np.abs(_gguf_dense(C.ExpertStack(raw.reshape(w.raw.shape), w.ggml_type, w.n_in)))


def _bounds(dense, offs, x, xa: C.QuantizedRows):
    """Per output, the largest |twin - exact| the int8 path can produce, in two parts.

    Activation rounding: x_i is replaced by d_b*q_i with q_i = rint(x_i / d_b), d_b = amax_b / 127,
    so |x_i - d_b q_i| <= d_b / 2 (plus a few float32 roundings of d_b and x_i/d_b: 4u * amax_b).
    Over a row that is at most sum_b (d_b/2 + 4u amax_b) * ||w_b||_1.
    float32 arithmetic: each block term takes <= 4 roundings and the block sum one per block, so the
    error is <= (n_blocks + 4) u * sum_i (|w_i| + |dmin m|_i) |x^_i| (the K-quants' two products can
    cancel, hence their offsets in the magnitude).
    """
    k, n_in = x.shape
    d = xa.d.astype(np.float64)
    amax = np.abs(x.astype(np.float64)).reshape(k, -1, 32).max(axis=2)
    per_value = np.repeat(d / 2 + 4 * U * amax, 32, axis=1)  # (k, n_in)
    act = np.einsum("soi,si->so", np.abs(dense), per_value)
    xhat = xa.q.astype(np.float64) * np.repeat(d, 32, axis=1)
    mag = np.einsum("soi,si->so", np.abs(dense) + offs, np.abs(xhat))
    return act, (n_in // 32 + 4) * U * mag, xhat


def test_tiny_blocks_quantize_to_zeros():
    """A block whose scale amax/127 is below float32's normal range (its reciprocal would overflow to
    inf and the quants to garbage) quantizes to zeros; one just above it quantizes normally."""
    tiny = np.finfo(np.float32).tiny
    x = np.zeros((1, 128), np.float32)
    x[0, 0:32] = np.linspace(-1e-40, 1e-40, 32, dtype=np.float32)  # subnormal values
    x[0, 32:64] = np.linspace(-1e-37, 1e-37, 32, dtype=np.float32)  # normal, but amax / 127 < tiny
    x[0, 64:96] = np.linspace(-127 * 2 * tiny, 127 * 2 * tiny, 32, dtype=np.float32)  # scale 2 * tiny
    x[0, 96:128] = np.linspace(-3.0, 3.0, 32, dtype=np.float32)
    a, b = C.quantize_rows(x), C.quantize_rows(x, fast=False)
    for r in (a, b):
        assert not r.q[0, :64].any() and (r.s[0, :2] == 0).all()
        assert np.abs(r.q[0, 64:]).max() == 127
    np.testing.assert_array_equal(a.q, b.q)
    np.testing.assert_array_equal(a.d.view(np.int32), b.d.view(np.int32))
    np.testing.assert_array_equal(a.s, b.s)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_activation_quantizer_kernel_equals_twin(seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((5, 320)) * rng.uniform(0.01, 50, (5, 1))).astype(np.float32)
    x[1, 64:96] = 0.0  # an all-zero block: scale 0, quants 0
    x[2, ::7] *= 1e4  # outliers
    a, b = C.quantize_rows(x), C.quantize_rows(x, fast=False)
    np.testing.assert_array_equal(a.q, b.q)
    np.testing.assert_array_equal(a.d.view(np.int32), b.d.view(np.int32))
    np.testing.assert_array_equal(a.s, b.s)
    # the definition: |x - d q| <= d/2 (+ float32 slack), |q| <= 127, s the block sums
    err = np.abs(x.astype(np.float64) - a.q * np.repeat(a.d.astype(np.float64), 32, axis=1))
    assert np.all(err <= np.repeat(a.d, 32, axis=1) * (0.5 + 1e-6))
    assert np.abs(a.q.astype(np.int32)).max() == 127
    np.testing.assert_array_equal(a.s, a.q.astype(np.int32).reshape(5, -1, 32).sum(axis=2))
    assert a.d[1, 2] == 0 and not a.q[1, 64:96].any()


@pytest.mark.parametrize("t", TYPES, ids=[Q.type_name(t) for t in TYPES])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_equals_twin_bit_for_bit(t, seed):
    rng = np.random.default_rng(100 * t + seed)
    n_out = [7, 37, 13][seed]
    w = random_stack(rng, t, 5, n_out, _n_in(t, seed))
    ids = np.array([3, 0, 3, 4][: 2 + seed])  # a repeated expert, and several row counts
    x = (rng.standard_normal((ids.size, w.n_in)) * 2).astype(np.float32)
    xa = C.quantize_rows(x)
    fast = C.expert_matvec(w, ids, xa, threads=2)
    twin = C.expert_matvec(w, ids, xa, fast=False)
    assert fast.shape == (ids.size, n_out) and np.all(np.isfinite(fast))
    np.testing.assert_array_equal(fast.view(np.int32), twin.view(np.int32))


# an instruction only each form's code has (the plain-IR form: neither of the others')
_FORM_MARK = {"vnni": "vpdpbusd", "avx2": "vpmaddubsw"}


@pytest.mark.parametrize("form", ["vnni", "avx2", "ir"])
def test_every_dot_product_form_equals_twin(form, monkeypatch):
    """The byte products are summed by VNNI, AVX2 or plain IR, whichever the CPU has best. Every type's
    block code, compiled here with each form this CPU can run, gives the twins' bits: the one-row
    intrinsics through the matvec region (the down-sum region runs the same _dot_rows), the tile
    through its region; and the tile's code has the form's instructions (so the form really was the
    one compiled; the form is read when any intrinsic is compiled, so one kernel a type shows it)."""
    import numba

    best = C._dot4_kind()
    runs = {"vnni": ("vnni", "avx2", "ir"), "avx2": ("avx2", "ir"), "ir": ("ir",)}[best]
    if form not in runs:
        pytest.skip(f"this CPU has no {form} instructions")
    monkeypatch.setattr(C, "_DOT4", form)
    rng = np.random.default_rng(11)
    for t in TYPES:
        # compiled now, not cached; serial (prange as range): the same block code, compiled faster
        matvec = numba.njit(C._MATVEC[t].py_func)
        w = random_stack(rng, t, 4, 9, _n_in(t, 2))
        ids = np.array([2, 0, 2])
        xa = C.quantize_rows((rng.standard_normal((3, w.n_in)) * 3).astype(np.float32))
        out = np.full((1, 3, w.n_out), np.nan, np.float32)
        matvec(w.raw, w.raw, 1, ids, xa.q, xa.d, xa.s, 1, C._F16_TABLE, out)
        twin = C.expert_matvec(w, ids, xa, fast=False)
        np.testing.assert_array_equal(out[0].view(np.int32), twin.view(np.int32), err_msg=f"{form} {t}")
        tile = numba.njit(C._TILE[t].py_func)
        one = random_stack(rng, t, 1, 9, _n_in(t, 2))
        x = (rng.standard_normal((10, one.n_in)) * 3).astype(np.float32)  # two groups of lanes, one partial
        lanes = C._pack_lanes(C.quantize_rows(x), halves=t == Q.Q6_K)
        rows = np.full((10, one.n_out), np.nan, np.float32)
        tile(one.raw, lanes.x, lanes.d, lanes.s, lanes.h, lanes.rows, lanes.blocks, C._F16_TABLE, 3, rows)
        np.testing.assert_array_equal(rows.view(np.int32), C.dense_matmul(one, x, fast=False).view(np.int32),
                                      err_msg=f"{form} {t} tile")
        asm = tile.inspect_asm(tile.signatures[0])
        for f, mark in _FORM_MARK.items():
            assert (mark in asm) == (f == form), f"{form} {t}: {mark} {'missing' if f == form else 'present'}"


@pytest.mark.parametrize("t", [Q.Q4_K, Q.Q6_K], ids=["Q4_K", "Q6_K"])
def test_the_tile_takes_weight_words_by_broadcast_loads(t):
    """_tile_block_terms stores a row's unpacked block and loads its words back broadcast: the K-quant
    tile's code has its dot products and no shuffles that took the words out of registers (568 to 256
    in a Q4_K tile before)."""
    import numba

    if C._dot4_kind() != "vnni":
        pytest.skip("the count is for the VNNI form")
    tile = numba.njit(C._TILE[t].py_func)
    rng = np.random.default_rng(5)
    one = random_stack(rng, t, 1, 5, _n_in(t, 1))
    x = rng.standard_normal((8, one.n_in)).astype(np.float32)
    lanes = C._pack_lanes(C.quantize_rows(x), halves=t == Q.Q6_K)
    rows = np.empty((8, one.n_out), np.float32)
    tile(one.raw, lanes.x, lanes.d, lanes.s, lanes.h, lanes.rows, lanes.blocks, C._F16_TABLE, 1, rows)
    asm = tile.inspect_asm(tile.signatures[0])
    assert asm.count("vpdpbusd") >= 256
    assert asm.count("vpshufd") == 0 and asm.count("vpermq") == 0, (asm.count("vpshufd"), asm.count("vpermq"))


@pytest.mark.parametrize("t", TYPES, ids=[Q.type_name(t) for t in TYPES])
def test_two_stacks_in_one_region_equal_each_alone(t):
    """Gate and up of one type run in one parallel region: each output is the one-stack kernel's
    and the twin's, bit for bit (odd row count, repeated expert)."""
    rng = np.random.default_rng(300 + t)
    a, b = (random_stack(rng, t, 4, 13, _n_in(t, 1)) for _ in range(2))
    ids = np.array([1, 3, 1])
    xa = C.quantize_rows((rng.standard_normal((3, a.n_in)) * 2).astype(np.float32))
    out = np.full((2, 3, a.n_out), np.nan, np.float32)
    C._matvec([a, b], ids, xa.q, xa.d, xa.s, 2, out)
    for pair, w in zip(out, (a, b), strict=True):
        np.testing.assert_array_equal(pair.view(np.int32), C.expert_matvec(w, ids, xa).view(np.int32))
        np.testing.assert_array_equal(pair.view(np.int32), C.expert_matvec(w, ids, xa, fast=False).view(np.int32))
    with pytest.raises(ValueError, match="same type and shape"):
        C._matvec([a, random_stack(rng, t, 4, 12, _n_in(t, 1))], ids, xa.q, xa.d, xa.s, 1, out)


@pytest.mark.parametrize("t", TYPES, ids=[Q.type_name(t) for t in TYPES])
def test_one_activation_row_shared_by_every_slot(t):
    """x with one row (a token's x, quantized once) gives, for every slot, what that row repeated k
    times gives: kernel and twin, bit for bit."""
    rng = np.random.default_rng(400 + t)
    w = random_stack(rng, t, 5, 11, _n_in(t, 0))
    ids = np.array([4, 1, 4, 0])
    x = (rng.standard_normal((1, w.n_in)) * 2).astype(np.float32)
    one, rep = C.quantize_rows(x), C.quantize_rows(np.repeat(x, 4, axis=0))
    want = C.expert_matvec(w, ids, rep, fast=False)
    for fast in (True, False):
        np.testing.assert_array_equal(C.expert_matvec(w, ids, one, fast=fast).view(np.int32), want.view(np.int32))
    with pytest.raises(ValueError, match="activation rows"):
        C.expert_matvec(w, ids, C.quantize_rows(np.repeat(x, 2, axis=0)))


@pytest.mark.parametrize("t", TYPES, ids=[Q.type_name(t) for t in TYPES])
@pytest.mark.parametrize("n_out", [7, 37, 64])
def test_down_products_and_weighted_sum_in_one_region(t, n_out):
    """The down region (each output row: the slots' products times their weights, added in slot
    order) equals the twin (k products, then the float32 weighted sum) bit for bit, for every split
    of the rows into jobs: 1 to more jobs than row groups, a last job shorter than the others, rows
    repeated in a four-row group (7, 37) or not (64)."""
    rng = np.random.default_rng(500 + 3 * t + n_out)
    w = random_stack(rng, t, 6, n_out, _n_in(t, 1))
    ids = np.array([5, 2, 5, 0, 3])
    xa = C.quantize_rows((rng.standard_normal((5, w.n_in)) * 3).astype(np.float32))
    wts = rng.dirichlet(np.ones(5)).astype(np.float32)
    y = C.expert_matvec(w, ids, xa, fast=False)
    want = np.zeros(n_out, np.float32)
    for s in range(5):
        want += wts[s] * y[s]
    twin = C.weighted_matvec(w, ids, wts, xa, fast=False)
    np.testing.assert_array_equal(twin.view(np.int32), want.view(np.int32))
    for n_jobs in (1, 2, 3, 5, 16, 64):
        out = np.full(n_out, np.nan, np.float32)
        C._DOWN_SUM[t](w.raw, ids, wts, xa.q, xa.d, xa.s, C._F16_TABLE, n_jobs, out)
        np.testing.assert_array_equal(out.view(np.int32), want.view(np.int32), err_msg=f"{n_jobs} jobs")
    np.testing.assert_array_equal(C.weighted_matvec(w, ids, wts.astype(np.float64), xa, threads=2).view(np.int32),
                                  want.view(np.int32))


def _swiglu_inputs(rng, k, f):
    g = (rng.standard_normal((k, f)) * 4).astype(np.float32)
    u = rng.standard_normal((k, f)).astype(np.float32)
    # the edges: zeros of both signs, the clip at |g| = 708 and beyond, float32's largest values,
    # subnormals, non-finite g (h is NaN) and u
    g[0, :11] = [0.0, -0.0, 707.5, -707.5, 708.5, -708.5, 3e38, -3e38, 1e-40, -1e-40, -190.0]
    u[0, 7] = 1.0  # silu(-3e38) * 1: -0.0
    u[0, 10] = 3e38  # silu(-190) * 3e38 = -1.7e-42: a float32 subnormal, not zero
    g[1, :3] = [np.nan, np.inf, -np.inf]
    u[2, :3] = [np.nan, np.inf, -np.inf]
    return g, u


@pytest.mark.parametrize("fused", [False, True])
def test_swiglu_and_quantize_kernel_equals_twin(fused):
    """h = silu(g) * u and its int8 blocks in one compiled call equal the twins bit for bit, with
    gate and up as two stacks' outputs or as the halves of the fused stack's rows."""
    rng = np.random.default_rng(6)
    k, f = 5, 96
    g, u = _swiglu_inputs(rng, k, f)
    gu = np.concatenate([g, u], axis=1)[None] if fused else np.stack([g, u])
    q, d, s = C._row_buffers(k, f)
    q[:], d[:], s[:] = 99, np.nan, 99
    C._swiglu_quantize_nb(gu, 0 if fused else 1, f if fused else 0, f, q, d, s)
    h = C._swiglu_twin(g, u)
    want = C.quantize_rows(h, fast=False)
    np.testing.assert_array_equal(q, want.q)
    np.testing.assert_array_equal(d.view(np.int32), want.d.view(np.int32))
    np.testing.assert_array_equal(s, want.s)
    assert np.isnan(h[1, :3]).all() and np.isnan(d[1, 0]) and np.isnan(d[2, 0])
    with np.errstate(over="ignore"):
        assert h[0, 7] == 0 and np.signbit(h[0, 7]) and h[0, 6] == np.float32(3e38) * u[0, 6]
    assert -2e-42 < h[0, 10] < -1.5e-42


def test_swiglu_is_the_float64_formula_to_float32_rounding():
    """The twin's silu(g) * u (its own exp from IEEE operations, so kernel and twin agree to the bit)
    is the float64 formula rounded to float32 but for rare last-bit ties: within one float32 ulp of
    the backend's tanh form, equal to it almost always, where that form is accurate (g > -12: below,
    1 + tanh(g/2) cancels), and of g / (1 + exp(-g)) with NumPy's exp everywhere."""
    rng = np.random.default_rng(8)
    g = (rng.standard_normal((64, 4096)) * rng.uniform(0.1, 30, (64, 1))).astype(np.float32)
    u = rng.standard_normal((64, 4096)).astype(np.float32)
    h = C._swiglu_twin(g, u)
    gv = g.astype(np.float64)
    ref = (gv * (0.5 * (1.0 + np.tanh(0.5 * gv))) * u).astype(np.float32)
    ok = g > -12
    assert ok.mean() > 0.8 and (~ok).sum() > 1000
    ulp = np.spacing(np.abs(ref)).astype(np.float64)
    assert np.all((np.abs(h.astype(np.float64) - ref) <= ulp)[ok])
    assert np.mean((h != ref)[ok]) < 1e-4
    silu = gv / (1.0 + np.exp(-gv))  # with NumPy's exp
    err = np.abs(C._swiglu_twin(g, np.ones_like(u)) - silu)
    assert np.all(err <= np.spacing(np.abs(silu).astype(np.float32)))


@pytest.mark.parametrize("t", TYPES, ids=[Q.type_name(t) for t in TYPES])
@pytest.mark.parametrize("seed", [0, 1])
def test_twin_matches_gguf_dequantize_then_fp64(t, seed):
    rng = np.random.default_rng(200 * t + seed)
    w = random_stack(rng, t, 6, 11, _n_in(t))
    ids = np.array([5, 1, 2])
    x = (rng.standard_normal((3, w.n_in)) * rng.uniform(0.1, 10)).astype(np.float32)
    xa = C.quantize_rows(x, fast=False)
    twin = C.expert_matvec(w, ids, xa, fast=False).astype(np.float64)
    dense = _gguf_dense(w)[ids]
    act, fp32, xhat = _bounds(dense, _offsets(w)[ids], x, xa)
    # the weights: against the exact product with the same int8 activations, only float32 rounding
    on_xhat = np.einsum("soi,si->so", dense, xhat)
    assert np.all(np.abs(twin - on_xhat) <= fp32)
    # the whole path: against the float64 product with the float32 activations
    exact = np.einsum("soi,si->so", dense, x.astype(np.float64))
    err = np.abs(twin - exact)
    assert np.all(err <= act + fp32)
    assert err.max() > 0  # the activations really were rounded
    assert np.all(act < 0.05 * np.einsum("soi,si->so", np.abs(dense), np.abs(x)))  # and the bound is tight


def test_non_finite_activations_give_nan_outputs_not_garbage():
    """inf or NaN in a block: its scale is NaN and its quants 0 (no cast of NaN to int8), so every
    output row it enters is NaN, as the float reference's would be; other rows are untouched."""
    rng = np.random.default_rng(4)
    w = random_stack(rng, Q.Q4_K, 3, 5, 256)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    x[0, 40] = np.nan
    x[1, 200] = np.inf
    for fast in (True, False):
        xa = C.quantize_rows(x, fast=fast)
        assert np.isnan(xa.d[0, 1]) and np.isnan(xa.d[1, 6]) and np.isfinite(xa.d[0, [0, 2, 7]]).all()
        assert not xa.q[0, 32:64].any() and not xa.q[1, 192:224].any()
        assert np.isnan(C.expert_matvec(w, [2, 0], xa, fast=fast)).all()
    clean = C.quantize_rows(x[:, :32].repeat(8, axis=1))
    assert np.isfinite(C.expert_matvec(w, [2, 0], clean)).all()


def test_expert_stack_rejects_unsupported_types_and_bad_rows():
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match="F16"):
        C.ExpertStack(rng.integers(0, 256, (2, 3, 64), dtype=np.uint8), Q.F16, 32)
    with pytest.raises(ValueError, match="bytes per row"):
        C.ExpertStack(rng.integers(0, 256, (2, 3, 36), dtype=np.uint8), Q.Q8_0, 32)
    w = random_stack(rng, Q.Q8_0, 2, 3, 32)
    with pytest.raises(IndexError):
        C.expert_matvec(w, [2], C.quantize_rows(np.ones((1, 32), np.float32)))
    w = random_stack(rng, Q.Q8_0, 2, 3, 64)
    xa = C.quantize_rows(rng.standard_normal((1, 64)).astype(np.float32))
    with pytest.raises(ValueError, match="scales and sums"):
        C.expert_matvec(w, [0], C.QuantizedRows(xa.q, xa.d[:, :1], xa.s[:, :1]))
    # strided activations (the kernels read through data pointers): copied, same result
    wide = np.zeros((1, 128), np.int8)
    wide[:, ::2] = xa.q
    strided = C.QuantizedRows(wide[:, ::2], xa.d, xa.s)
    assert not strided.q.flags.c_contiguous
    np.testing.assert_array_equal(C.expert_matvec(w, [1], strided), C.expert_matvec(w, [1], xa, fast=False))


def _silu64(g):
    return g / (1.0 + np.exp(-g))


def _block(rng, layout, E=9, H=256, Fe=96):
    """gate, up, down stacks of one MoE block: separate gate/up of two types (two regions), of one
    type (one region), or the fused gate+up stack."""
    if layout == "fused":
        gate, up = random_stack(rng, Q.Q4_K, E, 2 * Fe, H), None
    else:
        # same-type: both Q6_K (a Q6_K file's layout; the pair path of every type is checked bit for
        # bit in test_two_stacks_in_one_region_equal_each_alone)
        t_g = Q.Q6_K if layout == "same-type" else Q.Q4_K
        gate, up = random_stack(rng, t_g, E, Fe, H), random_stack(rng, Q.Q6_K, E, Fe, H)
    return gate, up, random_stack(rng, Q.Q8_0, E, H, Fe)


@pytest.mark.parametrize("layout", ["separate", "same-type", "fused"])
def test_routed_experts_block(layout):
    """One token through k experts: numba == twin bit for bit; both near the float64 formula.
    Separate gate and up of one type take the one-region path (their kernel with two stacks, checked
    against each stack alone in test_two_stacks_in_one_region_equal_each_alone)."""
    rng = np.random.default_rng(7)
    Fe, H = 96, 256
    gate, up, down = _block(rng, layout, H=H, Fe=Fe)
    want_mode = {"separate": C._TWO_REGIONS, "same-type": C._ONE_REGION, "fused": C._FUSED}[layout]
    assert C._gate_up_mode(gate, up) == want_mode
    x = rng.standard_normal(H).astype(np.float32)
    ids = np.array([8, 2, 5])
    wts = np.array([0.5, 0.3, 0.2])
    fast = C.routed_experts(x, ids, wts, gate, up, down)
    twin = C.routed_experts(x, ids, wts, gate, up, down, fast=False)
    np.testing.assert_array_equal(fast.view(np.int32), twin.view(np.int32))
    # the twin is the composition of the parts it names, each checked against its kernel above
    fused = up is None
    xa = C.quantize_rows(x[None], fast=False)
    g = C.expert_matvec(gate, ids, xa, fast=False)
    g, u = (g[:, :Fe], g[:, Fe:]) if fused else (g, C.expert_matvec(up, ids, xa, fast=False))
    h = C.quantize_rows(C._swiglu_twin(g, u), fast=False)
    parts = C.weighted_matvec(down, ids, wts, h, fast=False)
    np.testing.assert_array_equal(twin.view(np.int32), parts.view(np.int32))
    g_all = _gguf_dense(gate)
    d_all = _gguf_dense(down)
    u_all = g_all[:, Fe:] if fused else _gguf_dense(up)
    ref = np.zeros(H)
    for e, wt in zip(ids, wts, strict=True):
        ref += wt * (d_all[e] @ (_silu64(g_all[e, :Fe] @ x) * (u_all[e] @ x)))
    # two int8 roundings (x, then the SwiGLU output), each <= 1/254 of a block's largest value
    rel = np.linalg.norm(fast - ref) / np.linalg.norm(ref)
    assert 0 < rel < 2e-2, rel


@pytest.mark.parametrize("layout", ["separate", "same-type", "fused"])
def test_token_kernel_runs_its_regions_as_parallel_loops(layout):
    """The token kernel's prange loops are numba parallel loops (a prange whose bound holds a branch
    silently stays serial): gate with up (or each alone: separate types) and down, and no more."""
    import numba

    rng = np.random.default_rng(15)
    gate, up, down = _block(rng, layout)
    u = gate if up is None else up
    key = (gate.ggml_type, u.ggml_type, down.ggml_type, C._gate_up_mode(gate, up))
    kernel = numba.njit(parallel=True)(C._token_kernel(*key).py_func)  # compiled now: diagnostics
    x = rng.standard_normal((1, gate.n_in)).astype(np.float32)
    ids, wts = np.array([8, 2, 5]), np.array([0.5, 0.3, 0.2])
    out = np.full(down.n_out, np.nan, np.float32)
    fe = down.n_in
    assert kernel(x, ids, wts, gate.raw, u.raw, down.raw, fe, C._F16_TABLE, 2, out) == -1
    np.testing.assert_array_equal(out.view(np.int32), C.routed_experts(x[0], ids, wts, gate, up, down).view(np.int32))
    diagnostics = kernel.overloads[kernel.signatures[0]].metadata["parfor_diagnostics"]
    assert diagnostics.count_parfors() == (3 if layout == "separate" else 2)


def test_routed_experts_takes_ids_and_weights_of_any_number_type():
    """ids as int64, int32, uint8, float32 or float64 (a GPU's routing sends whole numbers as
    float32) and weights as float32 or float64 give the same bits, kernel and twin; ids that are not
    whole numbers of an expert are refused, with the slot and the value."""
    rng = np.random.default_rng(12)
    gate, up, down = _block(rng, "same-type")
    x = rng.standard_normal(gate.n_in).astype(np.float32)
    ids = np.array([8, 0, 5, 8])
    wts = rng.dirichlet(np.ones(4))
    want = C.routed_experts(x, ids, wts, gate, up, down)
    np.testing.assert_array_equal(want.view(np.int32),
                                  C.routed_experts(x, ids, wts, gate, up, down, fast=False).view(np.int32))
    # every id type with float64 weights (route's), float32 ids with float32 weights (a GPU's); each
    # (ids, weights) pair of types is a compilation of the token kernel of its own
    pairs = [(t, np.float64) for t in (np.int32, np.uint8, np.float32, np.float64)] + [(np.float32, np.float32)]
    for id_type, w_type in pairs:
        for fast in (True, False):
            got = C.routed_experts(x, ids.astype(id_type), wts.astype(w_type), gate, up, down,
                                   fast=fast, threads=2)
            np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32),
                                          err_msg=f"{id_type} {w_type} {fast}")
    for bad, what in (([8, 0, 9, 1], "9"), ([8, -1, 5, 1], "-1"), ([8, 0, 2.5, 1], "2.5"),
                      ([8, 0, np.nan, 1], "nan")):
        for fast in (True, False):
            with pytest.raises(IndexError, match=re.escape(f"expert id {what} (slot")):
                C.routed_experts(x, np.array(bad), wts, gate, up, down, fast=fast)
    with pytest.raises(ValueError, match="4 expert ids need 4 weights"):
        C.routed_experts(x, ids, wts[:3], gate, up, down)
    with pytest.raises(ValueError, match="token has 128"):
        C.routed_experts(x[:128], ids, wts, gate, up, down)
    with pytest.raises(ValueError, match="down experts take"):
        C.routed_experts(x, ids, wts, gate, up, random_stack(rng, Q.Q8_0, 9, 256, 64))
    with pytest.raises(TypeError, match="integers or whole floats"):
        C.routed_experts(x, ids.astype(complex), wts, gate, up, down)


def test_thread_count_is_set_only_when_it_changes(monkeypatch):
    """numba's thread count is set once for a run of tokens at one count, not around every call."""
    import numba

    rng = np.random.default_rng(13)
    gate, up, down = _block(rng, "fused")
    x = rng.standard_normal(gate.n_in).astype(np.float32)
    before = numba.get_num_threads()
    real = numba.set_num_threads
    real(1)
    sets: list[int] = []
    monkeypatch.setattr(numba, "set_num_threads", lambda n: sets.append(n) or real(n))
    try:
        for _ in range(3):
            C.routed_experts(x, [1, 2], [0.5, 0.5], gate, up, down, threads=2)
        assert sets == [2] and numba.get_num_threads() == 2
        C.routed_experts(x, [1, 2], [0.5, 0.5], gate, up, down)  # None: left as it is
        assert sets == [2]
        C.routed_experts(x, [1, 2], [0.5, 0.5], gate, up, down, threads=1000)  # clipped to the most
        most = numba.config.NUMBA_NUM_THREADS
        assert sets == ([2] if most == 2 else [2, most]) and numba.get_num_threads() == most
    finally:
        real(before)


def test_expert_stack_is_checked_once_and_kept_read_only():
    rng = np.random.default_rng(14)
    w = random_stack(rng, Q.Q4_K, 3, 5, 256)
    assert not w.raw.flags.writeable and w.raw.flags.c_contiguous
    assert (w.n_experts, w.n_out) == (3, 5) and type(w.n_out) is int
    wide = np.zeros((3, 10, 144), np.uint8)
    wide[:, ::2] = w.raw
    again = C.ExpertStack(wide[:, ::2], Q.Q4_K, 256)  # not contiguous: copied once, here
    assert again.raw.flags.c_contiguous and not again.raw.flags.writeable
    xa = C.quantize_rows(rng.standard_normal((1, 256)).astype(np.float32))
    np.testing.assert_array_equal(C.expert_matvec(again, [2, 0], xa), C.expert_matvec(w, [2, 0], xa))


# ------------------------------------------------------------------------------------------------
# the tiny MoE model: decode on the integer kernels vs the dequantize-then-matmul reference


@pytest.fixture(scope="module")
def tiny_k_quant_moe(tmp_path_factory):
    """tiny-moe widened to 256 so the experts are Q4_K (gate/up) and Q4_K (down)."""
    from minecart.engine.synth import SHAPES, write_synthetic

    shape = replace(SHAPES["tiny-moe"], vocab_size=640, hidden=256, expert_ffn=256, shared_expert_ffn=256,
                    n_layers=4)
    path = tmp_path_factory.mktemp("moe-k") / "tiny-moe-q4_k.gguf"
    write_synthetic(path, shape, "q4_k", seed=5)
    return path


class _RoutingLog(NumpyBackend):
    """The NumPy backend, noting for each one-token MoE call its experts (as the path it takes
    routes: cpu_experts.route on the integer kernels, moe_route on the reference) and the
    probability gap between the k-th and (k+1)-th expert (how close the choice was to a tie)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls: list[tuple[frozenset, float]] = []

    def moe(self, x, router, gate_exps, up_exps, down_exps, k):
        if x.shape[0] == 1:
            if self.int_experts:
                ids = C.route(np.asarray(x[0], np.float32), router.dense(), k)[0]
            else:
                ids = self.moe_route(x, router, k)[0][0]
            logits = np.asarray(x, np.float64) @ router.dense().astype(np.float64).T
            p = np.sort(np.exp(logits - logits.max()))[0, ::-1]
            p /= p.sum()
            self.calls.append((frozenset(ids.tolist()), float(p[k - 1] - p[k])))
        return super().moe(x, router, gate_exps, up_exps, down_exps, k)


@pytest.mark.parametrize("which", ["fused-q8_0", "separate-q4_k"])
def test_tiny_moe_greedy_decode_matches_reference(which, tiny_k_quant_moe, tmp_path_factory):
    """Greedy decode on the integer kernels gives the reference's tokens; the logits stay within the
    int8 path's error (measured ~0.3-1.3% of their norm) until a layer picks other experts than the
    reference, which the slightly different hidden state may do only at a near tie; from then on the
    sequences' states differ by more than rounding, and only the tokens are compared."""
    path = tiny_moe_file(tmp_path_factory, "fused") if which == "fused-q8_0" else tiny_k_quant_moe
    fb, rb = _RoutingLog(int_experts=True, expert_threads=2), _RoutingLog(int_experts=False)
    fast, ref = load_model(path, backend=fb), load_model(path, backend=rb)
    w = fast.weights["layer.0"]
    exps = w.get("blk.0.ffn_gate_up_exps.weight") or w["blk.0.ffn_gate_exps.weight"]
    assert exps.type_name == ("Q8_0" if which == "fused-q8_0" else "Q4_K")
    assert w["blk.0.ffn_down_exps.weight"].type_name == exps.type_name
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, 600, 12)]
    sf, sr = fast.new_session(), ref.new_session()
    lf, lr = sf.prefill(prompt), sr.prefill(prompt)  # several tokens: both on the reference MoE
    np.testing.assert_array_equal(lf, lr)
    same_routing, checked = True, 0
    for step in range(16):
        tf, tr = int(np.argmax(lf)), int(np.argmax(lr))
        assert tf == tr, f"greedy tokens differ at step {step}"
        n = len(rb.calls)
        lf, lr = sf.step(tf), sr.step(tr)
        for (ids_f, _), (ids_r, gap) in zip(fb.calls[n:], rb.calls[n:], strict=True):
            if ids_f != ids_r:
                assert gap < 2e-2, f"step {step}: other experts chosen at a clear margin ({gap:.3g})"
                same_routing = False
        if same_routing:
            err = np.linalg.norm(lf - lr) / np.linalg.norm(lr)
            assert 0 < err < 3e-2, f"step {step}: logits off by {err:.3g}"
            checked += 1
    assert checked >= 8
    fast.close()
    ref.close()
