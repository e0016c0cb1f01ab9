"""The multi-token GEMVs of batched decode (gemv_kq_mt and, for Q8_0, gemv_mt; kernels/gemv.cu) on the GPU.

Every K-quant type (Q4_K, Q5_K, Q6_K), T = 1..8 tokens through ops.matmul (T = 1: gemv_kq, 2..8: one
gemv_kq_mt launch) in every compiled gemv_kq_mt shape and "auto", and T = 9..32 (several passes), and the
boundary to the tiled GEMM; odd row counts (R not a multiple of 4 or 16), rows of 256 x 1, 9, 17 and 49
values (tail super-blocks, Q6_K tail groups), with and without the residual epilogue, outputs poisoned
with NaN. Each result against the exact NumPy emulation of the DP4A arithmetic (the dequantized weights
@ the q8_1-rounded activations, fp64; normalized error < 2e-5) and against gemv_dp4a on the same layout
("old"), on fresh random inputs each run. Q8_0 (gemv_mt): T = 2..8, every compiled shape, rows of 32 x odd
blocks (a partial last round of 8 blocks). The launches are recorded, so a test fails if the kernel it
means to check did not run. CPU twin of the kernel's indexing: tests/kernels/test_kq_mt_emulation.py."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.kernels import kquant_layout as L

from tests.gpu.test_kernels import make_tensor
from tests.gpu.test_kquant_gemv import checked_matmul, dense, nerr, q8_1_emulation, sane_blocks

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

SHAPES = ((259, 2304), (37, 256), (1001, 4352), (67, 12544), (4096, 4096))  # K = 256 x 9, 1, 17, 49, 16
TOL = 2e-5


@pytest.fixture(autouse=True)
def default_variants(monkeypatch):
    """The kernels' defaults, whatever MINECART_GEMV_KQ_MT / MINECART_GEMV_MT / MINECART_KQ_PASSES_MAX_T say,
    without gemm_batch (which takes 9..32 tokens by default)."""
    from minecart.kernels import ops

    monkeypatch.setattr(ops, "GEMV_KQ_MT_VARIANT", "auto")
    monkeypatch.setattr(ops, "GEMV_MT_VARIANT", "auto")
    monkeypatch.setattr(ops, "GEMV_KQ_VARIANT", "auto")
    monkeypatch.setattr(ops, "KQ_PASSES_MAX_T", 32)
    monkeypatch.setattr(ops, "GEMM_BATCH_VARIANT", "off")  # gemm_batch: tests/gpu/test_gemm_batch.py



def _case(type_name: str, R: int, K: int, T: int, rng):
    raw = sane_blocks(type_name, R, K, rng)
    wd = dense(type_name, raw, (R, K))
    from minecart.kernels import ops

    w = ops.upload_weight(raw, type_name, (R, K))
    x = rng.standard_normal((T, K)).astype(np.float32)
    r = rng.standard_normal((T, R)).astype(np.float32)
    return w, x, r, q8_1_emulation(x, wd)


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_shape_and_token_count(monkeypatch, poison, launches, type_name, T):
    from minecart.kernels import ops
    from minecart.kernels.build import GEMV_KQ_MT

    rng = np.random.default_rng()  # fresh inputs each run
    variants = ["auto", "old"] + [f"{a}x{b}" for a, b in GEMV_KQ_MT]
    for R, K in SHAPES:
        w, x, r, emu = _case(type_name, R, K, T, rng)
        gx, gr = cp.asarray(x), cp.asarray(r)
        got = {}
        single = ops._single_gemv(w, R, K)[0] if T == 1 else None  # (recorded before the launches are)
        for v in variants:
            monkeypatch.setattr(ops, "GEMV_KQ_MT_VARIANT", v)
            for res in (None, gr):
                y = checked_matmul(w, gx, res, r, emu, poison, launches, f"{v} {R}x{K} T={T}", TOL)
                if T == 1:
                    assert launches == [single], launches
                elif v == "old":  # gemv_dp4a in chunks of 8/4/2/1 tokens; a 1-token chunk takes gemv_kq
                    assert all(n.startswith(("gemv_dp4a<", "gemv_kq<", "gemv_kq_stream<")) for n in launches), launches
                    assert any(n.startswith("gemv_dp4a<") for n in launches), launches
                else:
                    wpr, nu = ops._gemv_kq_mt(type_name, T, R, K)
                    assert launches == [f"gemv_kq_mt<{ops.QT[type_name]}, {T}, {wpr}, {nu}>"], launches
                    if v != "auto":
                        assert f"{wpr}x{nu}" == v
                got[(v, res is None)] = y
        for key, y in got.items():  # the new kernel and gemv_dp4a agree up to fp32 summation order
            old = got[("old", key[1])]
            assert nerr(y, old) < TOL, f"{key} vs old {R}x{K} T={T}: {nerr(y, old):.2e}"
    print(f"\n{type_name} T={T}: {', '.join(variants)} agree with the emulation and with gemv_dp4a")


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
@pytest.mark.parametrize("T", [9, 13, 16, 17, 24, 32, 33])
def test_batches_above_eight_tokens(monkeypatch, poison, launches, type_name, T):
    """T = 9..32: ceil(T / 8) passes of gemv_kq_mt (near-equal sizes), each with its slice of the
    residual; T = 33 and KQ_PASSES_MAX_T = 8: the tiled GEMM, the same numbers."""
    from minecart.kernels import ops
    from minecart.kernels.build import kq_passes

    rng = np.random.default_rng()
    for R, K in ((259, 2304), (37, 4352)):
        w, x, r, emu = _case(type_name, R, K, T, rng)
        gx, gr = cp.asarray(x), cp.asarray(r)
        for limit in (32, ops.GEMV_MAX_T):
            monkeypatch.setattr(ops, "KQ_PASSES_MAX_T", limit)
            passes = T <= limit
            for res in (None, gr):
                poison()
                launches.clear()
                out = cp.full((T, R), cp.nan, dtype=cp.float32)
                y = cp.asnumpy(ops.matmul(gx, w, "dp4a", out=out, residual=res))
                want = emu + (r if res is not None else 0)
                err = nerr(y, want)
                assert err < TOL, f"{R}x{K} T={T} limit {limit}{' +res' if res is not None else ''}: {err:.2e}"
                if passes:
                    wpr, nu = ops._gemv_kq_mt(type_name, T, R, K)
                    q = ops.QT[type_name]
                    assert launches == [f"gemv_kq_mt<{q}, {n}, {wpr}, {nu}>" for _, n in kq_passes(T)], launches
                else:
                    assert all(n.startswith("gemm_dp4a<") for n in launches), launches


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
def test_deterministic_and_fma_path_unchanged(monkeypatch, type_name):
    """Two runs give the same bits (no atomics: warp sums added in a fixed order); the FMA path does not
    take the DP4A kernel."""
    from minecart.kernels import ops

    rng = np.random.default_rng()
    w, x, r, emu = _case(type_name, 1001, 4352, 8, rng)
    gx = cp.asarray(x)
    a = cp.asnumpy(ops.matmul(gx, w, "dp4a"))
    b = cp.asnumpy(ops.matmul(gx, w, "dp4a"))
    np.testing.assert_array_equal(a, b)
    names: list[str] = []
    real = ops._mm_kernel
    monkeypatch.setattr(ops, "_mm_kernel", lambda w_, n: names.append(n) or real(w_, n))
    ops.matmul(gx, w, "fma")
    assert names and all(n.startswith("gemv_fma<") for n in names), names


def test_bad_variant_is_a_clear_error(monkeypatch):
    from minecart.kernels import ops

    rng = np.random.default_rng()
    w, x, _, _ = _case("Q4_K", 16, 256, 2, rng)
    for bad in ("3x3", "fast"):
        monkeypatch.setattr(ops, "GEMV_KQ_MT_VARIANT", bad)
        with pytest.raises(ValueError, match="MINECART_GEMV_KQ_MT"):
            ops.matmul(cp.asarray(x), w, "dp4a")


def test_bench_multi_runs():
    """bench_gemv --multi on one small shape: every variant timed, sane numbers."""
    from minecart.kernels import bench_gemv
    from minecart.kernels.build import GEMV_KQ_MT, GEMV_MT

    rows = bench_gemv.run_multi(shapes=((1024, 2304, True),), types=("Q8_0", "Q4_K", "Q6_K"), tokens=(1, 8, 16),
                                cycle_bytes=8 << 20, reps=2)
    assert {(r.type_name, r.T) for r in rows} == {(t, n) for t in ("Q8_0", "Q4_K", "Q6_K") for n in (1, 8, 16)}
    assert len([r for r in rows if r.T == 8 and r.type_name != "Q8_0"]) == 2 * (4 + len(GEMV_KQ_MT))
    assert len([r for r in rows if r.T == 8 and r.type_name == "Q8_0"]) == 4 + len(GEMV_MT)
    assert all(r.seconds > 0 and r.gbs > 0 and r.copy_share > 0 and r.over_one > 0 for r in rows)


def test_gemv_max_t(monkeypatch):
    """The GEMV/GEMM boundary a caller asks for: KQ_PASSES_MAX_T for K-quants, GEMV_MAX_T otherwise."""
    from minecart.kernels import ops
    from minecart.kernels.probe import random_q8_0

    rng = np.random.default_rng()
    w, _, _, _ = _case("Q6_K", 16, 256, 2, rng)
    monkeypatch.setattr(ops, "KQ_PASSES_MAX_T", 32)
    assert ops.gemv_max_t(w) == 32
    assert ops.gemv_max_t(random_q8_0(16, 256)) == 32  # Q8_0 under gemv_mt, in passes too
    monkeypatch.setattr(ops, "GEMV_KQ_MT_VARIANT", "old")
    assert ops.gemv_max_t(w) == ops.GEMV_MAX_T
    monkeypatch.setattr(ops, "GEMV_MT_VARIANT", "old")
    assert ops.gemv_max_t(random_q8_0(16, 256)) == ops.GEMV_MAX_T


@pytest.mark.parametrize("T", [2, 3, 4, 5, 6, 7, 8, 9, 16, 32])
def test_q8_0_gemv_mt(monkeypatch, poison, launches, T):
    """gemv_mt on Q8_0 in every compiled shape and "auto", with and without the residual, against the
    emulation and gemv_dp4a ("old"); rows of 7, 129 and 128 blocks (partial and whole rounds of 8)."""
    from minecart.engine import quants as Q
    from minecart.kernels import ops
    from minecart.kernels.build import GEMV_MT, kq_passes

    rng = np.random.default_rng()
    variants = ["auto", "old"] + [f"{a}x{b}" for a, b in GEMV_MT]
    for R, K in ((259, 224), (37, 4128), (1001, 4096)):
        info = make_tensor(rng, "Q8_0", (R, K), 0.05)
        wdense = Q.dequantize(info).reshape(R, K)
        w = ops.upload_weight(info.raw, "Q8_0", (R, K))
        x = rng.standard_normal((T, K)).astype(np.float32)
        r = rng.standard_normal((T, R)).astype(np.float32)
        emu = q8_1_emulation(x, wdense)
        gx, gr = cp.asarray(x), cp.asarray(r)
        got = {}
        for v in variants:
            monkeypatch.setattr(ops, "GEMV_MT_VARIANT", v)
            for res in (None, gr):
                y = checked_matmul(w, gx, res, r, emu, poison, launches, f"Q8_0 {v} {R}x{K} T={T}", TOL)
                if v == "old":  # 8/4/2/1-token chunks up to 8 (a 1-token chunk: the single-token kernel)
                    if T <= ops.GEMV_MAX_T:
                        assert all(n.startswith(("gemv_dp4a<", "gemv_dp4a_split<", "gemv_dp4a_stream<"))
                                   for n in launches), launches
                else:  # passes of up to 8 tokens above 8 (build.kq_passes)
                    wpr, nu = ops._gemv_mt("Q8_0", T, R)
                    assert launches == [f"gemv_mt<{ops.QT['Q8_0']}, {nt}, {wpr}, {nu}>"
                                        for _, nt in kq_passes(T)], launches
                got[(v, res is None)] = y
        for key, y in got.items():
            old = got[("old", key[1])]
            assert nerr(y, old) < TOL, f"{key} vs old {R}x{K} T={T}: {nerr(y, old):.2e}"
    monkeypatch.setattr(ops, "GEMV_MT_VARIANT", "9x9")
    with pytest.raises(ValueError, match="MINECART_GEMV_MT"):
        ops.matmul(gx, w, "dp4a")
