"""The requantized prefill (ops.matmul path "dp4a_rq"): requant_q8_0 (gemm.cu) against its NumPy twin bit
for bit, and the Q8_0 GEMM it feeds against the exact DP4A emulation of the requantized weights, in one
window of rows and in several (with the residual and a fused group's members written apart), on fresh
random inputs of every format it takes, outputs poisoned with NaN first.

The twin: engine/quants.py's dequantized values (what deq_block32 computes) quantized by
engine/kvquant.py quantize_q8_0 (ggml's Q8_0 rule). Tolerances (||gpu - ref|| / ||ref||): 2e-5 against
the emulation (same int8 activations, same int8 weights), 2e-2 against fp32 dequantize-then-matmul.

    pytest -s tests/gpu/test_requant.py
"""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.kvquant import dequantize_q8_0, quantize_q8_0

from tests.gpu.test_more_quants import q8_1_dequant as q8_1_values

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K")


def nerr(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the GPU result (an output left unwritten?)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def random_raw(rng, type_name: str, R: int, K: int) -> np.ndarray:
    """(R, bytes a row) of `type_name`: values quantized by engine/quants.py where it has a quantizer (rows
    with offsets, so Q4_1 / Q5_1 / Q4_K's minima matter), else (Q5_K) random bytes with small fp16 d and
    dmin, so that every bit pattern of the quants, scales and minima occurs."""
    tid = Q.TYPE_IDS[type_name]
    if type_name == "Q5_K":
        raw = rng.integers(0, 256, size=(R * (K // 256), 176), dtype=np.uint8)
        for off, v in ((0, 1e-3), (2, 5e-4)):
            raw[:, off:off + 2] = np.frombuffer(np.array([v], "<f2").tobytes(), np.uint8)
        return raw.reshape(R, -1)
    vals = rng.standard_normal((R, K)).astype(np.float32) * np.float32(0.05)
    vals += np.float32(0.05) * rng.standard_normal((R, 1)).astype(np.float32)
    vals[0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    return Q.quantize(vals, tid).reshape(R, -1)


def dense(raw: np.ndarray, type_name: str, R: int, K: int) -> np.ndarray:
    return Q.dequantize_blocks(raw, Q.TYPE_IDS[type_name]).reshape(R, K)


def requant_twin(raw, type_name, R, K):
    """(int8 (R, K), fp16 (R, K / 32)): the twin of requant_q8_0."""
    return quantize_q8_0(dense(raw, type_name, R, K))


@pytest.mark.parametrize("type_name", FORMATS)
def test_requant_is_its_twin_bit_for_bit(poison, type_name):
    from minecart.kernels import ops

    rng = np.random.default_rng()
    R, K = 37, 512 if type_name not in ("IQ4_XS",) else 768
    raw = random_raw(rng, type_name, R, K)
    w = ops.upload_weight(raw, type_name, (R, K))
    q, d = quantize_q8_0(dense(raw, type_name, R, K))
    for rlo, rows in ((0, R), (5, 17), (R - 1, 1), (3, 0)):
        poison()
        oq, od = ops.requant_rows(w, rlo, rows)
        assert oq.shape == (rows, K) and od.shape == (rows, K // 32)
        np.testing.assert_array_equal(cp.asnumpy(oq), q[rlo:rlo + rows], err_msg=f"rows {rlo}+{rows}")
        np.testing.assert_array_equal(cp.asnumpy(od), d[rlo:rlo + rows].view(np.uint16), err_msg=f"rows {rlo}+{rows}")
    with pytest.raises(ValueError, match="outside"):
        ops.requant_rows(w, R - 2, 3)
    with pytest.raises(ValueError, match="not one of"):
        ops.requant_rows(ops.upload_weight(Q.quantize(np.zeros((2, 64), np.float32), Q.Q8_0), "Q8_0", (2, 64)), 0, 1)


@pytest.mark.parametrize("type_name", FORMATS)
def test_requant_prefill_matmul(poison, launches, monkeypatch, type_name):
    """ops.matmul(path "dp4a_rq") from REQUANT_MIN_T tokens: requant_q8_0 then gemm_dp4a<Q8_0, 2> per window of
    rows, against the emulation of the twin's weights; windows of 128 rows (scratch capped) give the same
    bits as one window, with and without the residual, and a fused group's members written apart are
    the plain output's column ranges. Below REQUANT_MIN_T the format's own GEMM runs."""
    from minecart.kernels import ops

    rng = np.random.default_rng()
    R, K = 301, 512 if type_name != "IQ4_XS" else 768
    T = ops.REQUANT_MIN_T + 44  # a partial token tile
    raw = random_raw(rng, type_name, R, K)
    w = ops.upload_weight(raw, type_name, (R, K))
    x = rng.standard_normal((T, K)).astype(np.float32)
    res = rng.standard_normal((T, R)).astype(np.float32)
    gx, gres = cp.asarray(x), cp.asarray(res)
    q, d = requant_twin(raw, type_name, R, K)
    emu = q8_1_values(x) @ dequantize_q8_0(q, d).astype(np.float64).T
    fp32 = x.astype(np.float64) @ dense(raw, type_name, R, K).astype(np.float64).T
    runs = {}
    whole, small = ops.REQUANT_SCRATCH_BYTES, 128 * (K + K // 16)
    for scratch in (whole, small):
        monkeypatch.setattr(ops, "REQUANT_SCRATCH_BYTES", scratch)
        windows = -(-R // 128) if scratch == small else 1
        for what in ("plain", "residual"):
            poison()
            launches.clear()
            y = ops.matmul(gx, w, "dp4a_rq", residual=gres if what == "residual" else None)
            runs[(scratch, what)] = cp.asnumpy(y)
            # the Q8_0 GEMM (gemm_dp4a<8, 2>) comes from its own module, not through _mm_kernel: only the
            # requants show here
            assert launches == [f"requant_q8_0<{ops.QT[type_name]}>"] * windows, (what, launches)
        plain = runs[(scratch, "plain")]
        assert nerr(plain, emu) < 2e-5
        assert nerr(plain, fp32) < 2e-2
        np.testing.assert_array_equal(runs[(scratch, "residual")], plain + res)
        bounds = [0, 100, 129, 250, R]
        ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
        poison()
        outs = ops.matmul_split(gx, w, ranges, "dp4a_rq")
        for (a, b), o in zip(ranges, outs, strict=True):
            assert o.shape == (T, b - a) and o.flags.c_contiguous
            np.testing.assert_array_equal(cp.asnumpy(o), plain[:, a:b], err_msg=f"rows {a}..{b}")
    np.testing.assert_array_equal(runs[(whole, "plain")], runs[(small, "plain")])
    launches.clear()
    poison()
    small = ops.matmul(gx[:ops.REQUANT_MIN_T - 1], w, "dp4a_rq")
    assert launches == [f"gemm_dp4a<{ops.QT[type_name]}, 1>"], launches
    own = q8_1_values(x[:ops.REQUANT_MIN_T - 1]) @ dense(raw, type_name, R, K).astype(np.float64).T
    assert nerr(cp.asnumpy(small), own) < 2e-5


def test_requant_path_through_the_backend():
    """A forced "dp4a_rq" backend: decode keeps the DP4A GEMV, a K-quant prefill takes the requantized GEMM
    and a Q8_0 one its two-block GEMM; an unknown path is refused by name."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.gguf_file import TensorInfo
    from minecart.kernels import ops

    be = CupyBackend("cuda:0", path="dp4a_rq")
    assert be.gemv_path == "dp4a" and be.gemm_path == be.gemm_kquant_path == "dp4a_rq"
    rng = np.random.default_rng()
    R, K, T = 200, 512, ops.REQUANT_MIN_T
    for type_name in ("Q4_K", "Q8_0"):
        raw = random_raw(rng, type_name, R, K) if type_name != "Q8_0" else \
            Q.quantize(rng.standard_normal((R, K)).astype(np.float32) * np.float32(0.05), Q.Q8_0)
        info = TensorInfo(name="w", ggml_type=Q.TYPE_IDS[type_name], type_name=type_name, shape=(R, K),
                          raw=raw.reshape(R, -1), n_bytes=int(raw.nbytes))
        wt = be.load_weight(info)
        assert be._matmul_path(T, wt.q) == "dp4a_rq" and be._matmul_path(1, wt.q) == "dp4a"
        x = rng.standard_normal((T, K)).astype(np.float32)
        y = be.to_numpy(be.matmul(be.asarray(x), wt))
        w8 = dequantize_q8_0(*requant_twin(raw, type_name, R, K)) if type_name != "Q8_0" else dense(raw, type_name, R, K)
        assert nerr(y, q8_1_values(x) @ w8.astype(np.float64).T) < 2e-5
    with pytest.raises(ValueError, match="dp4a_rq"):
        CupyBackend("cuda:0", path="dp4a3")


def test_the_plan_prices_this_scratch():
    """engine/placement.py's copy of the requantized prefill's constants (the engine's planner does not
    import the kernels) is ops'."""
    from minecart.engine import placement
    from minecart.kernels import ops

    assert set(placement.REQUANT_TYPES) == set(ops.REQUANT_TYPES)
    assert placement.REQUANT_SCRATCH_BYTES == ops.REQUANT_SCRATCH_BYTES
    assert placement.REQUANT_MIN_T == ops.REQUANT_MIN_T  # the default (env MINECART_REQUANT_MIN_T unset)
