"""K-quants (Q4_K, Q5_K, Q6_K) in their repacked device layout (kernels/kquant_layout.py), on the GPU.

The device repack (ops.upload_weight: kquant_layout.repack run with CuPy, in row chunks) against the
value-by-value NumPy model, byte for byte; then every kernel that reads the layout against NumPy
dequantize-then-matmul on fresh random inputs: the single-token K-quant GEMV gemv_kq in every compiled
shape (and the generic gemv_dp4a_split / gemv_dp4a over the same layout), with and without the residual
epilogue; the multi-token GEMV (T = 1..8); the GEMMs (dp4a, dp4a2, fma, hfma2); the FMA GEMV; the
expert GEMVs (matmul_experts) and embed (bit-exact). Rows of 256 x odd values (tail super-blocks and
Q6_K tail groups), odd row counts, outputs poisoned with NaN. The DP4A results are compared with the
exact emulation of their arithmetic (int8 activations, fp64 sums; normalized error < 2e-5)."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.gguf_file import TensorInfo
from minecart.kernels import kquant_layout as L

from tests.kernels.test_kquant_layout import random_blocks

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

TYPE_IDS = {"Q4_K": Q.Q4_K, "Q5_K": Q.Q5_K, "Q6_K": Q.Q6_K}
SHAPES = ((259, 256), (37, 2304), (1001, 4352), (130, 4096), (67, 12544))  # K = 256 x 1, 9, 17, 16, 49


def nerr(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the GPU result (an output left unwritten?)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def checked_matmul(w, gx, res, r: np.ndarray, emu: np.ndarray, poison, launches: list, label: str,
                   tol: float) -> np.ndarray:
    """ops.matmul(gx, w, "dp4a", residual=res) on a pool poisoned with NaN and with the launch record
    (the `launches` fixture) cleared first, checked against the emulation emu (+ r with the residual)
    to a normalized error below tol -> the result on the host."""
    from minecart.kernels import ops

    poison()
    launches.clear()
    y = cp.asnumpy(ops.matmul(gx, w, "dp4a", residual=res))
    want = emu + (r if res is not None else 0)
    assert y.shape == want.shape
    err = nerr(y, want)
    assert err < tol, f"{label}{' +res' if res is not None else ''}: error {err:.2e}"
    return y


def sane_blocks(type_name: str, rows: int, K: int, rng) -> np.ndarray:
    """Random quants, scales and mins (every bit pattern) with fp16 d / dmin of one magnitude, so
    that no block dominates the normalized error."""
    raw = random_blocks(type_name, rows, K, rng).reshape(-1, L.SUPER_BYTES[type_name])
    offs = (208,) if type_name == "Q6_K" else (0, 2)
    for off in offs:
        d = rng.uniform(0.5, 1.5, len(raw)) * 1e-3
        raw[:, off:off + 2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def dense(type_name: str, raw: np.ndarray, shape) -> np.ndarray:
    info = TensorInfo("blk.0.w.weight", TYPE_IDS[type_name], type_name, tuple(shape), raw, raw.nbytes)
    return Q.dequantize(info).reshape(-1, shape[-1])


def q8_1_emulation(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The DP4A arithmetic in NumPy: x rounded to int8 per 32 values (quantize_q8_1), exact products."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32).astype(np.float32)
    d = np.abs(xb).max(axis=2, keepdims=True) / np.float32(127.0)
    q = np.where(d > 0, np.rint(xb / np.where(d > 0, d, 1)), 0)
    return (q * d).reshape(T, K).astype(np.float64) @ w.astype(np.float64).T


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
def test_device_repack_is_the_numpy_model(monkeypatch, poison, type_name):
    from minecart.kernels import ops

    rng = np.random.default_rng(1)
    for shape in ((37, 256), (5, 2304), (3, 7, 4352), (16, 4096)):
        R, K = int(np.prod(shape[:-1])), shape[-1]
        raw = random_blocks(type_name, R, K, rng, extreme=True)
        want_q, want_d = L.repack_reference(raw, type_name, K)
        for chunk in (ops._KQ_CHUNK_BYTES, 3 * K // 256 * L.SUPER_BYTES[type_name] + 1):  # one, many chunks
            monkeypatch.setattr(ops, "_KQ_CHUNK_BYTES", chunk)
            poison()
            w = ops.upload_weight(raw, type_name, shape)
            assert w.wq.shape == want_q.shape and w.wd.shape == want_d.shape
            assert w.wd.dtype == cp.uint16 and w.wq.dtype == cp.uint8
            np.testing.assert_array_equal(cp.asnumpy(w.wq), want_q)
            np.testing.assert_array_equal(cp.asnumpy(w.wd), want_d)
            assert w.nbytes == want_q.nbytes + want_d.nbytes
    print(f"\n{type_name}: the device repack equals the NumPy model byte for byte")


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
def test_embed_is_bit_exact(poison, type_name):
    from minecart.kernels import ops

    rng = np.random.default_rng(2)
    R, K = 301, 2304
    raw = random_blocks(type_name, R, K, rng, extreme=True)
    ref = dense(type_name, raw, (R, K))
    w = ops.upload_weight(raw, type_name, (R, K))
    ids = np.array([0, 300, 17, 17, 150, 299], np.int32)
    poison()
    got = cp.asnumpy(ops.embed(w, cp.asarray(ids)))
    np.testing.assert_array_equal(got, ref[ids])


def _gemv_case(type_name: str, R: int, K: int, rng):
    """A random (R, K) weight on the device, the q8_1 emulation of one random token through it, a random
    residual row, and the token and residual on the device."""
    from minecart.kernels import ops

    raw = sane_blocks(type_name, R, K, rng)
    w = ops.upload_weight(raw, type_name, (R, K))
    x = rng.standard_normal((1, K)).astype(np.float32)
    r = rng.standard_normal((1, R)).astype(np.float32)
    return w, q8_1_emulation(x, dense(type_name, raw, (R, K))), r, cp.asarray(x), cp.asarray(r)


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
def test_single_token_gemv_variants(monkeypatch, poison, type_name):
    """gemv_kq in every compiled (warps per row, blocks per lane) shape, gemv_kq_stream ("sN"), "auto",
    and the generic kernels ("split" = gemv_dp4a_split / gemv_dp4a), with and without the residual."""
    from minecart.kernels import ops

    rng = np.random.default_rng(3)
    variants = ["auto", "split", *ops._kq_variants()]
    for R, K in SHAPES:
        w, emu, r, gx, gr = _gemv_case(type_name, R, K, rng)
        for v in variants:
            monkeypatch.setattr(ops, "GEMV_KQ_VARIANT", v)
            for gv in (("auto", "old") if v == "split" else ("auto",)):
                monkeypatch.setattr(ops, "GEMV_VARIANT", gv)
                poison()
                y = cp.asnumpy(ops.matmul(gx, w, "dp4a"))
                assert nerr(y, emu) < 2e-5, f"{v}/{gv} {R}x{K}: error {nerr(y, emu):.2e}"
                poison()
                yr = cp.asnumpy(ops.matmul(gx, w, "dp4a", residual=gr))
                assert nerr(yr, emu + r) < 2e-5, f"{v}/{gv} {R}x{K} +residual: error {nerr(yr, emu + r):.2e}"
    print(f"\n{type_name}: gemv variants {', '.join(variants)} agree with the emulation")


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
def test_streaming_gemv_is_gemv_kq_bit_for_bit(monkeypatch, poison, type_name):
    """gemv_kq_stream adds the same terms in the same order as gemv_kq with one warp per row: equal
    outputs, bit for bit, on matrices with more rows than the card holds warps at once (each warp
    streams several rows) and rows of several rounds (the next round's loads in flight across the row
    change), with and without the residual; and within the emulation's tolerance."""
    from minecart.kernels import ops
    from minecart.kernels.build import GEMV_KQ_STREAM

    rng = np.random.default_rng(11)
    for R, K in ((9001, 2304), (4099, 12544), (70001, 256)):
        w, emu, r, gx, gr = _gemv_case(type_name, R, K, rng)
        for nu in GEMV_KQ_STREAM:
            name = ops.KqGemv(1, nu, True).kernel(type_name)
            held = 4 * ops._resident_blocks(ops._mm_kernel(w, name), name, 128)
            for res in (None, gr):
                monkeypatch.setattr(ops, "GEMV_KQ_VARIANT", f"1x{nu}")
                poison()
                want = cp.asnumpy(ops.matmul(gx, w, "dp4a", residual=res))
                monkeypatch.setattr(ops, "GEMV_KQ_VARIANT", f"s{nu}")
                poison()
                got = cp.asnumpy(ops.matmul(gx, w, "dp4a", residual=res))
                np.testing.assert_array_equal(got, want, err_msg=f"s{nu} {R}x{K} residual={res is not None}")
                ref = emu if res is None else emu + r
                assert nerr(got, ref) < 2e-5, f"s{nu} {R}x{K}: error {nerr(got, ref):.2e}"
            print(f"\n{type_name} {R}x{K} s{nu}: {held} warps held for {R} rows, equal to gemv_kq<1, {nu}>")


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 13, 130])
def test_matmul_paths(poison, type_name, T):
    """DP4A GEMV (T <= 8, launches of 8/4/2/1 tokens) and GEMM (dp4a, dp4a2), the FMA kernels and the
    HFMA2 kernels (formats that have them) on the repacked layout."""
    from minecart.kernels import hfma2, ops
    from minecart.kernels.build import HFMA2_TYPES

    rng = np.random.default_rng(T + 10 * len(type_name))
    for R, K in ((259, 256), (131, 2304), (67, 4352)):
        raw = sane_blocks(type_name, R, K, rng)
        wd = dense(type_name, raw, (R, K))
        w = ops.upload_weight(raw, type_name, (R, K))
        x = rng.standard_normal((T, K)).astype(np.float32)
        gx = cp.asarray(x)
        ref = x.astype(np.float64) @ wd.astype(np.float64).T
        emu = q8_1_emulation(x, wd)
        for path in ("dp4a", "dp4a2"):
            poison()
            y = cp.asnumpy(ops.matmul(gx, w, path))
            assert y.shape == (T, R)
            assert nerr(y, emu) < 2e-5, f"{path} T={T} {R}x{K}: {nerr(y, emu):.2e}"
            assert nerr(y, ref) < 1.5e-2
        poison()
        y = cp.asnumpy(ops.matmul(gx, w, "fma"))
        assert nerr(y, ref) < 2e-5, f"fma T={T} {R}x{K}: {nerr(y, ref):.2e}"
        if type_name in HFMA2_TYPES:
            poison()
            y = cp.asnumpy(hfma2.matmul(gx, w))
            assert nerr(y, ref) < 5e-3, f"hfma2 T={T} {R}x{K}: {nerr(y, ref):.2e}"


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
def test_matmul_experts(poison, type_name):
    from minecart.kernels import ops

    rng = np.random.default_rng(5)
    E, R, K, k = 4, 67, 2304, 2
    raw = sane_blocks(type_name, E * R, K, rng)
    wd = dense(type_name, raw, (E * R, K)).reshape(E, R, K)
    w = ops.upload_weight(raw, type_name, (E, R, K))
    T = 3
    x = rng.standard_normal((T, K)).astype(np.float32)
    ids = np.array([3, 0, 1, 1, 2, 3], np.int32)  # (token, slot) pairs p: token p // k
    for path in ("dp4a", "fma"):
        poison()
        y = cp.asnumpy(ops.matmul_experts(cp.asarray(x), w, cp.asarray(ids), k, path))
        for p, e in enumerate(ids):
            xp = x[p // k:p // k + 1]
            want = q8_1_emulation(xp, wd[e])[0] if path == "dp4a" else xp[0].astype(np.float64) @ wd[e].T
            assert nerr(y[p], want) < 2e-5, f"{path} pair {p}: {nerr(y[p], want):.2e}"


def test_bench_gemv_runs():
    """The benchmark module on one small shape: it times every variant and reports sane numbers."""
    from minecart.kernels import bench_gemv

    rows = bench_gemv.run(shapes=((1024, 2304, False),), types=L.KQUANT_TYPES, cycle_bytes=8 << 20, reps=2)
    assert {r.type_name for r in rows} == set(L.KQUANT_TYPES)
    assert all(r.seconds > 0 and r.gbs > 0 and r.copy_share > 0 for r in rows)


@pytest.mark.parametrize("type_name", L.KQUANT_TYPES)
def test_backend_keeps_the_format(poison, type_name):
    """CupyBackend.load_weight keeps each K-quant in its own format (Q5_K included, no F32 decode) and
    its matmul / embed agree with the NumPy backend."""
    from minecart.engine.backends.cupy_backend import CupyBackend
    from minecart.engine.backends.numpy_backend import NumpyBackend

    rng = np.random.default_rng(9)
    R, K, T = 77, 2304, 3
    raw = sane_blocks(type_name, R, K, rng)
    info = TensorInfo("blk.0.w.weight", TYPE_IDS[type_name], type_name, (R, K), raw, raw.nbytes)
    nbk, gb = NumpyBackend(int_experts=False), CupyBackend("cuda:0", probe=False)
    w = gb.load_weight(info)
    assert w.q.type_name == type_name
    x = rng.standard_normal((T, K)).astype(np.float32)
    y = gb.to_numpy(gb.matmul(gb.asarray(x), w))
    ref = nbk.matmul(x, nbk.load_weight(info))
    assert nerr(y, ref) < 1.5e-2
    e = gb.to_numpy(gb.embed(gb.load_weight(info, role="embedding"), [0, 76, 5]))
    np.testing.assert_array_equal(e, dense(type_name, raw, (R, K))[[0, 76, 5]])
