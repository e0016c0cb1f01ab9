"""gemm_batch (kernels/gemm.cu), the batched decode GEMM of 2..32 tokens, on the GPU.

Every DP4A weight format, T = 2..32 tokens (each token tile 8 / 16 / 32, partly filled), rows that are
not a multiple of the 64- or 128-row tile, rows of 256 x 1, 9, 17 values and (formats of 32-value blocks) of 25
and 129 blocks (a partial last stage of 8 blocks), one split and split K up to one stage per split (the
partial sums added by splitk_sum), with and without the residual, the
outputs of a fused group written split into its members (matmul_split), outputs poisoned with NaN. Each result
against the exact NumPy emulation of the DP4A arithmetic (the dequantized weights @ the q8_1-rounded
activations, fp64; normalized error < 2e-5) and against the kernels before it (MINECART_GEMM_BATCH=off),
on fresh random inputs each run; the launches are recorded, so a test fails if the kernel it means to
check did not run."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.kernels import kquant_layout as L

from tests.gpu.test_kquant_gemv import checked_matmul, dense, nerr, q8_1_emulation, sane_blocks
from tests.gpu.test_more_quants import make_tensor

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

TOL = 2e-5



def _weight(type_name: str, R: int, K: int, rng):
    """(device weight, its dense float values) of random blocks of `type_name`."""
    from minecart.engine import quants as Q
    from minecart.kernels import ops

    if type_name in L.KQUANT_TYPES:
        raw = sane_blocks(type_name, R, K, rng)
        return ops.upload_weight(raw, type_name, (R, K)), dense(type_name, raw, (R, K))
    info = make_tensor(rng, type_name, (R, K), 0.05)
    return ops.upload_weight(info.raw, type_name, (R, K)), Q.dequantize(info).reshape(R, K)


def _shapes(type_name: str):
    if type_name in L.KQUANT_TYPES or type_name == "IQ4_XS":  # rows of whole 256-value super-blocks
        return ((259, 2304), (37, 256), (1001, 4352))
    return ((259, 2304), (37, 800), (130, 4128))


def _formats():
    from minecart.kernels.build import DP4A_TYPES

    return DP4A_TYPES


@pytest.mark.parametrize("type_name", _formats())
@pytest.mark.parametrize("T", [2, 8, 9, 16, 17, 32])
def test_every_format_tile_and_split(monkeypatch, poison, launches, type_name, T):
    from minecart.kernels import ops

    rng = np.random.default_rng()  # fresh inputs each run
    q = ops.QT[type_name]
    tt = next(n for n in (8, 16, 32) if T <= n)
    for R, K in _shapes(type_name):
        w, wdense = _weight(type_name, R, K, rng)
        x = rng.standard_normal((T, K)).astype(np.float32)
        r = rng.standard_normal((T, R)).astype(np.float32)
        emu = q8_1_emulation(x, wdense)
        gx, gr = cp.asarray(x), cp.asarray(r)
        monkeypatch.setattr(ops, "GEMM_BATCH_VARIANT", "off")
        old = cp.asnumpy(ops.matmul(gx, w, "dp4a"))
        assert nerr(old, emu) < TOL
        monkeypatch.setattr(ops, "GEMM_BATCH_VARIANT", "on")
        stages = -(-(K // 32) // 8)
        seen = set()
        for per_sm in (0, 2, 6, 10_000):  # one split; the default; more splits; one stage per split
            monkeypatch.setattr(ops, "GEMM_BATCH_BLOCKS_PER_SM", per_sm)
            splits, per = ops.gemm_batch_splits(R, K, ops.sm_count(), tt)
            assert splits * per >= stages > (splits - 1) * per
            seen.add(splits)
            for res in (None, gr):
                y = checked_matmul(w, gx, res, r, emu, poison, launches,
                                   f"{type_name} {R}x{K} T={T} splits={splits}", TOL)
                name = f"gemm_batch<{q}, {tt}>"
                assert launches == [name] + (["splitk_sum"] if splits > 1 else []), launches
                if res is None:
                    assert nerr(y, old) < TOL
            # split into a fused group's members as it writes them (random bounds, 1..8 members)
            cuts = np.sort(rng.choice(np.arange(1, R), size=int(rng.integers(0, min(7, R - 1) + 1)), replace=False))
            bounds = [0, *(int(c) for c in cuts), R]
            ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
            poison()
            launches.clear()
            outs = ops.matmul_split(gx, w, ranges)
            assert launches == [name] + (["splitk_sum"] if splits > 1 else []), launches
            for (a, b), o in zip(ranges, outs, strict=True):
                assert o.shape == (T, b - a) and o.flags.c_contiguous
                assert nerr(cp.asnumpy(o), emu[:, a:b]) < TOL, (type_name, R, K, T, splits, a, b)
        assert 1 in seen and (stages == 1 or max(seen) == stages), (seen, stages)
    print(f"\n{type_name} T={T}: gemm_batch<{q}, {tt}> agrees with the emulation and the kernels before it")


def test_auto_picks_it_from_the_threshold_and_is_deterministic(monkeypatch, launches):
    """"auto": the GEMVs below GEMM_BATCH_MIN_T tokens, gemm_batch from there to 32, the prefill GEMM above;
    the split-K sum adds in a fixed order (two runs, the same bits)."""
    from minecart.kernels import ops

    rng = np.random.default_rng()
    monkeypatch.setattr(ops, "GEMM_BATCH_VARIANT", "auto")
    w, _ = _weight("Q4_K", 4096, 4096, rng)
    for T in (ops.GEMM_BATCH_MIN_T - 1, ops.GEMM_BATCH_MIN_T, 32, 33):
        x = cp.asarray(rng.standard_normal((T, 4096)).astype(np.float32))
        launches.clear()
        a = cp.asnumpy(ops.matmul(x, w, "dp4a"))
        uses = any(n.startswith("gemm_batch<") for n in launches)
        assert uses == (ops.GEMM_BATCH_MIN_T <= T <= 32), (T, launches)
        if uses:
            assert "splitk_sum" in launches  # 64 row tiles on any card with more than 32 multiprocessors
            np.testing.assert_array_equal(a, cp.asnumpy(ops.matmul(x, w, "dp4a")))
    assert ops.gemv_max_t(w) == 32
    monkeypatch.setattr(ops, "GEMM_BATCH_VARIANT", "fast")
    with pytest.raises(ValueError, match="MINECART_GEMM_BATCH"):
        ops.matmul(x, w, "dp4a")
