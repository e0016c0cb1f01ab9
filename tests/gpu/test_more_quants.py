"""GPU kernels of the Q32 formats (Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS) on every path against NumPy
dequantize-then-matmul, on fresh random inputs, outputs poisoned with NaN first: decode GEMV (DP4A,
every single-token split variant, FMA, HFMA2, with the residual epilogue), prefill GEMM (DP4A with one
and two quant blocks per stage, FMA, HFMA2), expert GEMVs, embedding rows, a concatenated projection
group, and whole tiny Gemma 3 models whose matrices use these formats (logits, greedy tokens, graph
decode against eager).

Tolerances (||gpu - ref|| / ||ref||): 2e-5 for fp32 paths and for DP4A against the exact q8_1 emulation
(same int8 activations), 1.5e-2 for DP4A against fp32, HFMA2 as tests/gpu/test_hfma2.py.

    pytest -s tests/gpu/test_more_quants.py
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.gguf_file import TensorInfo

from tests import _gemma3 as G
from tests.gpu._compare import compare, graph_vs_eager, greedy

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

FORMATS = ("Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")


def nerr(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the GPU result (an output left unwritten?)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_tensor(rng, type_name: str, shape, std: float = 0.05, name: str = "w") -> TensorInfo:
    vals = (rng.standard_normal(shape) * std).astype(np.float32)
    vals += np.float32(std) * rng.standard_normal(shape[:-1] + (1,)).astype(np.float32)  # row offsets (Q4_1/Q5_1 m)
    tid = Q.TYPE_IDS[type_name]
    raw = Q.quantize(vals, tid)
    raw2 = raw.reshape(-1, raw.shape[-1])
    return TensorInfo(name=name, ggml_type=tid, type_name=type_name, shape=tuple(shape), raw=raw2,
                      n_bytes=int(raw.nbytes))


def q8_1_dequant(x: np.ndarray) -> np.ndarray:
    """x as the DP4A path sees it: rounded to int8 per 32 values with d = max|x| / 127 (fp64)."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32).astype(np.float32)
    d = np.abs(xb).max(axis=2, keepdims=True) / np.float32(127.0)
    q = np.where(d > 0, np.rint(xb / np.where(d > 0, d, 1)), 0)
    return (q * d).reshape(T, K).astype(np.float64)


def ks_for(type_name: str) -> list[int]:
    # a short row (3 blocks: odd for the two-block GEMM stages) and a long one (several GEMV rounds)
    return [256, 4352] if type_name == "IQ4_XS" else [96, 4352]


@pytest.fixture(scope="module")
def nb():
    return NumpyBackend(int_experts=False)


def _backend(path):
    from minecart.engine.backends.cupy_backend import CupyBackend

    return CupyBackend("cuda:0", path=path)


@pytest.fixture(scope="module")
def backends():
    return {p: _backend(p) for p in ("dp4a", "dp4a2", "fma", "hfma2")}


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("K_index", [0, 1])
@pytest.mark.parametrize("T", [1, 3, 8, 13, 130])
def test_matmul_every_path(nb, backends, poison, type_name, K_index, T):
    K = ks_for(type_name)[K_index]
    rng = np.random.default_rng(hash((type_name, K, T)) % 2**32)
    R = 259
    info = make_tensor(rng, type_name, (R, K))
    x = rng.standard_normal((T, K)).astype(np.float32)
    wd = nb.load_weight(info).dense().astype(np.float64)
    ref = x.astype(np.float64) @ wd.T
    emu = q8_1_dequant(x) @ wd.T
    for path, be in backends.items():
        poison()
        y = be.to_numpy(be.matmul(be.asarray(x), be.load_weight(info)))
        assert y.shape == (T, R)
        if path.startswith("dp4a"):
            e_emu, e_ref = nerr(y, emu), nerr(y, ref)
            assert e_emu < 2e-5 and e_ref < 1.5e-2, (path, e_emu, e_ref)
        elif path == "fma":
            assert nerr(y, ref) < 2e-5, path
        else:  # hfma2: fp16 products over one block
            d = np.abs(y - ref)
            assert d.max() / np.abs(ref).max() < 1e-2 and nerr(y, ref) < 5e-3, path


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("variant", ["old", "split1", "split2", "split4", "split1pf", "split2pf", "stream1", "stream2"])
def test_single_token_gemv_variants(nb, backends, poison, monkeypatch, type_name, variant):
    from minecart.kernels import ops

    monkeypatch.setattr(ops, "GEMV_VARIANT", variant)
    be = backends["dp4a"]
    rng = np.random.default_rng(hash((type_name, variant)) % 2**32)
    for K in ks_for(type_name):
        info = make_tensor(rng, type_name, (131, K))
        x = rng.standard_normal((1, K)).astype(np.float32)
        emu = q8_1_dequant(x) @ nb.load_weight(info).dense().astype(np.float64).T
        poison()
        y = be.to_numpy(be.matmul(be.asarray(x), be.load_weight(info)))
        assert nerr(y, emu) < 2e-5, K


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("T", [1, 3])
def test_residual_epilogue(nb, backends, poison, type_name, T):
    rng = np.random.default_rng(T + len(type_name))
    K = ks_for(type_name)[1]
    info = make_tensor(rng, type_name, (77, K))
    x = rng.standard_normal((T, K)).astype(np.float32)
    res = rng.standard_normal((T, 77)).astype(np.float32)
    wd = nb.load_weight(info).dense().astype(np.float64)
    for path in ("dp4a", "fma"):
        be = backends[path]
        poison()
        y = be.to_numpy(be.matmul_add(be.asarray(x), be.load_weight(info), be.asarray(res)))
        xin = q8_1_dequant(x) if path == "dp4a" else x.astype(np.float64)
        assert nerr(y, xin @ wd.T + res) < 2e-5, path


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("path", ["dp4a", "fma"])
def test_matmul_experts(nb, poison, type_name, path):
    """ops.matmul_experts (gemv_dp4a / gemv_fma with expert ids): row p = x[p // x_div] @ W[ids[p]]^T."""
    from minecart.kernels import ops

    rng = np.random.default_rng(hash((type_name, path)) % 2**32)
    E, R, K = 5, 67, ks_for(type_name)[0] * 2
    info = make_tensor(rng, type_name, (E, R, K), name="experts")
    dense = Q.dequantize(info).astype(np.float64)
    x = rng.standard_normal((4, K)).astype(np.float32)
    ids = rng.integers(0, E, 4 * 3).astype(np.int32)  # 3 experts per token
    xin = q8_1_dequant(x) if path == "dp4a" else x.astype(np.float64)
    ref = np.stack([xin[p // 3] @ dense[ids[p]].T for p in range(ids.size)])
    w = ops.upload_weight(np.asarray(info.raw), type_name, (E, R, K))
    poison()
    y = cp.asnumpy(ops.matmul_experts(cp.asarray(x), w, cp.asarray(ids), 3, path))
    assert nerr(y, ref) < 2e-5


@pytest.mark.parametrize("type_name", FORMATS)
def test_embed(nb, backends, poison, type_name):
    rng = np.random.default_rng(len(type_name))
    info = make_tensor(rng, type_name, (301, 512), 0.5, name="token_embd.weight")
    ids = [0, 300, 17, 17, 150]
    be = backends["dp4a"]
    poison()
    y = be.to_numpy(be.embed(be.load_weight(info, role="embedding"), ids))
    np.testing.assert_allclose(y, Q.dequantize(info)[ids], rtol=1e-6, atol=0)


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("T", [1, 13])
def test_concatenated_group(nb, backends, poison, type_name, T):
    """load_fused concatenates a group's rows in the kernels' layout; matmul_many over it equals the
    separate matmuls."""
    be = backends["dp4a"]
    rng = np.random.default_rng(T * 7 + len(type_name))
    K = ks_for(type_name)[0] * 2
    infos = [make_tensor(rng, type_name, (r, K), name=f"w{i}") for i, r in enumerate((64, 32, 96))]
    x = be.asarray(rng.standard_normal((T, K)).astype(np.float32))
    group = be.load_fused(infos)
    poison()
    outs = [be.to_numpy(o) for o in be.matmul_many(x, group)]
    for info, out in zip(infos, outs, strict=True):
        alone = be.to_numpy(be.matmul(x, be.load_weight(info)))
        assert nerr(out, alone) < 1e-6, info.name


# (gate, up or None for a fused gate/up stack, down, H, F): every Q32 format in the MoE kernels (moe.cu;
# gate and up share a format there), Q4_1 / Q5_1 with their offsets in the grouped GEMM and the decode
# kernels
MOE_FORMATS = [("Q4_1", "Q4_1", "IQ4_XS", 256, 256), ("Q5_0", None, "IQ4_NL", 160, 96),
               ("IQ4_XS", "IQ4_XS", "Q4_1", 256, 96), ("IQ4_NL", "IQ4_NL", "Q5_1", 128, 64),
               ("Q5_1", None, "Q5_0", 128, 64)]


@pytest.mark.parametrize("fmt", MOE_FORMATS, ids=[f"{g}-{u or 'fused'}-{d}" for g, u, d, _, _ in MOE_FORMATS])
@pytest.mark.parametrize("T,k,how", [(1, 8, "random"), (9, 8, "random"), (130, 8, "one")])
def test_routed_experts(backends, poison, fmt, T, k, how):
    """kernels/moe.py routed_experts (decode kernels for T <= 8, the grouped GEMM above) on these formats,
    against the float MoE and the q8 chain of tests/gpu/test_moe_kernels.py (same tolerances)."""
    from minecart.kernels import moe

    from tests.gpu.test_moe_kernels import dev_q8, float_moe, q8_chain
    from tests.kernels.test_moe_emulation import route

    gt, ut, dt, H, F = fmt
    be = backends["dp4a"]
    rng = np.random.default_rng(hash((fmt, T)) % 2**32)
    E = 16

    def stack(type_name, R, K):
        info = make_tensor(rng, type_name, (E, R, K), 0.1, name="exps")
        return be.load_weight(info, role="experts").q, Q.dequantize(info).astype(np.float64)

    gate, Wg = stack(gt, F if ut else 2 * F, H)
    up, Wu = stack(ut, F, H) if ut else (None, Wg[:, F:])
    Wg = Wg[:, :F]
    down, Wd = stack(dt, H, F)
    assert moe.supported(gate, up, down)
    ids, wts = route(rng, T, E, k, how)
    x = rng.standard_normal((T, H)).astype(np.float32)
    _, xv = dev_q8(x)
    poison()
    out = cp.asnumpy(moe.routed_experts(cp.asarray(x), cp.asarray(ids), cp.asarray(wts), gate, up, down, k))
    e_float = nerr(out, float_moe(x, ids, wts, Wg, Wu, Wd, k))
    e_chain = nerr(out, q8_chain(xv, ids, wts, Wg, Wu, Wd, k))
    print(f"\nrouted experts {fmt[:3]} T={T} k={k}: vs float {e_float:.2e}, vs q8 chain {e_chain:.2e}")
    assert e_float < 3e-2 and e_chain < 5e-3


# ---- whole models -------------------------------------------------------------------------------

PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, G.VOCAB, 40)]
# per layer: the type of the projections reading the hidden state (rows of HIDDEN = 128 values) and of
# those reading 256 values (attn_output, ffn_down: IQ4_XS needs rows of 256)
MIXED = [("Q5_0", "IQ4_XS"), ("Q4_1", "Q5_0"), ("Q5_1", "IQ4_XS"), ("IQ4_NL", "Q5_1"), ("Q5_0", "IQ4_NL"),
         ("Q4_1", "IQ4_XS"), ("Q5_1", "Q4_1")]


def quantized_gemma3_file(path, layer_types, embd_type: str, seed: int = 0):
    """The tiny Gemma 3 of tests/_gemma3.py with its matrices stored in the given formats."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(G.LAYERS)
    w.add_embedding_length(G.HIDDEN)
    w.add_head_count(G.HEADS)
    w.add_head_count_kv(G.KV_HEADS)
    w.add_key_length(G.HEAD_DIM)
    w.add_value_length(G.HEAD_DIM)
    w.add_context_length(4096)
    w.add_feed_forward_length(G.FFN)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(G.WINDOW)
    w.add_rope_freq_base(1_000_000.0)

    def mat(name: str, rows: int, cols: int, type_name: str, scale: float = 0.7) -> None:
        vals = (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)
        qt = gguf.GGMLQuantizationType[type_name]
        w.add_tensor(name, Q.quantize(vals, int(qt)), raw_dtype=qt)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    embd = (rng.standard_normal((G.VOCAB, G.HIDDEN)) * 0.05).astype(np.float32)
    qt = gguf.GGMLQuantizationType[embd_type]
    w.add_tensor("token_embd.weight", Q.quantize(embd, int(qt)), raw_dtype=qt)
    for i in range(G.LAYERS):
        p = f"blk.{i}."
        t_in, t_wide = layer_types[i]
        w.add_tensor(p + "attn_norm.weight", norm(G.HIDDEN))
        mat(p + "attn_q.weight", G.HEADS * G.HEAD_DIM, G.HIDDEN, t_in)
        mat(p + "attn_k.weight", G.KV_HEADS * G.HEAD_DIM, G.HIDDEN, t_in)
        mat(p + "attn_v.weight", G.KV_HEADS * G.HEAD_DIM, G.HIDDEN, t_in)
        w.add_tensor(p + "attn_q_norm.weight", norm(G.HEAD_DIM))
        w.add_tensor(p + "attn_k_norm.weight", norm(G.HEAD_DIM))
        mat(p + "attn_output.weight", G.HIDDEN, G.HEADS * G.HEAD_DIM, t_wide, 0.3)
        w.add_tensor(p + "post_attention_norm.weight", norm(G.HIDDEN))
        w.add_tensor(p + "ffn_norm.weight", norm(G.HIDDEN))
        mat(p + "ffn_gate.weight", G.FFN, G.HIDDEN, t_in)
        mat(p + "ffn_up.weight", G.FFN, G.HIDDEN, t_in)
        mat(p + "ffn_down.weight", G.HIDDEN, G.FFN, t_wide, 0.3)
        w.add_tensor(p + "post_ffw_norm.weight", norm(G.HIDDEN))
    w.add_tensor("output_norm.weight", norm(G.HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


EXPECTED_TYPES = {"q5_0": {"Q5_0"}, "mixed": set(FORMATS)}


@pytest.fixture(scope="module")
def gemma_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("g3q")
    return {"q5_0": quantized_gemma3_file(d / "gemma3-q5_0.gguf", [("Q5_0", "Q5_0")] * G.LAYERS, "Q5_0"),
            "mixed": quantized_gemma3_file(d / "gemma3-mixed.gguf", MIXED, "IQ4_NL", seed=1)}


def _gpu_model(path, gpu_path, graphs=True):
    from minecart.engine.model import load_model

    be = _backend(gpu_path)
    be.use_graphs = graphs
    return load_model(path, backend=be), be


@pytest.mark.parametrize("which", ["q5_0", "mixed"])
@pytest.mark.parametrize("gpu_path", ["fma", "dp4a", "hfma2"])
def test_gemma3_quantized_matches_numpy(gemma_files, which, gpu_path):
    from minecart.engine.model import load_model

    path = gemma_files[which]
    ref = load_model(path, devices=["cpu:0"])
    model, be = _gpu_model(path, gpu_path)
    kinds = {w.type_name for w in _weights(model)}
    assert kinds == EXPECTED_TYPES[which], f"matrices not kept in their formats on the GPU: {kinds}"
    r = compare(ref.logits(PROMPT), model.logits(PROMPT))
    a, b = greedy(ref, PROMPT, 24), greedy(model, PROMPT, 24)
    agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 24)
    print(f"\nGemma 3 {which} path={gpu_path}: max rel {r['max_rel']:.2e} top-1 {r['top1']:.3f} "
          f"KL mean {r['kl_mean']:.2e}; greedy identical prefix {agree}/24; GPU weight types {sorted(kinds)}")
    if gpu_path == "fma":
        assert r["max_rel"] < 1e-3 and r["top1"] >= 0.95 and agree >= 8
    else:
        assert r["top1"] >= 0.9 and r["kl_mean"] < 1e-2


def _weights(model):
    """The CupyWeights (matrices and the embedding table) a loaded model holds."""
    from minecart.engine.backends.cupy_backend import CupyWeight

    return [w for part in model.weights.values() for w in part.values() if isinstance(w, CupyWeight)]


@pytest.mark.parametrize("which", ["q5_0", "mixed"])
def test_gemma3_quantized_graph_decode_matches_eager(gemma_files, which):
    path = gemma_files[which]
    mg, graph_be = _gpu_model(path, "dp4a", graphs=True)
    me, _ = _gpu_model(path, "dp4a", graphs=False)
    sg, se = mg.new_session(len(PROMPT) + 4), me.new_session(len(PROMPT) + 4)
    worst = graph_vs_eager(sg, se, PROMPT, 24)
    print(f"\nGemma 3 {which}: graph vs eager decode max rel err {worst:.2e}")
    assert graph_be._graphs, "decode never used a CUDA graph"
