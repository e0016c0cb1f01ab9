"""Every CUDA kernel against its NumPy twin (engine/backends/numpy_backend.py) on fresh random inputs.

Odd and tail sizes everywhere, outputs poisoned with NaN before each kernel runs (fixture `poison`),
errors normalized: ||gpu - ref|| / ||ref||. Tolerances: 1e-5 for fp32 paths (only summation order
differs), a few 1e-3 for DP4A (activations rounded to int8 per 32 values), and 1e-5 against an exact
NumPy emulation of the DP4A arithmetic (same int8 activations), which pins the kernel itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.gguf_file import TensorInfo

from tests._reference import gdn_inputs
from tests.kernels.test_kq_mt_emulation import quantize_q8_1 as quantize_q8_1_twin

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

TYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_K": Q.Q4_K,
         "Q6_K": Q.Q6_K}


def nerr(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the GPU result (an output left unwritten?)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def nb():
    # the float reference (dequantize, fp32/fp64 sums) for the GPU kernels; its integer expert path
    # (engine/cpu_experts.py) is checked against its own twins on the CPU
    return NumpyBackend(int_experts=False)


@pytest.fixture(scope="module")
def gb():
    from minecart.engine.backends.cupy_backend import CupyBackend

    return CupyBackend("cuda:0", probe=False)


@pytest.fixture(scope="module")
def gb_fma():
    from minecart.engine.backends.cupy_backend import CupyBackend

    return CupyBackend("cuda:0", path="fma")


def make_tensor(rng, type_name: str, shape, std: float = 1.0, name: str = "w") -> TensorInfo:
    vals = (rng.standard_normal(shape) * std).astype(np.float32)
    tid = TYPES[type_name]
    raw = Q.quantize(vals, tid)
    raw2 = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw
    return TensorInfo(name=name, ggml_type=tid, type_name=type_name, shape=tuple(shape), raw=raw2,
                      n_bytes=int(raw.nbytes))


def test_quantize_q8_1_is_its_numpy_twin_bit_for_bit():
    """quantize_q8_1 (common.cuh q8_1_block: on sm_80 and later max |v| and sum(q) by redux.sync, before
    by shuffles) bit for bit against its NumPy twin (tests/kernels/test_kq_mt_emulation.py quantize_q8_1:
    d = max|v| / 127, q = rint(v / d), s = d sum(q) in float32) on inputs flushed to zero, as every build
    of the kernels flushes fp32 subnormals (CuPy adds -ftz=true; the PTX route compiles with it too,
    kernels/build.py BUILT_OPTIONS), on fresh rows of scales from 1e-30 to 1e30 with all-zero,
    negative-zero, subnormal, one-spike and exact-tie blocks among them."""
    from minecart.kernels import ops

    rng = np.random.default_rng()
    x = rng.standard_normal((48, 1024)) * np.exp(rng.uniform(-69, 69, (48, 1)))
    x = x.astype(np.float32)
    x[0, :32] = 0.0
    x[1, 32:64] = -0.0
    x[2, :32] = rng.standard_normal(32).astype(np.float32) * np.float32(1e-40)  # subnormal: flushed to zero
    x[3, 64:96] = 1e-3
    x[3, 70] = -5e3  # one spike: the rest round to 0 or +-1
    x[4, :32] = np.r_[127.0, np.arange(31) - 15.5]  # d = 1: every other value a tie, to even
    xq, xd, xs = (cp.asnumpy(a) for a in ops.quantize_q8_1(cp.asarray(x)))
    tiny = np.finfo(np.float32).tiny
    q, d, s = quantize_q8_1_twin(np.where(np.abs(x) < tiny, np.float32(0), x))
    q = q.reshape(-1, 32).astype(np.int32)
    d, s = d.reshape(-1), s.reshape(-1)
    np.testing.assert_array_equal(xq.reshape(-1, 32).astype(np.int32), q)
    np.testing.assert_array_equal(xd.reshape(-1).view(np.int32), d.view(np.int32))
    np.testing.assert_array_equal(xs.reshape(-1).view(np.int32), s.view(np.int32))


def q8_1_emulation(x: np.ndarray, w_dense: np.ndarray) -> np.ndarray:
    """The DP4A path's arithmetic in NumPy: x rounded to int8 per 32 values, exact products."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32).astype(np.float32)
    d = np.abs(xb).max(axis=2, keepdims=True) / np.float32(127.0)
    q = np.where(d > 0, np.rint(xb / np.where(d > 0, d, 1)), 0)
    xr = (q * d).reshape(T, K).astype(np.float64)
    return xr @ w_dense.astype(np.float64).T


@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("T", [1, 3, 8, 13, 130])
def test_matmul(nb, gb, gb_fma, poison, type_name, T):
    rng = np.random.default_rng(hash((type_name, T)) % 2**32)
    R, K = 259, 512
    info = make_tensor(rng, type_name, (R, K), 0.05)
    x = rng.standard_normal((T, K)).astype(np.float32)
    ref = nb.matmul(x, nb.load_weight(info))
    for be, is_dp4a in ((gb, type_name in ("Q8_0", "Q4_0", "Q4_K", "Q6_K")), (gb_fma, False)):
        poison()
        y = be.to_numpy(be.matmul(be.asarray(x), be.load_weight(info)))
        assert y.shape == (T, R)
        if is_dp4a:
            assert nerr(y, ref) < 1.5e-2
            emu = q8_1_emulation(x, nb.load_weight(info).dense())
            assert nerr(y, emu) < 2e-5
        else:
            assert nerr(y, ref) < 2e-5


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q6_K"])
@pytest.mark.parametrize("K", [96, 768])
def test_gemm_two_block_stages(nb, poison, type_name, K):
    """gemm_dp4a<QT, 2> (two quant blocks per barrier), also with an odd number of blocks."""
    from minecart.engine.backends.cupy_backend import CupyBackend

    if type_name == "Q6_K" and K % 256:
        pytest.skip("K-quants need rows of 256")
    be = CupyBackend("cuda:0", path="dp4a2")
    rng = np.random.default_rng(K)
    info = make_tensor(rng, type_name, (300, K), 0.05)
    x = rng.standard_normal((200, K)).astype(np.float32)
    y = be.to_numpy(be.matmul(be.asarray(x), be.load_weight(info)))
    assert nerr(y, q8_1_emulation(x, nb.load_weight(info).dense())) < 2e-5


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("path", ["dp4a", "dp4a2"])
def test_prefill_gemm_epilogue(nb, poison, launches, type_name, path):
    """gemm_dp4a's epilogue: the residual added there and a fused group's members written apart
    (matmul_split), each in the one launch, bit for bit the plain launch's output (plus the residual,
    one fp32 add) and its column ranges; the plain output against the DP4A emulation."""
    from minecart.kernels import ops

    rng = np.random.default_rng()
    R, K, T = 301, 512, 200  # a partial row tile and a partial token tile; T past every decode kernel
    info = make_tensor(rng, type_name, (R, K), 0.05)
    w = ops.upload_weight(info.raw, type_name, (R, K))
    name = f"gemm_dp4a<{ops.QT[type_name]}, {2 if path == 'dp4a2' else 1}>"
    x = rng.standard_normal((T, K)).astype(np.float32)
    res = rng.standard_normal((T, R)).astype(np.float32)
    gx, gres = cp.asarray(x), cp.asarray(res)
    runs = {}
    for what in ("plain", "residual"):
        poison()
        launches.clear()
        runs[what] = cp.asnumpy(ops.matmul(gx, w, path, residual=gres if what == "residual" else None))
        assert launches == [name], (what, launches)
    plain = runs["plain"]
    assert nerr(plain, q8_1_emulation(x, nb.load_weight(info).dense())) < 2e-5
    np.testing.assert_array_equal(runs["residual"], plain + res)
    cuts = np.sort(rng.choice(np.arange(1, R), size=int(rng.integers(1, ops.SPLIT_COLS_MAX)), replace=False))
    bounds = [0, *(int(c) for c in cuts), R]
    ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
    poison()
    launches.clear()
    outs = ops.matmul_split(gx, w, ranges, path)
    assert launches == [name], launches  # no split_cols launch after it
    for (a, b), o in zip(ranges, outs, strict=True):
        assert o.shape == (T, b - a) and o.flags.c_contiguous
        np.testing.assert_array_equal(cp.asnumpy(o), plain[:, a:b], err_msg=f"rows {a}..{b} of {bounds}")


@pytest.mark.parametrize("kquant", ["dp4a", "dp4a2", "dp4a_rq"])
def test_prefill_path_per_format(nb, poison, tmp_path, monkeypatch, kquant):
    """A probe record whose K-quant stage depth differs from Q8_0's: a prefill of Q8_0 rows takes
    `gemm`, one of K-quant rows `gemm_kquant`, decode rows the GEMV path either way; the results match
    the emulation (200 tokens: "dp4a_rq" below ops.REQUANT_MIN_T runs the format's own GEMM; above it,
    tests/gpu/test_requant.py)."""
    from minecart.engine import probe_cache
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.kernels import ops

    monkeypatch.setenv("MINECART_CACHE_DIR", str(tmp_path))
    rec = {"name": "test", "gemv": "dp4a", "gemm": "dp4a2" if kquant == "dp4a" else "dp4a", "gemm_kquant": kquant}
    monkeypatch.setattr(probe_cache, "get", lambda key: dict(rec))
    be = CupyBackend("cuda:0")
    assert be.gemm_path == rec["gemm"] and be.gemm_kquant_path == kquant
    rng = np.random.default_rng(11)
    for type_name in ("Q8_0", "Q4_K", "Q6_K"):
        info = make_tensor(rng, type_name, (260, 512), 0.05)
        w = be.load_weight(info)
        want = kquant if type_name != "Q8_0" else rec["gemm"]
        assert be._matmul_path(200, w.q) == want and be._matmul_path(1, w.q) == "dp4a"
        assert be._matmul_path(ops.gemv_max_t(w.q), w.q) == "dp4a"
        x = rng.standard_normal((200, 512)).astype(np.float32)
        y = be.to_numpy(be.matmul(be.asarray(x), w))
        assert nerr(y, q8_1_emulation(x, nb.load_weight(info).dense())) < 2e-5


@pytest.mark.parametrize("type_name", list(TYPES))
def test_embed(nb, gb, poison, type_name):
    rng = np.random.default_rng(7)
    info = make_tensor(rng, type_name, (301, 256), 0.5)
    ids = [0, 300, 17, 17, 150]
    ref = nb.embed(nb.load_weight(info, role="embedding"), ids)
    y = gb.to_numpy(gb.embed(gb.load_weight(info, role="embedding"), ids))
    assert nerr(y, ref) < 1e-6


@pytest.mark.parametrize("N", [16, 80, 1000, 4104])
def test_norms(nb, gb, poison, N):
    rng = np.random.default_rng(N)
    x = rng.standard_normal((5, 3, N)).astype(np.float32) * 3
    d = rng.standard_normal((5, 3, N)).astype(np.float32)
    z = rng.standard_normal((5, 3, N)).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(N)).astype(np.float32)
    gx, gd, gz, gw = gb.asarray(x), gb.asarray(d), gb.asarray(z), gb.asarray(w)
    assert nerr(gb.to_numpy(gb.rms_norm(gx, gw, 1e-6)), nb.rms_norm(x, w, 1e-6)) < 1e-6
    assert nerr(gb.to_numpy(gb.rms_norm(gx, None, 1e-6)), nb.rms_norm(x, None, 1e-6)) < 1e-6
    s, o = gb.add_rms_norm(gx, gd, gw, 1e-6)
    rs, ro = nb.add_rms_norm(x, d, w, 1e-6)
    assert nerr(gb.to_numpy(s), rs) < 1e-7 and nerr(gb.to_numpy(o), ro) < 1e-6
    assert nerr(gb.to_numpy(gb.l2_norm(gx, 1e-6)), nb.l2_norm(x, 1e-6)) < 1e-6
    assert nerr(gb.to_numpy(gb.gated_rms_norm(gx, gz, gw, 1e-6)), nb.gated_rms_norm(x, z, w, 1e-6)) < 1e-6


def test_elementwise(nb, gb, poison):
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((7, 333)) * 4).astype(np.float32)
    b = rng.standard_normal((7, 333)).astype(np.float32)
    col = rng.standard_normal((7, 1)).astype(np.float32)
    ga, gbb = gb.asarray(a), gb.asarray(b)
    for name in ("add", "mul", "swiglu", "geglu"):
        assert nerr(gb.to_numpy(getattr(gb, name)(ga, gbb)), getattr(nb, name)(a, b)) < 1e-6, name
    for name in ("sigmoid", "silu"):
        assert nerr(gb.to_numpy(getattr(gb, name)(ga)), getattr(nb, name)(a)) < 1e-6, name
    assert nerr(gb.to_numpy(gb.scale(ga, 0.37)), nb.scale(a, 0.37)) < 1e-7
    assert nerr(gb.to_numpy(gb.mul(ga, gb.asarray(col))), nb.mul(a, col)) < 1e-7
    al = rng.standard_normal((9, 6)).astype(np.float32) * 5
    be = rng.standard_normal((9, 6)).astype(np.float32)
    A = -np.exp(rng.uniform(-3, 1, 6)).astype(np.float32)
    dt = rng.standard_normal(6).astype(np.float32)
    g, bt = gb.gdn_gates(gb.asarray(al), gb.asarray(be), gb.asarray(A), gb.asarray(dt))
    rg, rbt = nb.gdn_gates(al, be, A, dt)
    assert nerr(gb.to_numpy(g), rg) < 1e-6 and nerr(gb.to_numpy(bt), rbt) < 1e-6


@pytest.mark.parametrize("d,n_rot,sections", [(64, 16, ()), (256, 64, (11, 11, 10)), (128, 128, ())])
def test_rope(nb, gb, poison, d, n_rot, sections):
    rng = np.random.default_rng(d)
    T, nh = 11, 3
    x = rng.standard_normal((T, nh, d)).astype(np.float32)
    for pos in (np.arange(5, 5 + T), rng.integers(0, 500, T)):
        y = gb.to_numpy(gb.rope(gb.asarray(x), pos, n_rot, 1e7, sections=sections))
        assert nerr(y, nb.rope(x, pos, n_rot, 1e7, sections=sections)) < 2e-6
    if sections:
        pos3 = rng.integers(0, 60, (3, T))
        y = gb.to_numpy(gb.rope(gb.asarray(x), pos3, n_rot, 1e7, sections=sections))
        assert nerr(y, nb.rope(x, pos3, n_rot, 1e7, sections=sections)) < 2e-6
    y = gb.to_numpy(gb.rope(gb.asarray(x), np.arange(T), n_rot, 1e4, scale=4.0))
    assert nerr(y, nb.rope(x, np.arange(T), n_rot, 1e4, scale=4.0)) < 2e-6


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("window", [0, 19])
def test_attention(nb, gb, poison, D, window):
    rng = np.random.default_rng(D + window)
    nh, n_kv = 8, 2
    c_np = nb.new_kv_cache(n_kv, D, D, 16)
    c_gp = gb.new_kv_cache(n_kv, D, D, 16)
    # prefill of 37, a second chunk of 33 (non-empty cache), then single-token decode steps
    for T in (37, 33, 1, 1, 5, 1):
        poison()
        q = rng.standard_normal((T, nh, D)).astype(np.float32)
        k = rng.standard_normal((T, n_kv, D)).astype(np.float32)
        v = rng.standard_normal((T, n_kv, D)).astype(np.float32)
        ref = nb.attention(q, k, v, c_np, scale=D ** -0.5, window=window)
        y = gb.to_numpy(gb.attention(gb.asarray(q), gb.asarray(k), gb.asarray(v), c_gp, scale=D ** -0.5,
                                     window=window))
        assert c_gp.length == c_np.length
        assert nerr(y, ref) < 1e-5, (T, c_np.length)


def test_attention_long_decode_split(nb, gb, poison):
    """Decode over a 3,001-token context: many context slices merged by log-sum-exp."""
    rng = np.random.default_rng(11)
    D, nh, n_kv, L = 128, 6, 1, 3000
    c_np = nb.new_kv_cache(n_kv, D, D, L + 1)
    c_gp = gb.new_kv_cache(n_kv, D, D, L + 1)
    k = rng.standard_normal((L, n_kv, D)).astype(np.float32)
    v = rng.standard_normal((L, n_kv, D)).astype(np.float32)
    c_np.append(k, v)
    c_gp.append(gb.asarray(k), gb.asarray(v))
    q = (rng.standard_normal((1, nh, D)) * 2).astype(np.float32)
    k1 = rng.standard_normal((1, n_kv, D)).astype(np.float32)
    v1 = rng.standard_normal((1, n_kv, D)).astype(np.float32)
    ref = nb.attention(q, k1, v1, c_np, scale=D ** -0.5)
    y = gb.to_numpy(gb.attention(gb.asarray(q), gb.asarray(k1), gb.asarray(v1), c_gp, scale=D ** -0.5))
    assert nerr(y, ref) < 1e-5


@pytest.mark.parametrize("KW", [1, 2, 4])
def test_conv1d(nb, gb, poison, KW):
    """conv1d_silu (a thread per channel and run of ops.CONV_RUN tokens) and the state it carries, over calls
    of one token, a few, and several runs with a partial last one, 300 channels (a partial block), its
    output whole and cut into two or three contiguous pieces."""
    from minecart.kernels import ops

    rng = np.random.default_rng()
    C = 300
    w = rng.standard_normal((C, KW)).astype(np.float32)
    s_np = np.zeros((KW - 1, C), np.float32)
    s_gp = gb.zeros((KW - 1, C))
    for T, cuts in ((7, ()), (1, (50,)), (1, ()), (2, (1, 299)), (1, ()), (3 * ops.CONV_RUN + 5, (64, 128)),
                    (ops.CONV_RUN, (100, 101))):
        x = rng.standard_normal((T, C)).astype(np.float32)
        ref = nb.conv1d_silu(x, s_np, w, cuts)
        poison()
        ys = gb.conv1d_silu(gb.asarray(x), s_gp, gb.asarray(w), cuts)
        assert len(ys) == len(ref) == len(cuts) + 1
        for y, r in zip(ys, ref, strict=True):
            assert y.shape == r.shape and y.flags.c_contiguous
            assert nerr(gb.to_numpy(y), r) < 1e-6
        assert nerr(gb.to_numpy(s_gp), s_np) < 1e-7
    with pytest.raises(ValueError, match="kernel width"):
        ops.conv1d_silu(gb.asarray(x), gb.zeros((8, C)), gb.asarray(np.zeros((C, 9), np.float32)))
    with pytest.raises(ValueError, match="increasing"):
        ops.conv1d_silu(gb.asarray(x), s_gp, gb.asarray(w), (100, 100))


@pytest.mark.parametrize("dk,n_k,n_v,T", [(16, 2, 4, 150), (128, 2, 4, 70), (64, 1, 3, 9)])
def test_gdn(nb, gb, poison, dk, n_k, n_v, T):
    rng = np.random.default_rng(dk + T)
    q, k, v, g, beta, s0 = gdn_inputs(rng, T, n_k, n_v, dk, dk)
    s_np = s0.copy()
    ref = nb.gdn_chunk(q, k, v, g, beta, s_np)
    s_gp = gb.asarray(s0)
    poison()
    y = gb.to_numpy(gb.gdn_chunk(*(gb.asarray(a) for a in (q, k, v, g, beta)), s_gp))
    assert nerr(y, ref) < 1e-5
    assert nerr(gb.to_numpy(s_gp), s_np) < 1e-5
    # token by token continues from the same state
    s_np2 = s_np.copy()
    for t in range(3):
        sl = slice(t, t + 1)
        r = nb.gdn_step(q[sl], k[sl], v[sl], g[sl], beta[sl], s_np2)
        o = gb.gdn_step(*(gb.asarray(a[sl]) for a in (q, k, v, g, beta)), s_gp)
        assert nerr(gb.to_numpy(o), r) < 1e-5
    assert nerr(gb.to_numpy(s_gp), s_np2) < 1e-5


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("T", [1, 6])
def test_moe(nb, gb, gb_fma, poison, fused, T):
    rng = np.random.default_rng(T + 10 * fused)
    E, H, F, k = 8, 256, 96, 3
    router = make_tensor(rng, "F32", (E, H), 0.5, "router")
    if fused:
        gate = make_tensor(rng, "Q8_0", (E, 2 * F, H), 0.1, "gate_up")
        up = None
    else:
        gate = make_tensor(rng, "Q8_0", (E, F, H), 0.1, "gate")
        up = make_tensor(rng, "Q4_K", (E, F, H), 0.1, "up")
    down = make_tensor(rng, "Q8_0", (E, H, F), 0.1, "down")
    x = rng.standard_normal((T, H)).astype(np.float32)

    def run(be):
        ws = [be.load_weight(router, role="matmul")] + [
            None if t is None else be.load_weight(t, role="experts") for t in (gate, up, down)]
        return be.to_numpy(be.moe(be.asarray(x), ws[0], ws[1], ws[2], ws[3], k)) if be is not nb else \
            be.moe(x, ws[0], ws[1], ws[2], ws[3], k)

    ref = run(nb)
    assert nerr(run(gb_fma), ref) < 2e-5
    assert nerr(run(gb), ref) < 3e-2


@pytest.mark.parametrize("V", [1000, 100003, 248320])
@pytest.mark.parametrize("k", [1, 5, 40, 64, 128])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("variant", ["rounds", "select"])
def test_top_k(nb, gb, V, k, ties, variant, monkeypatch):
    """The device's top-k, by rounds and in four passes (ops.TOPK_VARIANT), equals the host's
    (engine/sampling.py top_logits) value for value and id for id, ties included (rounded logits:
    thousands of equal values across the 4096-wide slices), on fresh random rows."""
    from minecart.kernels import ops

    monkeypatch.setattr(ops, "TOPK_VARIANT", variant)
    rng = np.random.default_rng()
    logits = (rng.standard_normal((3, V)) * rng.uniform(0.5, 6)).astype(np.float32)
    if ties:
        logits = np.round(logits)
    ref = nb.top_k(logits, k)
    got = gb.top_k(gb.asarray(logits), k)
    np.testing.assert_array_equal(got.ids, ref.ids)
    np.testing.assert_array_equal(got.values, ref.values)


@pytest.mark.parametrize("k", [8, 40, 128])
def test_top_k_select_takes_masked_and_equal_rows(nb, gb, k, monkeypatch):
    """In four passes, rows the threshold cannot thin out still give the host's top k: -inf logits
    (masked tokens) reaching into it, in ascending id order after the finite ones; a row of one value
    throughout (every logit a candidate: more than one block sorts, so the rounds over the row decide);
    -0 and +0 as equal values; a row whose largest logits all sit in a few neighbouring groups."""
    from minecart.kernels import ops

    monkeypatch.setattr(ops, "TOPK_VARIANT", "select")
    rng = np.random.default_rng()
    V = 30000
    logits = np.full((4, V), -np.inf, np.float32)
    logits[0, rng.choice(V, 5, replace=False)] = rng.standard_normal(5).astype(np.float32)
    logits[1] = 2.5
    logits[2] = rng.choice(np.array([0.0, -0.0, 1.0, -1.0], np.float32), V)
    logits[3] = rng.standard_normal(V).astype(np.float32)
    logits[3, 1000:1200] = 50 + rng.standard_normal(200).astype(np.float32)
    ref = nb.top_k(logits, k)
    got = gb.top_k(gb.asarray(logits), k)
    np.testing.assert_array_equal(got.ids, ref.ids)
    np.testing.assert_array_equal(got.values, ref.values)


@pytest.mark.parametrize("k", [1, 2, 7, 20, 33, 64, 128])
def test_pick_top_is_the_hosts_draw(k):
    """ops.pick_top (the device's draw from a step's top logits) against its host twin draw_from_top
    (engine/sampling.py), on fresh random rows with ties, for temperatures from 0 (greedy) up, top-p
    and min-p on and off: the same token every time, save where the uniform number or a filter's
    threshold lies within rounding of a boundary (_could_draw), which random draws all but never hit."""
    import cupy as cp
    from minecart.engine.sampling import PickSpec, _could_draw, draw_from_top, top_logits
    from minecart.kernels import ops

    rng = np.random.default_rng(100 + k)
    rows = 1500
    x = (rng.standard_normal((rows, max(k, 300))) * rng.uniform(0.2, 6, (rows, 1))).astype(np.float32)
    x[::3] = np.round(x[::3])  # ties, among the k largest too
    vals, ids = top_logits(x, k)
    specs = [PickSpec(float(rng.random()), float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.6])),
                      float(rng.choice([1.0, 0.95, 0.8, 0.3])), float(rng.choice([0.0, 0.0, 0.05, 0.2])),
                      int(rng.choice([0, 0, 1, max(1, k // 2), k, k + 5])))  # top_k: the row's first ones
             for _ in range(rows)]
    prm = np.stack([sp.as_array() for sp in specs])
    got = cp.asnumpy(ops.pick_top(cp.asarray(vals), cp.asarray(ids.astype(np.int32)), cp.asarray(prm)))
    want = np.array([draw_from_top(vals[r], ids[r], specs[r]) for r in range(rows)])
    differ = np.flatnonzero(got != want)
    assert all(_could_draw(vals[r], ids[r], specs[r], int(got[r])) for r in differ), differ
    assert differ.size <= 3, f"{differ.size} of {rows} picks differ"
    # the draws are spread over the candidates (not all the first one) when sampling
    hot = [r for r in range(rows) if specs[r].temperature >= 1.0 and specs[r].top_p >= 0.95 and specs[r].min_p == 0
           and specs[r].top_k in (0, k, k + 5)]
    if k >= 20:
        assert np.mean(got[hot] != ids[hot, 0]) > 0.3


def test_probe_and_cache(tmp_path, monkeypatch):
    from minecart.engine import probe_cache
    from minecart.kernels import probe

    monkeypatch.setenv("MINECART_CACHE_DIR", str(tmp_path))
    rec = probe.run_probe()
    # any path the probe times may win: hfma2's GEMM did on an H100 running the compute_70 PTX (v49)
    assert rec["gemv"] in probe.GEMV_PATHS and rec["gemm"] in probe.GEMM_PATHS
    assert rec["copy_gbs"] > 10 and rec["dp4a_tops"] > 0.5 and rec["fma_tflops"] > 0.5
    if rec["gemm"].startswith("dp4a"):  # the K-quants' prefill GEMM, timed on its own
        us, err = rec["gemm_kquant_us"], rec["gemm_kquant_err"]
        assert rec["gemm_kquant"] in probe.KQUANT_GEMM_PATHS and set(us) == set(err) == set(probe.KQUANT_GEMM_PATHS)
        assert max(err.values()) < 2e-2
        assert us[rec["gemm_kquant"]] == min(us.values()) > 0
    else:
        assert "gemm_kquant" not in rec
    probe_cache.save("GPU-test", rec)
    assert probe_cache.get("GPU-test")["gemv"] == rec["gemv"]
    assert "decode path" in probe_cache.summary_for("GPU-test")
    print("probe:", rec)


@pytest.mark.parametrize("V", [1000, 248320])
def test_penalize_is_apply_penalties(V):
    """ops.penalize (a step's penalties over its whole row from the sequence's table) against its host
    twin apply_penalties (engine/sampling.py) on fresh random rows and histories: bit for bit, for
    repetition penalties above and below 1 with presence and frequency penalties on and off, over
    positive, negative and zero logits; and the table it leaves counts the token it was given, as the
    host's table of the longer history does."""
    import cupy as cp
    from minecart.engine.sampling import PenaltyHistory, SamplingParams, apply_penalties
    from minecart.kernels import ops

    rng = np.random.default_rng(V)
    for trial in range(12):
        row = (rng.standard_normal(V) * rng.uniform(0.5, 8)).astype(np.float32)
        row[rng.integers(0, V, 50)] = 0.0
        prompt = rng.integers(0, V, int(rng.integers(0, 3000))).tolist()
        generated = rng.integers(0, min(V, 400), int(rng.integers(1, 300))).tolist()  # repeats
        params = SamplingParams(repetition_penalty=float(rng.choice([1.0, 1.05, 1.3, 0.8])),
                                presence_penalty=float(rng.choice([0.0, 0.5, -0.3, 1.5])),
                                frequency_penalty=float(rng.choice([0.0, 0.1, 0.7])))
        h = PenaltyHistory(prompt, generated, V)
        keys, vals = h.table(len(generated) - 1)
        table = cp.zeros(V, dtype=cp.int32)
        table[cp.asarray(keys)] = cp.asarray(vals)
        prm = cp.asarray([params.repetition_penalty, params.presence_penalty, params.frequency_penalty], cp.float64)
        x = cp.asarray(row)
        ops.penalize(x, cp.asarray([generated[-1]], cp.int32), table, prm)
        want = apply_penalties(row, params, prompt, generated)
        np.testing.assert_array_equal(cp.asnumpy(x), want, err_msg=f"trial {trial}: {params}")
        keys, vals = h.table(len(generated))
        full = np.zeros(V, np.int32)
        full[keys] = vals
        np.testing.assert_array_equal(cp.asnumpy(table), full)
        assert trial or not np.array_equal(want, row)  # the penalties changed something
