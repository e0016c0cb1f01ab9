"""The MoE decode block of kernels/moe.py (decode_block: moe_dec_router, moe_dec_gate_up, moe_dec_down)
on the GPU, against float64 NumPy math on fresh random weights of every DP4A expert format.

- Each block (T = 1, 3, 8; with and without a shared expert, its down matrix in the routed format or
  apart; with and without a residual): the logits equal x @ router^T (fp32 against float64: 1e-5), the
  routing equals a stable top-k of the GPU's own logits exactly (ids) and the NumPy backend's weights
  (1e-4), h and the output equal the float64 MoE block on the dequantized weights within the DP4A
  tolerance of tests/gpu/test_moe_kernels.py (3e-2; the activations and h are int8 there).
- Ties: experts with identical router rows (bit-identical logits) are taken lower index first.
- Three launches (four with the shared down apart), a CUDA-graph replay bit-identical to the eager run.
- CupyBackend.moe_block takes the decode block for a few tokens and equals its composed ops (2e-3).
- The tiny MoE models (Q8_0 fused gate/up, Q4_0 apart): greedy decode through the decode block gives
  the same 32 tokens as through the composed ops, and the block ran.
Outputs are poisoned with NaN first (fixture `poison`).
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.gguf_file import TensorInfo

from tests.kernels.test_moe_decode_emulation import reference_route

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

# (gate, up or None for one gate_up stack, down, shared gate/up or None, shared down, H, F, Fs, E, k)
FORMATS = [
    ("Q4_K", "Q4_K", "Q4_K", "Q4_K", "Q4_K", 2048, 512, 512, 16, 8),  # the 35B-A3B block, fewer experts
    ("Q4_K", "Q4_K", "Q6_K", "Q8_0", "Q6_K", 512, 256, 256, 32, 8),
    ("Q8_0", None, "Q8_0", "Q8_0", "Q4_0", 160, 96, 64, 8, 2),  # shared down apart: 4 launches
    ("Q4_0", "Q4_0", "Q4_0", None, None, 96, 64, 32, 12, 3),
    ("Q6_K", None, "Q4_K", "Q4_K", "Q8_0", 256, 256, 512, 9, 4),
    ("Q5_K", "Q5_K", "Q5_K", "Q5_K", "Q5_K", 256, 256, 256, 8, 2),
    ("Q4_1", "Q4_1", "IQ4_XS", "Q5_0", "IQ4_XS", 256, 256, 256, 10, 4),
    ("Q5_1", None, "IQ4_NL", "IQ4_NL", "Q5_0", 160, 96, 96, 8, 3),
]
TYPE_IDS = {"Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_K": Q.Q4_K, "Q6_K": Q.Q6_K, "Q5_K": Q.Q5_K, "Q4_1": Q.Q4_1,
            "Q5_0": Q.Q5_0, "Q5_1": Q.Q5_1, "IQ4_NL": Q.IQ4_NL, "IQ4_XS": Q.IQ4_XS}
FMT_IDS = [f"{g}-{u or 'fused'}-{d}-sh{s or 'none'}-{sd or ''}" for g, u, d, s, sd, *_ in FORMATS]


def nerr(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the GPU result (an output left unwritten?)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _raw(rng, type_name: str, shape, std: float) -> np.ndarray:
    if type_name == "Q5_K":  # no NumPy quantizer: random blocks with sane scales
        from tests.gpu.test_kquant_gemv import sane_blocks

        rows = int(np.prod(shape[:-1]))
        return sane_blocks("Q5_K", rows, shape[-1], rng).reshape(*shape[:-1], -1)
    vals = (rng.standard_normal(shape) * std).astype(np.float32)
    return Q.quantize(vals, TYPE_IDS[type_name])


def weight(rng, type_name: str, shape, std: float = 1.0):
    """A random (E, R, K) or (R, K) matrix in `type_name` (F32 as is): (QWeight on the device, dense
    float64 with the same shape)."""
    from minecart.kernels import ops

    shape = tuple(shape)
    if type_name == "F32":
        a = (rng.standard_normal(shape) * std).astype(np.float32)
        return ops.upload_weight(a.view(np.uint8), "F32", shape), a.astype(np.float64)
    raw = _raw(rng, type_name, shape, std / np.sqrt(shape[-1]))
    info = TensorInfo(name="w", ggml_type=TYPE_IDS[type_name], type_name=type_name, shape=shape,
                      raw=raw.reshape(-1, raw.shape[-1]), n_bytes=int(raw.nbytes))
    dense = Q.dequantize(info).astype(np.float64).reshape(shape)
    return ops.upload_weight(raw, type_name, shape), dense


def make_block(rng, fmt):
    """Device weights and their float64 twins for one FORMATS row."""
    from minecart.kernels import moe

    g_t, u_t, d_t, s_t, sd_t, H, F, Fs, E, k = fmt
    router, R = weight(rng, "F32", (E, H), 2.0 / np.sqrt(H))
    if u_t is None:
        gate, Gu = weight(rng, g_t, (E, 2 * F, H))
        up, G, U = None, Gu[:, :F], Gu[:, F:]
    else:
        gate, G = weight(rng, g_t, (E, F, H))
        up, U = weight(rng, u_t, (E, F, H))
    down, D = weight(rng, d_t, (E, H, F))
    shared, dense_shared = None, None
    if s_t is not None:
        gi, GI = weight(rng, "F32", (1, H), 1.0 / np.sqrt(H))
        sg, SG = weight(rng, s_t, (Fs, H))
        su, SU = weight(rng, s_t, (Fs, H))
        sd, SD = weight(rng, sd_t, (H, Fs))
        shared, dense_shared = moe.SharedExpert(gi, sg, su, sd), (GI, SG, SU, SD)
    return (router, gate, up, down, shared, k), (R, G, U, D, dense_shared)


def silu(v):
    return v / (1.0 + np.exp(-v))


def reference(x, logits_gpu, dense, k, residual):
    """The float64 block routed on the GPU's logits: (out (T, H), h (T k, F), ids, wts)."""
    R, G, U, D, sh = dense
    E = R.shape[0]
    T = x.shape[0]
    x = x.astype(np.float64)
    out = np.zeros((T, D.shape[1]))
    hs, ids_all, wts_all = [], [], []
    for t in range(T):
        ids, wts = reference_route(logits_gpu[t, :E], k)
        for e, w in zip(ids, wts, strict=True):
            h = silu(G[e] @ x[t]) * (U[e] @ x[t])
            hs.append(h)
            out[t] += w * (D[e] @ h)
        if sh is not None:
            GI, SG, SU, SD = sh
            gate = 1.0 / (1.0 + np.exp(-(GI[0] @ x[t])))
            out[t] += gate * (SD @ (silu(SG @ x[t]) * (SU @ x[t])))
        ids_all.append(ids)
        wts_all.append(wts)
    if residual is not None:
        out += residual
    return out, np.array(hs), np.concatenate(ids_all), np.concatenate(wts_all)


def q8_values(hq8) -> np.ndarray:
    q, d = cp.asnumpy(hq8[0]).astype(np.float64), cp.asnumpy(hq8[1]).astype(np.float64)
    P, F = q.shape
    return (q.reshape(P, F // 32, 32) * d[..., None]).reshape(P, F)


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_decode_block_matches_float64(poison, fmt, T):
    from minecart.kernels import moe

    rng = np.random.default_rng(zlib.crc32(f"{fmt}-{T}".encode()))
    (router, gate, up, down, shared, k), dense = make_block(rng, fmt)
    H = gate.cols
    x = rng.standard_normal((T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32) if T != 3 else None
    poison()
    r = moe.decode_block_parts(cp.asarray(x), router, gate, up, down, k, shared,
                               None if res is None else cp.asarray(res))
    logits = cp.asnumpy(r.logits)
    E = router.rows
    want_logits = x.astype(np.float64) @ dense[0].T
    assert nerr(logits[:, :E], want_logits) < 1e-5
    if shared is not None:
        assert nerr(logits[:, E], x.astype(np.float64) @ dense[4][0][0]) < 1e-5
    out, h, ids, wts = reference(x, logits, dense, k, None if res is None else res.astype(np.float64))
    got_ids = cp.asnumpy(r.ids)
    assert np.array_equal(got_ids, ids), f"routing {got_ids} != stable top-{k} {ids}"
    np.testing.assert_allclose(cp.asnumpy(r.wts), wts, rtol=1e-4, atol=1e-7)
    e_h = nerr(q8_values(r.h), h)
    got = cp.asnumpy(r.out)
    if res is not None:  # the residual's size must not hide the block's error
        e_out = nerr(got - res, out - res)
    else:
        e_out = nerr(got, out)
    print(f"\n{fmt[:5]} T={T}: h err {e_h:.2e}, out err {e_out:.2e}")
    assert e_h < 3e-2 and e_out < 3e-2


def test_ties_go_to_the_lower_expert(poison):
    """Experts 3, 40 and 200 with one router row (bit-identical logits, the largest): taken in that
    order, as a stable sort; the same with experts 7 and 8 in the same lane of the warp (7 and 39)."""
    from minecart.kernels import moe

    rng = np.random.default_rng(4)
    fmt = ("Q8_0", "Q8_0", "Q8_0", None, None, 64, 32, 32, 256, 8)
    (router, gate, up, down, shared, k), dense = make_block(rng, fmt)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    R = dense[0].astype(np.float32)
    top = (x[0] / np.linalg.norm(x[0]) * 3.0).astype(np.float32)  # a row with a large logit for token 0
    for e in (3, 40, 200, 7, 39):
        R[e] = top
    from minecart.kernels import ops

    router = ops.upload_weight(np.ascontiguousarray(R).view(np.uint8), "F32", R.shape)
    poison()
    r = moe.decode_block_parts(cp.asarray(x), router, gate, up, down, k, None, None)
    logits = cp.asnumpy(r.logits)
    assert len({float(logits[0, e]) for e in (3, 40, 200, 7, 39)}) == 1
    ids = cp.asnumpy(r.ids).reshape(2, k)
    assert list(ids[0, :5]) == [3, 7, 39, 40, 200]
    for t in range(2):
        assert np.array_equal(ids[t], np.argsort(-logits[t, :256].astype(np.float64), kind="stable")[:k])
    w = cp.asnumpy(r.wts).reshape(2, k)
    assert np.all(w[0, :5] == w[0, 0]) and np.isclose(w.sum(axis=1), 1.0, rtol=1e-5).all()


def test_a_whole_top_k_in_one_warp(poison):
    """Experts 64..71 (all in the third warp of moe_dec_gate_up's routing) with the largest logits of
    token 0, two of them tied: the warp's own top k are the candidates, so all eight are taken, in the
    stable order; token 1 routes as usual."""
    from minecart.kernels import moe, ops

    rng = np.random.default_rng(5)
    fmt = ("Q8_0", "Q8_0", "Q8_0", None, None, 64, 32, 32, 256, 8)
    (router, gate, up, down, shared, k), dense = make_block(rng, fmt)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    R = dense[0].astype(np.float32)
    top = (x[0] / np.linalg.norm(x[0]) * 3.0).astype(np.float32)
    for e, scale in zip(range(64, 72), [1.5, 2.0, 1.75, 1.75, 1.25, 1.875, 2.5, 1.125], strict=True):
        R[e] = top * np.float32(scale)
    router = ops.upload_weight(np.ascontiguousarray(R).view(np.uint8), "F32", R.shape)
    poison()
    r = moe.decode_block_parts(cp.asarray(x), router, gate, up, down, k, None, None)
    logits = cp.asnumpy(r.logits)
    ids = cp.asnumpy(r.ids).reshape(2, k)
    assert sorted(ids[0]) == list(range(64, 72))
    for t in range(2):
        assert np.array_equal(ids[t], np.argsort(-logits[t, :256].astype(np.float64), kind="stable")[:k])
    np.testing.assert_allclose(cp.asnumpy(r.wts), np.concatenate(
        [reference_route(logits[t, :256], k)[1] for t in range(2)]), rtol=1e-4, atol=1e-7)


def _count_launches(monkeypatch):
    from minecart.kernels import moe, ops

    n = {"launches": 0}

    def counting(get):
        def wrapped(*a, **kw):
            kern = get(*a, **kw)

            def launch(*la, **lkw):
                n["launches"] += 1
                return kern(*la, **lkw)

            return launch

        return wrapped

    monkeypatch.setattr(moe, "get_kernel", counting(moe.get_kernel))
    monkeypatch.setattr(ops, "get_kernel", counting(ops.get_kernel))
    return n


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[2], FORMATS[3]], ids=[FMT_IDS[0], FMT_IDS[2], FMT_IDS[3]])
def test_launches_and_graph_replay(monkeypatch, fmt):
    """3 launches (4 with the shared down apart) once x's q8_1 exists (the norm before the block
    makes it); a CUDA graph of the block replays to the eager result bit for bit."""
    from minecart.kernels import moe, ops
    from minecart.kernels.probe import begin_capture

    rng = np.random.default_rng(9)
    (router, gate, up, down, shared, k), _ = make_block(rng, fmt)
    x = cp.asarray(rng.standard_normal((1, gate.cols)).astype(np.float32))
    res = cp.asarray(rng.standard_normal((1, gate.cols)).astype(np.float32))
    ops.register_quantized(x, ops.quantize_q8_1(x))
    eager = cp.asnumpy(moe.decode_block(x, router, gate, up, down, k, shared, res))
    ops.register_quantized(x, ops.quantize_q8_1(x))  # (a shared down apart republished its input's)
    n = _count_launches(monkeypatch)
    again = cp.asnumpy(moe.decode_block(x, router, gate, up, down, k, shared, res))
    apart = shared is not None and shared.down.type_name != down.type_name
    assert n["launches"] == (4 if apart else 3)
    assert np.array_equal(eager, again), "the decode block is not deterministic"
    monkeypatch.undo()
    stream = cp.cuda.Stream(non_blocking=False)
    pool = cp.get_default_memory_pool()
    kept = []

    def keep_alloc(size):
        mem = pool.malloc(size)
        kept.append(mem)
        return mem

    with stream:
        ops.register_quantized(x, ops.quantize_q8_1(x))
        stream.synchronize()
        cp.cuda.set_allocator(keep_alloc)
        try:
            begin_capture(stream)
            try:
                out = moe.decode_block(x, router, gate, up, down, k, shared, res)
            finally:
                graph = stream.end_capture()
        finally:
            cp.cuda.set_allocator(pool.malloc)
        out.fill(cp.nan)
        graph.launch(stream)
        stream.synchronize()
        assert np.array_equal(cp.asnumpy(out), eager)
        graph.launch(stream)  # replayed again: the same
        stream.synchronize()
        assert np.array_equal(cp.asnumpy(out), eager)
    kept.clear()


@pytest.fixture(scope="module")
def gb():
    from minecart.engine.backends.cupy_backend import CupyBackend

    return CupyBackend("cuda:0", probe=False)


@pytest.mark.parametrize("fmt", [FORMATS[1], FORMATS[2], FORMATS[3]], ids=[FMT_IDS[1], FMT_IDS[2], FMT_IDS[3]])
@pytest.mark.parametrize("T", [1, 5])
def test_backend_moe_block_takes_the_decode_block(monkeypatch, gb, fmt, T):
    """CupyBackend.moe_block: the decode block for a few tokens (it runs once), equal to the composed
    ops (routed_experts + the shared expert's matmuls + adds) on the same device."""
    from minecart.engine.backends.base import MoeShared
    from minecart.engine.backends.cupy_backend import CupyWeight
    from minecart.kernels import moe

    if not gb.gemv_path.startswith("dp4a"):
        pytest.skip(f"this card's decode path is {gb.gemv_path}")
    rng = np.random.default_rng(21 + T)
    (router, gate, up, down, shared, k), _ = make_block(rng, fmt)

    def cw(name, q, role="matmul"):
        shape = (q.experts, q.rows, q.cols) if q.experts > 1 or role == "experts" else (q.rows, q.cols)
        return CupyWeight(name, shape, q.type_name, q, role)

    ws = (cw("router", router), cw("gate", gate, "experts"), None if up is None else cw("up", up, "experts"),
          cw("down", down, "experts"))
    sh = None if shared is None else MoeShared(cw("gi", shared.gate_inp), cw("sg", shared.gate),
                                               cw("su", shared.up), cw("sd", shared.down))
    x = cp.asarray(rng.standard_normal((T, gate.cols)).astype(np.float32))
    res = cp.asarray(rng.standard_normal((T, gate.cols)).astype(np.float32))
    calls = {"n": 0}
    real = moe.decode_block

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(moe, "decode_block", counted)
    fused = cp.asnumpy(gb.moe_block(x, *ws, k, sh, res))
    assert calls["n"] == 1
    monkeypatch.setattr(moe, "decode_block_problem", lambda *a: "off for the test")
    composed = cp.asnumpy(gb.moe_block(x, *ws, k, sh, res))
    assert calls["n"] == 1
    resn = cp.asnumpy(res)
    e = nerr(fused - resn, composed - resn)
    print(f"\n{fmt[:5]} T={T}: decode block vs composed ops {e:.2e}")
    assert e < 2e-3


@pytest.mark.parametrize("quant,layout", [("q8_0", "fused"), ("q4_0", "separate")])
def test_tiny_moe_greedy_through_the_decode_block(monkeypatch, tmp_path, quant, layout):
    """Greedy decode of a tiny MoE model (graphs on) through the decode block equals the same model
    through the composed ops, token for token, and the block did run."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model
    from minecart.engine.synth import SHAPES, write_synthetic
    from minecart.kernels import moe

    from tests.gpu._compare import greedy

    path = tmp_path / f"tiny-moe-{quant}.gguf"
    write_synthetic(path, replace(SHAPES["tiny-moe"], vocab_size=640), quant, seed=11,
                    fuse_gate_up=layout == "fused")
    ids = [int(t) for t in np.random.default_rng(7).integers(0, 600, 40)]

    backends = []

    def run():  # the DP4A path, whatever this card's probe would pick
        backends.append(CupyBackend("cuda:0", path="dp4a"))
        return greedy(load_model(path, backend=backends[-1]), ids, 32)

    calls = {"n": 0}
    real = moe.decode_block

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(moe, "decode_block", counted)
    a = run()
    assert calls["n"] > 0, "decode never took the MoE decode block"
    assert backends[0]._graphs, "decode never used a CUDA graph"
    monkeypatch.setattr(moe, "decode_block_problem", lambda *a: "off for the test")
    n_before = calls["n"]
    b = run()
    assert calls["n"] == n_before
    agree = next((i for i, (p, q) in enumerate(zip(a, b, strict=True)) if p != q), 32)
    print(f"\ntiny MoE {quant} {layout}: decode block vs composed ops, greedy identical prefix {agree}/32")
    assert a == b


def test_tiny_moe_graph_decode_through_the_block_matches_eager(tmp_path):
    """The DP4A decode step with the decode block, replayed as a CUDA graph, equals the eager step."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model
    from minecart.engine.synth import SHAPES, write_synthetic

    from tests.gpu._compare import graph_vs_eager

    path = tmp_path / "tiny-moe-q8_0.gguf"
    write_synthetic(path, replace(SHAPES["tiny-moe"], vocab_size=640), "q8_0", seed=11, fuse_gate_up=True)
    ids = [int(t) for t in np.random.default_rng(9).integers(0, 600, 30)]
    gbe, ebe = CupyBackend("cuda:0", path="dp4a"), CupyBackend("cuda:0", path="dp4a")
    ebe.use_graphs = False
    mg, me = load_model(path, backend=gbe), load_model(path, backend=ebe)
    sg, se = mg.new_session(len(ids) + 4), me.new_session(len(ids) + 4)  # the caches must grow
    worst = graph_vs_eager(sg, se, ids, 24)
    print(f"\ntiny MoE q8_0 (decode block): graph vs eager decode max rel err {worst:.2e}")
    assert gbe._graphs, "decode never used a CUDA graph"
