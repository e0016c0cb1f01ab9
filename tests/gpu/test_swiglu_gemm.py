"""A feed-forward layer's gate and up GEMM with SwiGLU in its epilogue (ops.matmul_swiglu,
gemm_dp4a<Q8_0, 2, true>), against what it replaces: the plain GEMM of the [gate; up] matrix followed by
swiglu_q8, bit for bit (h and its q8_1 blocks), and against the exact DP4A emulation in float64; for a
Q8_0 matrix and for K-quants on their requantized windows (one window and several), partial token and row
tiles, outputs poisoned with NaN first. Then the backend: CupyBackend.matmul_swiglu on a loaded fused
group takes it where ops.swiglu_fusable says so, publishes the q8_1 blocks for the down projection, and
falls back to the composition elsewhere.

    pytest -s tests/gpu/test_swiglu_gemm.py
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.kvquant import dequantize_q8_0

from tests.gpu.test_more_quants import q8_1_dequant as q8_1_values
from tests.gpu.test_requant import dense, nerr, random_raw, requant_twin

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


def silu(v):
    return v / (1.0 + np.exp(-v))


def gate_up_raw(rng, type_name: str, F: int, K: int) -> np.ndarray:
    if type_name == "Q8_0":
        vals = rng.standard_normal((2 * F, K)).astype(np.float32) * np.float32(0.05)
        return Q.quantize(vals, Q.Q8_0).reshape(2 * F, -1)
    return random_raw(rng, type_name, 2 * F, K)


def composed(gx, w, path: str):
    """The unfused reference: ops.matmul of [gate; up], then swiglu_q8."""
    from minecart.kernels import fused, ops

    y = ops.matmul(gx, w, path)
    F = w.rows // 2
    return fused.swiglu_q8(y[:, :F], y[:, F:])


@pytest.mark.parametrize("type_name,path", [("Q8_0", "dp4a2"), ("Q8_0", "dp4a_rq"), ("Q4_K", "dp4a_rq"),
                                            ("Q6_K", "dp4a_rq"), ("Q5_0", "dp4a_rq")])
@pytest.mark.parametrize("F", [96, 320])
def test_swiglu_gemm_is_the_composition(poison, monkeypatch, type_name, path, F):
    from minecart.kernels import ops

    rng = np.random.default_rng()
    K = 512
    T = ops.REQUANT_MIN_T + 44 if type_name != "Q8_0" else 130  # partial token tiles
    raw = gate_up_raw(rng, type_name, F, K)
    w = ops.upload_weight(raw, type_name, (2 * F, K))
    assert ops.swiglu_fusable(w, T, path)
    x = rng.standard_normal((T, K)).astype(np.float32)
    gx = cp.asarray(x)
    poison()
    ref_h, ref_q8 = composed(gx, w, path)
    ref = [cp.asnumpy(a) for a in (ref_h, *ref_q8)]
    scratches = [ops.REQUANT_SCRATCH_BYTES]
    if type_name != "Q8_0":
        scratches.append(2 * 64 * (K + K // 16))  # windows of 64 gate rows and their up rows
    for scratch in scratches:
        monkeypatch.setattr(ops, "REQUANT_SCRATCH_BYTES", scratch)
        poison()
        h, q8 = ops.matmul_swiglu(gx, w, path)
        got = [cp.asnumpy(a) for a in (h, *q8)]
        assert got[0].shape == (T, F) and got[1].shape == (T, F) and got[2].shape == (T, F // 32)
        for name, a, b in zip(("h", "xq", "xd", "xs"), got, ref, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}, scratch {scratch}")
    # against the float64 emulation of the same int8 products
    w8 = dequantize_q8_0(*requant_twin(raw, type_name, 2 * F, K)) if type_name != "Q8_0" \
        else dense(raw, type_name, 2 * F, K)
    prod = q8_1_values(x) @ w8.astype(np.float64).T
    assert nerr(got[0], silu(prod[:, :F]) * prod[:, F:]) < 2e-5


def test_swiglu_fusable_only_where_the_q8_gemm_runs():
    from minecart.kernels import ops

    rng = np.random.default_rng(3)
    F, K = 128, 256
    q8 = ops.upload_weight(gate_up_raw(rng, "Q8_0", F, K), "Q8_0", (2 * F, K))
    q4 = ops.upload_weight(gate_up_raw(rng, "Q4_K", F, K), "Q4_K", (2 * F, K))
    big = ops.REQUANT_MIN_T
    assert ops.swiglu_fusable(q8, 200, "dp4a2") and ops.swiglu_fusable(q8, 200, "dp4a_rq")
    assert not ops.swiglu_fusable(q8, 200, "dp4a")  # the one-block GEMM runs there
    assert not ops.swiglu_fusable(q8, ops.GEMV_MAX_T, "dp4a2")  # the decode kernels
    assert not ops.swiglu_fusable(q8, 200, "fma") and not ops.swiglu_fusable(q8, 200, "hfma2")
    assert ops.swiglu_fusable(q4, big, "dp4a_rq")
    assert not ops.swiglu_fusable(q4, big - 1, "dp4a_rq")  # the K-quant's own GEMM below the threshold
    assert not ops.swiglu_fusable(q4, big, "dp4a2")
    with pytest.raises(ValueError, match="swiglu_fusable"):
        ops.matmul_swiglu(cp.zeros((big - 1, K), cp.float32), q4, "dp4a_rq")


def test_prefill_gemm_names_the_kernel_matmul_launches(monkeypatch):
    """ops.prefill_gemm, which swiglu_fusable asks, against the kernels ops.matmul really launches: across
    formats, token counts (decode kernels, the batch GEMM, the GEMMs below and above REQUANT_MIN_T) and
    paths, a gemm_dp4a launch happens exactly where it says, with its block count, on requantized weights
    exactly where it says so."""
    from minecart.kernels import ops

    launched: list[str] = []
    real = ops.get_kernel

    def recording(module: str, name: str):
        launched.append(name)
        return real(module, name)

    monkeypatch.setattr(ops, "get_kernel", recording)
    rng = np.random.default_rng(5)
    K = 256
    big = ops.REQUANT_MIN_T
    for type_name in ("Q8_0", "Q4_K", "Q6_K", "Q5_0"):
        w = ops.upload_weight(gate_up_raw(rng, type_name, 64, K), type_name, (128, K))
        for T in (1, 8, 32, ops.GEMV_MAX_T + 1, big - 1, big):
            x = cp.asarray(rng.standard_normal((T, K)).astype(np.float32))
            for path in ("dp4a", "dp4a2", "dp4a_rq", "fma"):
                launched.clear()
                ops.matmul(x, w, path)
                gemms = [n for n in launched if n.startswith("gemm_dp4a<")]
                gemm = ops.prefill_gemm(w, T, path)
                where = (type_name, T, path, launched)
                if gemm is None:
                    assert not gemms, where
                    continue
                q = ops.QT["Q8_0"] if gemm.requant else ops.QT[type_name]
                assert gemms == [f"gemm_dp4a<{q}, {gemm.nblk}>"], where
                assert any(n.startswith("requant_q8_0<") for n in launched) == gemm.requant, where


def test_backend_takes_it_for_a_fused_group():
    """CupyBackend.matmul_swiglu on [gate; up] loaded as one group: the fused launch at a prefill's size
    (its q8_1 blocks published for the down projection: the next matmul quantizes nothing), the
    composition at decode sizes and for weights loaded apart; the same values either way."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.backends.numpy_backend import NumpyBackend
    from minecart.engine.gguf_file import TensorInfo
    from minecart.kernels import fused, ops

    be, nb = CupyBackend("cuda:0", path="dp4a_rq"), NumpyBackend()
    rng = np.random.default_rng(7)
    F, K = 192, 512
    raw = gate_up_raw(rng, "Q4_K", F, K)
    infos = [TensorInfo(name=n, ggml_type=Q.TYPE_IDS["Q4_K"], type_name="Q4_K", shape=(F, K),
                        raw=raw[a:a + F], n_bytes=int(raw[a:a + F].nbytes))
             for n, a in (("ffn_gate.weight", 0), ("ffn_up.weight", F))]
    gate, up = be.load_fused(infos)
    assert gate.group is not None and gate.group is up.group
    apart = [be.load_weight(i, role="matmul") for i in infos]
    ngate, nup = (nb.load_weight(i, role="matmul") for i in infos)
    calls: list[int] = []
    real = ops.matmul_swiglu
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(ops, "matmul_swiglu", lambda *a: calls.append(1) or real(*a))
    quantized: list[int] = []
    real_q = ops.quantize_q8_1
    monkeypatch.setattr(ops, "quantize_q8_1", lambda a: quantized.append(1) or real_q(a))
    try:
        for T in (1, 8, ops.REQUANT_MIN_T + 3):
            x = rng.standard_normal((T, K)).astype(np.float32)
            gx = be.asarray(x)
            calls.clear()
            h = be.matmul_swiglu(gx, gate, up)
            assert len(calls) == (1 if T >= ops.REQUANT_MIN_T else 0), T
            if T >= ops.REQUANT_MIN_T:
                quantized.clear()
                cached = ops.quantize_cached(h)
                assert not quantized  # published by the epilogue
                expect = fused.swiglu_q8(*ops.split_columns(ops.matmul(gx, gate.group.q, "dp4a_rq"),
                                                            [(0, F), (F, 2 * F)]))[1]
                for a, b in zip(cached, expect, strict=True):
                    np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))
            h_apart = be.matmul_swiglu(gx, *apart)
            assert len(calls) == (1 if T >= ops.REQUANT_MIN_T else 0)  # apart: always the composition
            ref = nb.matmul_swiglu(x, ngate, nup)
            assert nerr(be.to_numpy(h), ref) < 3e-2 and nerr(be.to_numpy(h_apart), ref) < 3e-2
            if T >= ops.REQUANT_MIN_T:
                np.testing.assert_array_equal(be.to_numpy(h), be.to_numpy(h_apart))
    finally:
        monkeypatch.undo()
