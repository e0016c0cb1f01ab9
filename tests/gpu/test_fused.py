"""The fused decode kernels (kernels/fused.cu via CupyBackend's FusedOpsMixin overrides) against the NumPy
compositions (engine/backends/base.py FusedOpsMixin on NumpyBackend), on fresh random inputs with odd
sizes; q8_1 side outputs against quantize_q8_1 of the fp32 output; and the number of kernel launches
per decode step of the fixture model, per layer kind (printed; run with -s).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from minecart.engine.backends.numpy_backend import NumpyBackend

cp = pytest.importorskip("cupy")

from .test_kernels import TYPES, make_tensor, nerr  # noqa: E402  (after the skip: it imports cupy)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nb():
    return NumpyBackend()


@pytest.fixture(scope="module", params=["dp4a", "fma"])
def gb(request):
    from minecart.engine.backends.cupy_backend import CupyBackend

    be = CupyBackend("cuda:0", path=request.param)
    be.use_graphs = False
    return be


def _check_q8(y, q8):
    """q8 = (xq, xd, xs) must equal quantize_q8_1(y): q bit-identical, d within 1 ulp, s close."""
    from minecart.kernels import ops

    rq, rd, rs = (cp.asnumpy(a) for a in ops.quantize_q8_1(cp.ascontiguousarray(y.reshape(y.shape[0], -1))))
    xq, xd, xs = (cp.asnumpy(a) for a in q8)
    assert np.array_equal(xq.reshape(rq.shape), rq), "q8 quants differ from quantize_q8_1"
    assert np.all(np.abs(xd.reshape(rd.shape).view(np.int32) - rd.view(np.int32)) <= 1), "q8 scales differ"
    np.testing.assert_allclose(xs.reshape(rs.shape), rs, rtol=1e-6, atol=1e-30)


def _published(x):
    """The q8_1 arrays the backend registered for x (the next matmul's input), or None."""
    from minecart.kernels import ops

    last = getattr(ops._LAST_Q, "entry", None)
    if last is None or last[0][0] != x.data.ptr:
        return None
    return last[2]


# ---- norms and swiglu with q8 ---------------------------------------------------------------------------

@pytest.mark.parametrize("T,N", [(1, 32), (1, 4096), (3, 96), (8, 2080), (13, 1024), (40, 5120)])
def test_rms_norm_q8(nb, gb, poison, T, N):
    rng = np.random.default_rng(N + T)
    x = (rng.standard_normal((T, N)) * 3).astype(np.float32)
    d = rng.standard_normal((T, N)).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(N)).astype(np.float32)
    gx, gd, gw = gb.asarray(x), gb.asarray(d), gb.asarray(w)
    poison()
    y = gb.rms_norm(gx, gw, 1e-6)
    q8 = _published(y)
    assert nerr(gb.to_numpy(y), nb.rms_norm(x, w, 1e-6)) < 1e-6
    if gb.gemv_path == "dp4a":
        assert q8 is not None
        _check_q8(y, q8)
    poison()
    s, o = gb.add_rms_norm(gx, gd, gw, 1e-6)
    q8 = _published(o)
    rs, ro = nb.add_rms_norm(x, d, w, 1e-6)
    assert nerr(gb.to_numpy(s), rs) < 1e-7 and nerr(gb.to_numpy(o), ro) < 1e-6
    if gb.gemv_path == "dp4a":
        _check_q8(o, q8)


@pytest.mark.parametrize("T,F", [(1, 32), (1, 12288), (5, 160)])
def test_swiglu_q8(nb, gb, poison, T, F):
    rng = np.random.default_rng(F)
    g = (rng.standard_normal((T, F)) * 2).astype(np.float32)
    u = rng.standard_normal((T, F)).astype(np.float32)
    poison()
    y = gb.swiglu(gb.asarray(g), gb.asarray(u))
    q8 = _published(y)
    assert nerr(gb.to_numpy(y), nb.swiglu(g, u)) < 1e-6
    if gb.gemv_path == "dp4a":
        _check_q8(y, q8)


# ---- projections -----------------------------------------------------------------------------------------

def test_split_columns(poison):
    """ops.split_columns (one split_cols launch for a fused group's outputs of a batch of rows) equals
    slicing the columns, for 1..8 ranges of any width and the per-range copies above 8; bad ranges are
    refused."""
    from minecart.kernels import ops

    rng = np.random.default_rng()
    for T, widths in ((3, [259, 64, 3, 1]), (1, [5]), (20, [1, 2, 3, 4, 5, 6, 7, 8]), (7, [2] * 11),
                      (0, [4, 4])):
        R = sum(widths)
        y = rng.standard_normal((T, R)).astype(np.float32)
        bounds = np.cumsum([0] + widths)
        ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
        poison()
        outs = ops.split_columns(cp.asarray(y), ranges)
        for o, (a, b) in zip(outs, ranges, strict=True):
            assert o.flags.c_contiguous and o.shape == (T, b - a)
            np.testing.assert_array_equal(cp.asnumpy(o), y[:, a:b])
    for bad in ([(0, 3), (4, 8)], [(0, 4), (4, 7)], [(1, 8)], [(0, 4), (4, 4), (4, 8)]):
        with pytest.raises(ValueError, match="split_columns"):
            ops.split_columns(cp.zeros((2, 8), cp.float32), bad)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "F16", "F32"])
@pytest.mark.parametrize("T", [1, 3, 20])
def test_matmul_many_and_add(nb, gb, poison, type_name, T):
    rng = np.random.default_rng(T * 7 + len(type_name))
    K = 512
    infos = [make_tensor(rng, type_name, (R, K), 0.05, name=f"w{i}") for i, R in enumerate((259, 64, 3, 1))]
    x = rng.standard_normal((T, K)).astype(np.float32)
    gx = gb.asarray(x)
    alone = [gb.to_numpy(gb.matmul(gx, gb.load_weight(i))) for i in infos]  # each loaded apart
    ws = gb.load_fused(infos)  # one array for the group, each weight a row view of it
    assert ws[0].group is not None and all(w.group is ws[0].group for w in ws)
    poison()
    many = [gb.to_numpy(y) for y in gb.matmul_many(gx, ws)]
    again = [gb.to_numpy(y) for y in gb.matmul_many(gx, ws)]
    after = [gb.to_numpy(gb.matmul(gx, w)) for w in ws]  # each member alone, on its row view
    for a, m, g, f, info in zip(alone, many, again, after, infos, strict=True):
        assert m.shape == a.shape == (T, info.shape[0])
        for b in (m, g, f):  # same kernels on the same rows: equal (bit-identical expected)
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * max(np.abs(a).max(), 1e-30))
    r = rng.standard_normal((T, 259)).astype(np.float32)
    poison()
    y = gb.to_numpy(gb.matmul_add(gx, ws[0], gb.asarray(r)))
    np.testing.assert_allclose(y, alone[0] + r, rtol=0, atol=1e-5 * np.abs(alone[0]).max())
    ref = nb.matmul_add(x, nb.load_weight(infos[0]), r)
    tol = 1.5e-2 if gb.gemv_path == "dp4a" and type_name in ("Q8_0", "Q4_0", "Q4_K", "Q6_K") else 2e-5
    assert nerr(y, ref) < tol
    assert type_name in TYPES


# ---- Gated DeltaNet ----------------------------------------------------------------------------------------

GDN_SHAPES = [  # n_k, n_v, dk, dv, conv kernel
    (1, 3, 16, 16, 4),
    (1, 3, 128, 128, 4),
    (2, 4, 32, 64, 4),
    (3, 3, 64, 32, 3),
    (16, 32, 128, 128, 4),  # Qwen3.5 9B
    (2, 4, 16, 80, 2),  # a partial last column block
]


def _gdn_inputs(rng, n_k, n_v, dk, dv, kw, T):
    C = 2 * n_k * dk + n_v * dv
    return dict(
        mixed=rng.standard_normal((T, C)).astype(np.float32),
        z=rng.standard_normal((T, n_v * dv)).astype(np.float32),
        b=rng.standard_normal((T, n_v)).astype(np.float32),
        alpha=rng.standard_normal((T, n_v)).astype(np.float32),
    ), dict(
        conv_w=(rng.standard_normal((C, kw)) * 0.5).astype(np.float32),
        ssm_a=-np.exp(rng.standard_normal(n_v)).astype(np.float32),
        dt_bias=rng.standard_normal(n_v).astype(np.float32),
        norm_w=(1 + 0.2 * rng.standard_normal(dv)).astype(np.float32),
    )


@pytest.mark.parametrize("shape", GDN_SHAPES, ids=lambda s: "nk{}-nv{}-dk{}-dv{}-kw{}".format(*s))
def test_gdn_decode(nb, gb, poison, shape):
    n_k, n_v, dk, dv, kw = shape
    rng = np.random.default_rng(sum(shape))
    C = 2 * n_k * dk + n_v * dv
    conv = (rng.standard_normal((kw - 1, C))).astype(np.float32)
    ssm = (rng.standard_normal((n_v, dk, dv)) * 0.1).astype(np.float32)
    g_conv, g_ssm = gb.asarray(conv), gb.asarray(ssm)
    _, wts = _gdn_inputs(rng, n_k, n_v, dk, dv, kw, 1)
    g_wts = {k: gb.asarray(v) for k, v in wts.items()}
    dims = dict(n_k=n_k, n_v=n_v, dk=dk, dv=dv, eps=1e-6)
    worst = 0.0
    for step in range(3):  # consecutive tokens: the states carry over
        acts, _ = _gdn_inputs(rng, n_k, n_v, dk, dv, kw, 1)
        ref = nb.gdn_decode(*acts.values(), conv, ssm, *wts.values(), **dims)
        poison()
        y = gb.gdn_decode(*(gb.asarray(a) for a in acts.values()), g_conv, g_ssm, *g_wts.values(), **dims)
        q8 = _published(y)
        got = gb.to_numpy(y)
        err = nerr(got, ref)
        worst = max(worst, err)
        assert err < 2e-5, f"step {step}: output error {err:.2e}"
        np.testing.assert_array_equal(gb.to_numpy(g_conv), conv)  # pure data movement: exact
        assert nerr(gb.to_numpy(g_ssm), ssm) < 2e-5
        if gb.gemv_path == "dp4a" and dv % 32 == 0:
            assert q8 is not None
            _check_q8(y, q8)
    print(f"\ngdn_decode {shape} ({gb.gemv_path}): max output nerr over 3 steps {worst:.2e}")


def test_gdn_decode_timing(gb):
    """9B shape: one fused launch vs the composed kernels (printed)."""
    from minecart.kernels.probe import time_gpu

    n_k, n_v, dk, dv, kw = 16, 32, 128, 128, 4
    rng = np.random.default_rng(0)
    acts, wts = _gdn_inputs(rng, n_k, n_v, dk, dv, kw, 1)
    C = 2 * n_k * dk + n_v * dv
    conv, ssm = gb.zeros((kw - 1, C)), gb.zeros((n_v, dk, dv))
    a = [gb.asarray(v) for v in acts.values()]
    w = [gb.asarray(v) for v in wts.values()]
    dims = dict(n_k=n_k, n_v=n_v, dk=dk, dv=dv, eps=1e-6)
    from minecart.engine.backends.base import FusedOpsMixin

    t_fused = time_gpu(lambda: gb.gdn_decode(*a, conv, ssm, *w, **dims), 50)
    t_comp = time_gpu(lambda: FusedOpsMixin.gdn_decode(gb, *a, conv, ssm, *w, **dims), 50)
    print(f"\ngdn_decode 9B shape: fused {t_fused * 1e6:.1f} us, composed {t_comp * 1e6:.1f} us")


# ---- gated attention ---------------------------------------------------------------------------------------

ATTN_SHAPES = [  # nh, n_kv, d, rope dims, M-RoPE sections
    (4, 1, 64, 16, ()),
    (6, 2, 128, 64, ()),
    (16, 4, 256, 64, ()),  # Qwen3.5 9B
    (8, 2, 128, 64, (11, 11, 10)),
]


# the fused step (attn_prep + flash_decode + attn_merge_gate) on every cache type it writes: f32, and
# f16 / q8_0 stored by attn_prep itself; tolerance of the typed caches: a value whose fp32 norm/RoPE
# differs in the last bit from the NumPy twin's may round to the neighbouring f16 / int8 step
ATTN_KV_TOL = {"f32": 2e-5, "f16": 2e-3, "q8_0": 1e-2}


@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "nh{}-kv{}-d{}-rot{}-{}".format(*s[:4], len(s[4])))
def test_gated_attention_decode(nb, gb, poison, shape, kv):
    from minecart.kernels import fused

    nh, n_kv, d, n_rot, sections = shape
    rng = np.random.default_rng(nh * d + n_rot)
    qn = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    kn = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    n_cache = nb.new_kv_cache(n_kv, d, d, 64, kv_type=kv)
    g_cache = gb.new_kv_cache(n_kv, d, d, 64, kv_type=kv)
    calls = Counter()
    real_prep = fused.attn_prep

    def counted_prep(*a, **k):
        calls[k.get("kv_type", "f32")] += 1
        return real_prep(*a, **k)
    kw = dict(n_rot=n_rot, base=10000.0, sections=sections, scale=1.0 / math.sqrt(d), eps=1e-6)

    def step(T, p0):
        qg = rng.standard_normal((T, nh, 2, d)).astype(np.float32)
        k = rng.standard_normal((T, n_kv, d)).astype(np.float32)
        v = rng.standard_normal((T, n_kv, d)).astype(np.float32)
        if sections:
            pos = np.stack([np.arange(p0, p0 + T), np.arange(p0, p0 + T) + 3, np.arange(p0, p0 + T) * 2 % 7])
        else:
            pos = np.arange(p0, p0 + T)
        ref = nb.gated_attention(qg, k, v, n_cache, nb.asarray(qn), nb.asarray(kn), pos, **kw)
        poison()
        y = gb.gated_attention(gb.asarray(qg), gb.asarray(k), gb.asarray(v), g_cache, gb.asarray(qn),
                               gb.asarray(kn), pos, **kw)
        return ref, y

    step(37, 0)  # prefill through the composed path
    fused.attn_prep = counted_prep
    try:
        for t in range(3):
            ref, y = step(1, 37 + t)
            q8 = _published(y)
            err = nerr(gb.to_numpy(y), ref)
            assert err < ATTN_KV_TOL[kv], f"{kv} decode step {t}: error {err:.2e}"
            if gb.gemv_path == "dp4a":
                assert q8 is not None
                _check_q8(y, q8)
    finally:
        fused.attn_prep = real_prep
    assert calls[kv] == 3, f"the fused step did not run on the {kv} cache: {dict(calls)}"
    L = n_cache.length
    assert g_cache.length == L == 40
    if kv == "f32":
        assert nerr(gb.to_numpy(g_cache.k[:L]), n_cache.k[:L]) < 1e-6
        np.testing.assert_array_equal(gb.to_numpy(g_cache.v[:L]), n_cache.v[:L])
    elif kv == "f16":  # V rows are copied, so they round exactly as the twin's; K within one f16 step
        np.testing.assert_array_equal(gb.to_numpy(g_cache.v[:L]), n_cache.v[:L])
        assert nerr(gb.to_numpy(g_cache.k[:L]).astype(np.float32), n_cache.k[:L].astype(np.float32)) < 1e-3
    else:  # q8_0: V rows quantize from the same fp32 values: the bytes equal the twin's blocks
        got_v = gb.to_numpy(g_cache.v[:L]).reshape(L, n_kv, d // 32, 34)
        np.testing.assert_array_equal(got_v[..., 2:].copy().view(np.int8).reshape(L, n_kv, d), n_cache.v_q[:L])
        np.testing.assert_array_equal(got_v[..., :2].copy().view(np.float16).reshape(L, n_kv, d // 32),
                                      n_cache.v_scales[:L])


# ---- launches per decode step ------------------------------------------------------------------------------

def _graph_nodes(graph) -> int | None:
    """Nodes of a captured cupy Graph (cudaGraphGetNodes through the runtime), or None if unavailable."""
    import ctypes

    handle = getattr(graph, "graph", None)
    if not handle:
        return None
    for lib in ("libcudart.so", "libcudart.so.12", "libcudart.so.13"):
        try:
            rt = ctypes.CDLL(lib)
            break
        except OSError:
            continue
    else:
        return None
    n = ctypes.c_size_t(0)
    if rt.cudaGraphGetNodes(ctypes.c_void_p(int(handle)), None, ctypes.byref(n)) != 0:
        return None
    return int(n.value)


def _count_launches(m, be, monkeypatch, label: str) -> tuple[int, int]:
    """Hand-written kernels launched by one eager decode step, per layer kind (max over layers), and
    the nodes of the captured graph of a step (every launch and copy). Prints them."""
    from minecart.engine.config import GDN
    from minecart.kernels import fused, ops

    counts: Counter = Counter()
    for mod in (ops, fused):
        def counting(module, name, _real=mod.get_kernel):
            counts[name.split("<")[0]] += 1
            return _real(module, name)

        monkeypatch.setattr(mod, "get_kernel", counting)
    per_layer: dict[str, list[int]] = {"gdn": [], "attn": []}
    real_layer = m.module.layer

    def layer(cfg, backend, w, i, x, state, positions):
        before = sum(counts.values())
        out = real_layer(cfg, backend, w, i, x, state, positions)
        per_layer["gdn" if cfg.layer_types[i] == GDN else "attn"].append(sum(counts.values()) - before)
        return out

    monkeypatch.setattr(m.module, "layer", layer)
    be.use_graphs = False
    s = m.new_session(64)
    logits = s.prefill([1, 2, 3, 4, 5])
    counts.clear()
    for v in per_layer.values():
        v.clear()
    s.step(int(np.argmax(logits)))
    s.close()
    total = sum(counts.values())
    gdn = max(per_layer["gdn"], default=0)
    attn = max(per_layer["attn"], default=0)
    print(f"\n{label}: launches per eager decode step {total}, per GDN layer {gdn}, per attention layer "
          f"{attn}; by kernel {dict(counts)}")
    be.use_graphs = True
    be._graphs = {}
    s = m.new_session(64)
    logits = s.prefill([1, 2, 3, 4, 5])
    s.step(int(np.argmax(logits)))
    rec = next(iter(be._graphs.values()), None)
    nodes = _graph_nodes(getattr(rec, "graph", None)) if rec is not None else None
    s.close()
    print(f"{label}: graph nodes per decode step {nodes} for {m.config.n_layers} layers")
    return gdn, attn


@pytest.mark.parametrize("path", ["dp4a", "fma"])
def test_launches_per_decode_step_fixture(fixtures_dir, monkeypatch, path):
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model

    be = CupyBackend("cuda:0", path=path)
    # the default (f16) cache: attn_prep stores the row as f16, so the step has the f32 cache's launches
    m = load_model(fixtures_dir / "dense/qwen35-tiny-dense-q8_0.gguf", backend=be)
    gdn, attn = _count_launches(m, be, monkeypatch, f"fixture q8_0 {path}")
    # dp4a: the fixture's dv = 16 is not a whole q8 block, so ssm_out quantizes its input itself
    assert gdn <= (9 if path == "dp4a" else 8) and attn <= 10


def _synth(tmp_path):
    from minecart.engine.synth import write_synthetic

    path = tmp_path / "small.gguf"
    write_synthetic(path, "small-dense", "q8_0", seed=3)
    return path


@pytest.mark.parametrize("path", ["dp4a", "fma"])
def test_launches_per_decode_step_real_heads(tmp_path, monkeypatch, path):
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model

    be = CupyBackend("cuda:0", path=path)
    m = load_model(_synth(tmp_path), backend=be)  # the default f16 cache (attn_prep stores it)
    gdn, attn = _count_launches(m, be, monkeypatch, f"small-dense q8_0 {path}")
    assert gdn <= 8 and attn <= 10


@pytest.mark.parametrize("path", ["fma", "dp4a"])
def test_real_heads_greedy_matches_reference(tmp_path, path):
    """small-dense (real head dims: the fused kernels' full-size paths, q8 outputs included): greedy
    tokens of the graph decode equal eager decode, and (fma) every step's logits match the NumPy
    reference run over the same tokens."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model

    src = _synth(tmp_path)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 200, 12)]

    def greedy(m, n=24):
        s = m.new_session(len(prompt) + n + 1)
        logits = [np.asarray(s.prefill(prompt)).reshape(-1)]
        out = []
        for _ in range(n):
            out.append(int(np.argmax(logits[-1])))
            logits.append(np.asarray(s.step(out[-1])).reshape(-1))
        s.close()
        return out, np.stack(logits[:-1])

    graph_be = CupyBackend("cuda:0", path=path)
    eager_be = CupyBackend("cuda:0", path=path)
    eager_be.use_graphs = False
    g, g_logits = greedy(load_model(src, backend=graph_be))
    e, _ = greedy(load_model(src, backend=eager_be))
    print(f"\nsmall-dense {path}: graph {g[:12]}..., eager {e[:12]}...")
    assert g == e
    if path == "fma":
        ref = load_model(src, backend=NumpyBackend()).logits(prompt + g[:-1])[len(prompt) - 1 :]
        rel = np.abs(g_logits - ref).max(axis=1) / np.abs(ref).max(axis=1)
        print(f"small-dense fma vs numpy: max rel logit error per step {rel.max():.2e}")
        assert rel.max() < 1e-4


# ---- decode timings and the graph-style (device-side length) attention ----------------------------------

@pytest.mark.parametrize("N", [4096, 5120, 12288])
def test_rms_norm_q8_timing(N):
    """One decode row: rms_norm_q8 and add_rms_norm_q8 GPU time (printed), outputs checked."""
    from minecart.kernels import fused
    from minecart.kernels.probe import time_gpu

    rng = np.random.default_rng(N)
    x = rng.standard_normal((1, N)).astype(np.float32)
    d = rng.standard_normal((1, N)).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(N)).astype(np.float32)
    gx, gd, gw = cp.asarray(x), cp.asarray(d), cp.asarray(w)
    out, q8 = fused.rms_norm_q8(gx, gw, 1e-6)
    ref = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-6) * w
    assert nerr(cp.asnumpy(out), ref) < 1e-6
    _check_q8(out, q8)
    s, out, q8 = fused.rms_norm_q8(gx, gw, 1e-6, delta=gd)
    sr = x + d
    assert nerr(cp.asnumpy(s), sr) < 1e-7
    assert nerr(cp.asnumpy(out), sr / np.sqrt(np.mean(sr.astype(np.float64) ** 2) + 1e-6) * w) < 1e-6
    _check_q8(out, q8)
    t0 = time_gpu(lambda: fused.rms_norm_q8(gx, gw, 1e-6), 100)
    t1 = time_gpu(lambda: fused.rms_norm_q8(gx, gw, 1e-6, delta=gd), 100)
    print(f"\nrms_norm_q8 N={N} ({fused.rms_blocks(1, N)} blocks): rms {t0 * 1e6:.1f} us, add+rms {t1 * 1e6:.1f} us")


@pytest.mark.parametrize("T,N", [(1, 4096), (5, 5120), (2, 2080)])
def test_rms_norm_q8_spread_rows_are_one_block_rows_bit_for_bit(monkeypatch, poison, T, N):
    """A row spread over ceil(N / 256) blocks (decode) gives the bits of the row in one block (prefill):
    every block sums the row's squares in the same order. Unaligned inputs (a view 4 bytes in) too."""
    from minecart.kernels import fused

    rng = np.random.default_rng()
    buf = cp.asarray(rng.standard_normal(T * N + 1).astype(np.float32))
    x = buf[1:].reshape(T, N)  # 4 bytes past an aligned address: copied before the float4 loads
    d = cp.asarray(rng.standard_normal((T, N)).astype(np.float32))
    w = cp.asarray((1 + 0.2 * rng.standard_normal(N)).astype(np.float32))
    got = {}
    for spread in (fused.RMS_SPREAD_MAX_T, 0):
        monkeypatch.setattr(fused, "RMS_SPREAD_MAX_T", spread)
        assert fused.rms_blocks(T, N) == (math.ceil(N / 256) if spread else 1)
        poison()
        got[spread] = [cp.asnumpy(a) for a in (*fused.rms_norm_q8(x, w, 1e-6)[:1],
                                                  *fused.rms_norm_q8(x, w, 1e-6)[1],
                                                  *fused.rms_norm_q8(x, w, 1e-6, delta=d)[:2])]
    for a, b in zip(got[fused.RMS_SPREAD_MAX_T], got[0], strict=True):
        np.testing.assert_array_equal(a, b)
    xh = cp.asnumpy(x).astype(np.float64)
    ref = xh / np.sqrt(np.mean(xh ** 2, axis=1, keepdims=True) + 1e-6) * cp.asnumpy(w)
    assert nerr(got[0][0], ref) < 1e-6


def _ref_decode(q, kc, vc, L, scale, window):
    """Softmax attention of one token (nh, D) over cache rows [lo, L) in float64."""
    nh, D = q.shape
    G = nh // kc.shape[1]
    lo = max(0, L - window) if window > 0 else 0
    out = np.zeros((nh, D))
    for h in range(nh):
        K = kc[lo:L, h // G].astype(np.float64)
        s = K @ q[h].astype(np.float64) * scale
        e = np.exp(s - s.max())
        out[h] = e @ vc[lo:L, h // G].astype(np.float64) / e.sum()
    return out


@pytest.mark.parametrize("window", [0, 100])
def test_attention_decode_device_length(window):
    """Graph-style decode (length read from the device, splits sized for a capacity of 20480, slices
    for the length, splits past it skipped) equals the eager launch and a float64 reference at short and
    long contexts, for ops.attention (flash_merge_len) and the gated fused merge; GPU times printed."""
    from minecart.kernels import fused, ops
    from minecart.kernels.probe import time_gpu

    nh, n_kv, D, cap = 16, 4, 256, 20480  # Qwen3.5 9B attention
    rng = np.random.default_rng(11 + window)
    kc_h = rng.standard_normal((cap, n_kv, D), dtype=np.float32)
    vc_h = rng.standard_normal((cap, n_kv, D), dtype=np.float32)
    kc, vc = cp.asarray(kc_h), cp.asarray(vc_h)
    scale = 1.0 / 16
    for L in (1, 33, 70, 1000, 4096, 18432, cap):
        q = rng.standard_normal((1, nh, D)).astype(np.float32)
        qg = rng.standard_normal((1, nh, 2, D)).astype(np.float32)
        ref = _ref_decode(q[0], kc_h, vc_h, L, scale, window)
        gq, gqg = cp.asarray(q), cp.asarray(qg)
        lp = cp.asarray(np.array([L - 1], np.int32))
        o_dev = cp.asnumpy(ops.attention(gq, kc, vc, L - 1, L, scale, window, kv_len_ptr=lp)).reshape(nh, D)
        o_eag = cp.asnumpy(ops.attention(gq, kc, vc, L - 1, L, scale, window)).reshape(nh, D)
        assert nerr(o_dev, ref) < 2e-5, f"L={L}: device-length decode error {nerr(o_dev, ref):.2e}"
        assert nerr(o_eag, ref) < 2e-5, f"L={L}: eager decode error {nerr(o_eag, ref):.2e}"
        gate = 1.0 / (1.0 + np.exp(-qg[0, :, 1, :].astype(np.float64)))
        og, q8 = fused.attention_decode_gated(gq, gqg, kc, vc, L, scale, window, kv_len_ptr=lp, want_q8=True)
        oe, _ = fused.attention_decode_gated(gq, gqg, kc, vc, L, scale, window)
        for o, name in ((og, "device length"), (oe, "eager")):
            err = nerr(cp.asnumpy(o).reshape(nh, D), ref * gate)
            assert err < 2e-5, f"L={L}: gated {name} error {err:.2e}"
        _check_q8(og, q8)
        if window == 0 and L in (70, 4096, 18432):
            t_dev = time_gpu(lambda L=L, gq=gq, gqg=gqg, lp=lp: fused.attention_decode_gated(
                gq, gqg, kc, vc, L, scale, 0, kv_len_ptr=lp, want_q8=True), 50)
            t_eag = time_gpu(lambda L=L, gq=gq, gqg=gqg: fused.attention_decode_gated(
                gq, gqg, kc, vc, L, scale, 0, want_q8=True), 50)
            print(f"\nflash_decode + attn_merge_gate 9B shape, context {L}, capacity {cap}: graph style "
                  f"(kv_len_ptr) {t_dev * 1e6:.1f} us, eager split {t_eag * 1e6:.1f} us")


GEMV_VARIANTS = ("old", "split1", "split2", "split4", "split1pf", "split2pf", "stream1", "stream2", "auto", "autopf")


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_streaming_gemv_is_split1_bit_for_bit(monkeypatch, type_name):
    """gemv_dp4a_stream adds the same terms in the same order as gemv_dp4a_split with one warp per row:
    equal outputs, bit for bit, where each warp streams several rows (more rows than the card holds
    warps at once) and rows take several rounds (the next round's loads in flight across a row change),
    with and without the residual."""
    from minecart.kernels import ops
    from minecart.kernels.build import GEMV_STREAM

    rng = np.random.default_rng(17)
    streamed = False
    for R, K in ((9001, 2304), (4099, 12544), (70001, 256)):
        info = make_tensor(rng, type_name, (R, K), 0.05)
        w = ops.upload_weight(info.raw, type_name, (R, K))
        gx = cp.asarray(rng.standard_normal((1, K)).astype(np.float32))
        gr = cp.asarray(rng.standard_normal((1, R)).astype(np.float32))
        for nu in GEMV_STREAM:
            for res in (None, gr):
                monkeypatch.setattr(ops, "GEMV_VARIANT", "split1")
                want = cp.asnumpy(ops.matmul(gx, w, "dp4a", residual=res))
                monkeypatch.setattr(ops, "GEMV_VARIANT", f"stream{nu}")
                name, _, blocks = ops._single_gemv(w, R, K)
                assert name.startswith("gemv_dp4a_stream<"), name
                streamed = streamed or 4 * blocks < R
                got = cp.asnumpy(ops.matmul(gx, w, "dp4a", residual=res))
                np.testing.assert_array_equal(got, want, err_msg=f"stream{nu} {R}x{K} residual={res is not None}")
    assert streamed, "no shape had more rows than the card holds warps: the streaming loop went untested"


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_gemv_split_variants(monkeypatch, type_name):
    """Every single-token DP4A GEMV variant (ops.GEMV_VARIANT) against the q8_1 NumPy emulation, with
    and without the residual epilogue, at odd row counts, rows of one to several 4-block rounds per
    lane (partial last rounds, prefetch past the row end) and T = 3 (launches at token offsets)."""
    from minecart.kernels import ops

    from .test_kernels import q8_1_emulation

    nbk = NumpyBackend()
    rng = np.random.default_rng(7)
    for R, K in ((259, 512), (37, 12544), (1001, 4352), (4099, 256)):
        info = make_tensor(rng, type_name, (R, K), 0.05)
        w = ops.upload_weight(info.raw, type_name, (R, K))
        dense = nbk.load_weight(info).dense()
        for T in (1, 3):
            x = rng.standard_normal((T, K)).astype(np.float32)
            r = rng.standard_normal((T, R)).astype(np.float32)
            emu = q8_1_emulation(x, dense)
            for v in GEMV_VARIANTS:
                monkeypatch.setattr(ops, "GEMV_VARIANT", v)
                gx = cp.asarray(x)
                y = cp.asnumpy(ops.matmul(gx, w, "dp4a"))
                yr = cp.asnumpy(ops.matmul(gx, w, "dp4a", residual=cp.asarray(r)))
                assert nerr(y, emu) < 2e-5, f"{v} {R}x{K} T={T}: error {nerr(y, emu):.2e}"
                assert nerr(yr, emu + r) < 2e-5, f"{v} {R}x{K} T={T} +residual: error {nerr(yr, emu + r):.2e}"
    print(f"\ngemv split variants {type_name}: all of {', '.join(GEMV_VARIANTS)} agree with the emulation")


def test_gemv_model_shapes_timing(monkeypatch):
    """Q8_0 DP4A GEMV (T = 1) at the 9B decode step's concatenated shapes, for every variant of
    ops.GEMV_VARIANT: GPU time per launch, GB/s and % of copy bandwidth (printed). Several copies of
    each weight are cycled (> 200 MB) so the weights come from HBM, not L2, as in the model."""
    from minecart.kernels import ops
    from minecart.kernels.probe import measure_copy, random_q8_0, time_gpu

    copy = measure_copy()
    shapes = [(12352, 4096, False), (24576, 4096, False), (10240, 4096, False), (4096, 4096, True),
              (4096, 12288, True), (248320, 4096, False)]
    rng = np.random.default_rng(0)
    print(f"\ncopy bandwidth {copy:.0f} GB/s")
    total = dict.fromkeys(GEMV_VARIANTS, 0.0)
    calls = {(12352, 4096): 24, (24576, 4096): 32, (10240, 4096): 8, (4096, 4096): 32, (4096, 12288): 32,
             (248320, 4096): 1}  # launches per 9B decode step
    for R, K, with_res in shapes:
        per = R * K * (1 + 2 / 32)
        n = max(1, math.ceil(200e6 / per))
        ws = [random_q8_0(R, K, seed=i) for i in range(n)]
        x = cp.asarray(rng.standard_normal((1, K)).astype(np.float32))
        res = cp.asarray(rng.standard_normal((1, R)).astype(np.float32)) if with_res else None
        xq8 = ops.quantize_q8_1(x)
        ops.register_quantized(x, xq8)

        def run(ws=ws, x=x, res=res):
            for w in ws:
                ops.matmul(x, w, "dp4a", residual=res)

        for v in GEMV_VARIANTS:
            monkeypatch.setattr(ops, "GEMV_VARIANT", v)
            split = ops._gemv_split(R, K)
            t = time_gpu(run, 5) / n
            total[v] += t * calls[(R, K)]
            gbs = per / t / 1e9
            print(f"gemv {v:8s} {split} <Q8_0, 1> {R}x{K}{' +residual' if with_res else ''}: {t * 1e6:.1f} us, "
                  f"{gbs:.0f} GB/s = {100 * gbs / copy:.0f}% of copy")
        del ws
    print("GEMV GPU time per 9B decode step by variant: "
          + ", ".join(f"{v} {t * 1e3:.3f} ms" for v, t in total.items()))
