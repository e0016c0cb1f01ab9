"""The fp16 HFMA2 matmul path (kernels/hfma2.cu) against fp64 NumPy twins, its speed next to DP4A and
fp32 FMA, the three-way probe, and whole-model logits with the HFMA2 path.

Activations are rounded to fp16 per 32-value block (scaled by the block's absmax) and products are
summed in fp16 over one block, so the error against fp64 is ~1e-3 (printed); outputs are poisoned with
NaN first so that an unwritten element fails.

    pytest -s tests/gpu/test_hfma2.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.gguf_file import TensorInfo

from tests.gpu._compare import FIXTURES, worst_over_sequences

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

TYPES = {"F16": Q.F16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_K": Q.Q4_K, "Q6_K": Q.Q6_K}


def make_tensor(rng, type_name: str, shape, std: float = 1.0) -> TensorInfo:
    vals = (rng.standard_normal(shape) * std).astype(np.float32)
    tid = TYPES[type_name]
    raw = Q.quantize(vals, tid)
    raw2 = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw
    return TensorInfo(name="w", ggml_type=tid, type_name=type_name, shape=tuple(shape), raw=raw2,
                      n_bytes=int(raw.nbytes))


def errs(got, ref) -> tuple[float, float]:
    """(max abs error / max abs value, ||error|| / ||ref||) against an fp64 reference."""
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), "non-finite values in the GPU result (an output left unwritten?)"
    d = got - ref
    return float(np.abs(d).max() / max(np.abs(ref).max(), 1e-300)), float(np.linalg.norm(d) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def nb():
    return NumpyBackend()


@pytest.fixture(scope="module")
def gh():
    from minecart.engine.backends.cupy_backend import CupyBackend

    return CupyBackend("cuda:0", path="hfma2")


_WORST: dict = {}


@pytest.mark.parametrize("K", [256, 4096 + 256])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 9, 64, 130])
@pytest.mark.parametrize("type_name", list(TYPES))
def test_hfma2_matmul(nb, gh, poison, type_name, T, K):
    rng = np.random.default_rng(hash((type_name, T, K)) % 2**32)
    R = 97
    info = make_tensor(rng, type_name, (R, K), 0.05)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[:, :32] *= 1e4  # one block of large activations: the per-block scaling keeps fp16 in range
    ref = x.astype(np.float64) @ nb.load_weight(info).dense().astype(np.float64).T
    poison()
    y = gh.to_numpy(gh.matmul(gh.asarray(x), gh.load_weight(info)))
    assert y.shape == (T, R)
    mx, nrm = errs(y, ref)
    _WORST[type_name] = max(_WORST.get(type_name, 0.0), mx)
    print(f"hfma2 {type_name:>5} T={T:>3} K={K:>4} R={R}: max rel {mx:.2e}  norm rel {nrm:.2e}  "
          f"(worst {type_name} so far {_WORST[type_name]:.2e})")
    assert mx < 1e-2 and nrm < 5e-3


@pytest.mark.parametrize("T", [1, 5, 64])
def test_hfma2_residual_and_huge_values(nb, poison, T):
    """The residual epilogue; activations near 1e30 and F16 weights so large that an fp16 partial
    overflows (the kernel then recomputes that block in fp32)."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.kernels import ops

    gh = CupyBackend("cuda:0", path="hfma2")
    rng = np.random.default_rng(T)
    R, K = 97, 512
    info = make_tensor(rng, "Q8_0", (R, K), 0.05)
    x = (rng.standard_normal((T, K)) * 1e30).astype(np.float32)
    res = rng.standard_normal((T, R)).astype(np.float32) * 1e30
    w = gh.load_weight(info)
    ref = x.astype(np.float64) @ nb.load_weight(info).dense().astype(np.float64).T + res
    poison()
    y = cp.asnumpy(ops.matmul(cp.asarray(x), w.q, "hfma2", residual=cp.asarray(res)))
    mx, nrm = errs(y, ref)
    print(f"hfma2 residual, |x| ~ 1e30, T={T}: max rel {mx:.2e} norm rel {nrm:.2e}")
    assert nrm < 5e-3
    # F16 rows whose first block is +-30000: 16 such products per fp16 lane overflow, so the kernel
    # must take its fp32 fallback for that block
    big_raw = (rng.standard_normal((R, K)) * 0.05).astype(np.float16)
    big_raw[0, :32] = 30000.0
    big_raw[1, :32] = -30000.0
    big = TensorInfo(name="w", ggml_type=Q.F16, type_name="F16", shape=(R, K), raw=big_raw.view(np.uint8),
                     n_bytes=int(big_raw.nbytes))
    xs = rng.standard_normal((T, K)).astype(np.float32)
    xs[:, :32] = np.abs(xs[:, :32]) + 0.5
    poison()
    y = gh.to_numpy(gh.matmul(gh.asarray(xs), gh.load_weight(big)))
    mx, nrm = errs(y, xs.astype(np.float64) @ big_raw.astype(np.float64).T)
    print(f"hfma2 F16 weights of 3e4 (fp16 partial overflow), T={T}: max rel {mx:.2e} norm rel {nrm:.2e}")
    assert nrm < 5e-3


def test_hfma2_speed():
    """GEMV 4096 x 4096 (decode, GB/s of weights) and GEMM 12288 x 4096 at T = 4096 (prefill, TFLOP/s),
    Q8_0, in every path."""
    from minecart.kernels import ops, probe

    rs = cp.random.RandomState(4)
    w = probe.random_q8_0(4096, 4096, 1)
    x1 = rs.standard_normal((1, 4096), dtype=cp.float32)
    for path in probe.GEMV_PATHS:
        t = probe.time_gpu(lambda path=path: ops.matmul(x1, w, path), 50)
        print(f"GEMV 4096x4096 Q8_0 {path:>6}: {t * 1e6:8.1f} us  {w.nbytes / t / 1e9:7.0f} GB/s")
    w = probe.random_q8_0(12288, 4096, 2)
    T = 4096
    x = rs.standard_normal((T, 4096), dtype=cp.float32)
    for path in probe.GEMM_PATHS:
        t = probe.time_gpu(lambda path=path: ops.matmul(x, w, path), 3)
        print(f"GEMM 12288x4096 T={T} Q8_0 {path:>6}: {t * 1e3:8.2f} ms  {2 * T * 12288 * 4096 / t / 1e12:6.1f} TFLOP/s")


def test_three_way_probe():
    from minecart.kernels import probe

    probe.run_probe()  # compile everything first
    rec = probe.run_probe()
    print("probe:", {k: v for k, v in rec.items() if k.startswith(("gemv", "gemm", "probe_s"))})
    for label, paths in (("gemv", probe.GEMV_PATHS), ("gemm", probe.GEMM_PATHS)):
        assert set(rec[f"{label}_us"]) == set(paths), rec.get(f"{label}_excluded")
        assert rec[f"{label}_err"]["hfma2"] < probe.SANITY_REL_ERR
        assert rec[label] in paths
    print(f"probe took {rec['probe_s']:.3f} s after compiling")


@pytest.mark.parametrize("quant", ["q8_0", "f16"])
def test_fixture_logits_hfma2(fixtures_dir, monkeypatch, quant):
    """Whole-model logits with MINECART_MATMUL_PATH=hfma2 against the NumPy backend (judged as the
    DP4A path is in test_model.py: top-1 agreement and KL)."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.model import load_model

    monkeypatch.setenv("MINECART_MATMUL_PATH", "hfma2")
    be = CupyBackend("cuda:0")
    assert be.gemv_path == "hfma2" and be.gemm_path == "hfma2"
    seqs = json.loads((fixtures_dir / "sequences.json").read_text())["sequences"]
    m_np = load_model(fixtures_dir / FIXTURES[quant], backend=NumpyBackend())
    m_gp = load_model(fixtures_dir / FIXTURES[quant], backend=be)
    worst = worst_over_sequences(m_np, m_gp, seqs, f"{quant} hfma2")
    assert worst["top1"] >= 0.9 and worst["kl_mean"] < 1e-2
