"""qwen35moe: the MoE block against a plain per-token loop written here (doc 3.6), both expert layouts.

There is no MoE reference fixture, so the models are synthetic (engine/synth.py, a small vocabulary
to keep the files tiny): the separate `ffn_gate_exps` / `ffn_up_exps` layout and the fused
`ffn_gate_up_exps` layout (`--fuse-gate-up-exps`), untied `output.weight`, shared expert with its
sigmoid gate. The reference reads the tensors itself with GGUFFile.dequantize.
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine.backends.numpy_backend import NumpyBackend, NumpyWeight
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.model import load_model
from minecart.engine.models import qwen35

from tests._moe import tiny_moe_file

be = NumpyBackend()


@pytest.fixture(scope="module", params=["separate", "fused"])
def moe_file(request, tmp_path_factory):
    return tiny_moe_file(tmp_path_factory, request.param), request.param == "fused"


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _moe_reference(gf: GGUFFile, i: int, f: np.ndarray, k: int):
    """Per token: softmax router, top-k by probability, renormalized weights, SwiGLU experts,
    plus sigmoid(f . w_shgate) * shared SwiGLU. float64, straight from the file."""
    p = f"blk.{i}."
    d = lambda name: gf.dequantize(p + name).astype(np.float64)  # noqa: E731
    router = d("ffn_gate_inp.weight")  # (E, H)
    if p + "ffn_gate_up_exps.weight" in gf.tensors:
        gate_up = d("ffn_gate_up_exps.weight")  # (E, 2 Fe, H)
        fe = gate_up.shape[1] // 2
        gate, up = gate_up[:, :fe], gate_up[:, fe:]
    else:
        gate, up = d("ffn_gate_exps.weight"), d("ffn_up_exps.weight")
    down = d("ffn_down_exps.weight")  # (E, H, Fe)
    sh_gate_w = d("ffn_gate_inp_shexp.weight").reshape(-1)  # (1, H) or (H,) -> (H,)
    sg, su, sd = d("ffn_gate_shexp.weight"), d("ffn_up_shexp.weight"), d("ffn_down_shexp.weight")
    out = np.zeros(f.shape)
    chosen = []
    for t in range(f.shape[0]):
        x = f[t].astype(np.float64)
        logits = router @ x
        prob = np.exp(logits - logits.max())
        prob /= prob.sum()
        order = sorted(range(len(prob)), key=lambda e: (-prob[e], e))[:k]
        weights = prob[order] / prob[order].sum()
        for e, wgt in zip(order, weights, strict=True):
            out[t] += wgt * (down[e] @ (_silu(gate[e] @ x) * (up[e] @ x)))
        shared = sd @ (_silu(sg @ x) * (su @ x))
        out[t] += shared / (1.0 + np.exp(-(sh_gate_w @ x)))
        chosen.append(order)
    return out, np.array(chosen)


def test_moe_block_matches_per_token_reference(moe_file):
    path, fused = moe_file
    model = load_model(path, devices=["cpu:0"])
    cfg = model.config
    assert cfg.is_moe and cfg.n_experts == 8 and cfg.n_experts_used == 2
    gf = GGUFFile(path)
    assert ("blk.0.ffn_gate_up_exps.weight" in gf.tensors) == fused
    rng = np.random.default_rng(2)
    f = rng.standard_normal((23, cfg.hidden)).astype(np.float32)
    for i in (0, 3, 7):
        w = model.weights[f"layer.{i}"]
        got = qwen35.feed_forward(cfg, be, w, i, f)
        ref, chosen = _moe_reference(gf, i, f, cfg.n_experts_used)
        err = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
        assert err.max() < 1e-5, f"layer {i}: relative error {err.max():.3g}"
        ids, weights = be.moe_route(f, w[f"blk.{i}.ffn_gate_inp.weight"], cfg.n_experts_used)
        np.testing.assert_array_equal(ids, chosen)
        np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-12)
    model.close()


def test_fused_gate_up_equals_separate_tensors():
    """backend.moe with a fused (E, 2Fe, H) tensor == the same weights as two tensors."""
    rng = np.random.default_rng(3)
    E, Fe, H, T = 6, 10, 12, 9

    class Info:  # a minimal TensorInfo stand-in for in-memory float32 weights
        def __init__(self, name, arr):
            self.name, self.type_name, self.shape, self.n_bytes = name, "F32", arr.shape, arr.nbytes

    def weight(name, arr):
        arr = arr.astype(np.float32)
        return NumpyWeight(Info(name, arr), "experts", arr)

    gate = rng.standard_normal((E, Fe, H)) * 0.4
    up = rng.standard_normal((E, Fe, H)) * 0.4
    down = weight("down", rng.standard_normal((E, H, Fe)) * 0.3)
    router = NumpyWeight(Info("router", np.zeros((E, H))), "matmul",
                         rng.standard_normal((E, H)).astype(np.float32))
    x = rng.standard_normal((T, H)).astype(np.float32)
    separate = be.moe(x, router, weight("gate", gate), weight("up", up), down, 3)
    fused = be.moe(x, router, weight("gate_up", np.concatenate([gate, up], axis=1)), None, down, 3)
    np.testing.assert_array_equal(separate, fused)
    # and it is not trivially independent of k
    assert np.abs(be.moe(x, router, weight("gate", gate), weight("up", up), down, 1) - separate).max() > 1e-3


def test_moe_model_prefill_modes_agree(moe_file):
    path, _ = moe_file
    # the reference MoE in every mode (a decode token would otherwise take the int8 expert kernels,
    # which tests/engine/test_cpu_experts.py checks against this path)
    model = load_model(path, backend=NumpyBackend(int_experts=False))
    assert "output.weight" in model.weights["head"]  # untied LM head
    rng = np.random.default_rng(4)
    ids = [int(t) for t in rng.integers(0, model.config.vocab_size, 70)]
    full = model.logits(ids)
    for chunk in (64, 1):
        s = model.new_session()
        last = s.prefill(ids, chunk=chunk)
        err = np.linalg.norm(last - full[-1]) / np.linalg.norm(full[-1])
        assert err < 1e-4, f"chunk {chunk}: {err:.3g}"
    model.close()


def test_one_by_one_runs_each_token_on_the_integer_kernels(moe_file):
    """moe_routed(one_by_one=True) (a GPU's short chunks with experts in host RAM) gives each row exactly
    what the one-token path gives it alone; without integer kernels for the experts' type it is the
    dequantize-then-matmul path; the routing may come as float32 values (as a GPU sends it)."""
    path, fused = moe_file
    model = load_model(path, devices=["cpu:0"])
    cfg = model.config
    w = model.weights["layer.1"]
    p = "blk.1."
    gate = w[p + ("ffn_gate_up_exps.weight" if fused else "ffn_gate_exps.weight")]
    up = None if fused else w[p + "ffn_up_exps.weight"]
    down = w[p + "ffn_down_exps.weight"]
    f = np.random.default_rng(4).standard_normal((5, cfg.hidden)).astype(np.float32)
    ids, wts = be.moe_route(f, w[p + "ffn_gate_inp.weight"], cfg.n_experts_used)
    got = be.moe_routed(f, ids, wts, gate, up, down, one_by_one=True)
    sent = be.moe_routed(f, ids.astype(np.float32), wts.astype(np.float32), gate, up, down, one_by_one=True)
    np.testing.assert_array_equal(sent, got)
    dense = be.moe_routed(f, ids, wts, gate, up, down)
    if be.int_expert_stacks(gate, up, down) is None:
        assert not fused  # F16 experts: no integer kernels, the same path for every T
        np.testing.assert_array_equal(got, dense)
    else:
        assert fused  # Q8_0 experts
        each = np.concatenate([be.moe_routed(f[t : t + 1], ids[t : t + 1], wts[t : t + 1], gate, up, down)
                               for t in range(len(f))])
        np.testing.assert_array_equal(got, each)
        err = np.linalg.norm(got - dense, axis=1) / np.linalg.norm(dense, axis=1)
        assert 0 < err.max() < 5e-2  # int8 activations against float32 ones
    model.close()
