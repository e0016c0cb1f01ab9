"""Dequantizers: bit-exact with gguf-py on random blocks of every supported type; row lookups; errors;
the simple quantizers round-trip within their format's error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.errors import UnsupportedQuantError
from minecart.engine.gguf_file import TensorInfo

# byte offsets of the fp16 scale fields in each block layout
_F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2),
               Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}


def random_raw(type_id: int, shape: tuple[int, ...], rng) -> np.ndarray:
    """Random bytes for a tensor of logical `shape`, with finite fp16 scales (random but not NaN/inf)."""
    bv, bb = Q.BLOCK_SIZES[type_id]
    n_blocks = int(np.prod(shape)) // bv
    if type_id == Q.F32:
        return rng.standard_normal(shape).astype("<f4").view(np.uint8).reshape(*shape[:-1], -1)
    if type_id == Q.F16:
        return (rng.standard_normal(shape) * 10).astype("<f2").view(np.uint8).reshape(*shape[:-1], -1)
    blocks = rng.integers(0, 256, (n_blocks, bb), dtype=np.uint8)
    if type_id == Q.BF16:  # avoid NaN patterns: exponent field not all ones
        blocks[:, 1] &= 0xBF
    for off in _F16_FIELDS.get(type_id, ()):
        scale = rng.standard_normal(n_blocks) * rng.choice([1e-3, 1.0, 100.0], n_blocks)
        blocks[:, off : off + 2] = scale.astype("<f2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], -1)


def info_for(type_id: int, raw: np.ndarray, shape, name="blk.0.test.weight") -> TensorInfo:
    return TensorInfo(name, type_id, Q.type_name(type_id), tuple(shape), raw, raw.nbytes)


def test_block_table_matches_gguf_constants():
    for qtype, (bv, bb) in gguf.constants.GGML_QUANT_SIZES.items():
        assert Q.BLOCK_SIZES[int(qtype)] == (bv, bb), qtype.name
        assert Q.type_name(int(qtype)) == qtype.name
    assert Q.SUPPORTED_TYPES <= set(Q.BLOCK_SIZES)


@pytest.mark.parametrize("type_id", sorted(Q.SUPPORTED_TYPES), ids=Q.type_name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bit_exact_with_gguf(type_id, seed):
    rng = np.random.default_rng(seed * 100 + type_id)
    bv, _ = Q.BLOCK_SIZES[type_id]
    per_row = max(bv, 256) * (1 + seed)  # several blocks per row
    for shape in ((7, per_row), (1, per_row), (3, 5, per_row)):  # odd row counts, a 3-D tensor
        raw = random_raw(type_id, shape, rng)
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id))
        got = Q.dequantize(info_for(type_id, raw, shape))
        assert got.dtype == np.float32 and got.shape == shape
        assert np.isfinite(got).all() and np.abs(got).max() > 0
        np.testing.assert_array_equal(got.view(np.uint32), np.asarray(ref, np.float32).view(np.uint32))


@pytest.mark.parametrize("type_id", sorted(Q.SUPPORTED_TYPES), ids=Q.type_name)
def test_dequantize_rows(type_id):
    rng = np.random.default_rng(7)
    shape = (37, 512)
    raw = random_raw(type_id, shape, rng)
    info = info_for(type_id, raw, shape, "token_embd.weight")
    full = Q.dequantize(info)
    rows = [36, 0, 5, 5, 17]
    np.testing.assert_array_equal(Q.dequantize_rows(info, rows), full[rows])
    np.testing.assert_array_equal(Q.dequantize_rows(info, np.array([3])), full[3:4])
    assert Q.dequantize_rows(info, []).shape == (0, 512)
    with pytest.raises(IndexError, match="row 37"):
        Q.dequantize_rows(info, [1, 37])


def test_chunked_path_matches_single_pass():
    """Tensors larger than one dequantization chunk give the same result as gguf-py."""
    rng = np.random.default_rng(3)
    shape = (Q._CHUNK_BLOCKS // 8 + 3, 256)  # > one chunk of Q4_K blocks
    raw = random_raw(Q.Q4_K, shape, rng)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    np.testing.assert_array_equal(Q.dequantize(info_for(Q.Q4_K, raw, shape)), ref)


@pytest.mark.parametrize("type_id", [Q.TYPE_IDS["Q2_K"], Q.TYPE_IDS["IQ2_XXS"], Q.TYPE_IDS["MXFP4"]])
def test_unsupported_types_name_tensor_type_and_fix(type_id):
    bv, bb = Q.BLOCK_SIZES[type_id]
    raw = np.zeros((2, bb), np.uint8)
    info = info_for(type_id, raw, (2, bv), "blk.4.ffn_down.weight")
    for call in (lambda: Q.dequantize(info, "model.gguf"), lambda: Q.dequantize_rows(info, [0], "model.gguf")):
        with pytest.raises(UnsupportedQuantError) as err:
            call()
        msg = str(err.value)
        assert "model.gguf" in msg and "blk.4.ffn_down.weight" in msg and Q.type_name(type_id) in msg
        assert "llama-quantize" in msg and "Q8_0" in msg


def test_size_mismatch_is_a_gguf_error():
    raw = np.zeros((2, 34), np.uint8)
    with pytest.raises(Q.GGUFError, match="need"):
        Q.dequantize(info_for(Q.Q8_0, raw, (2, 64)))


@pytest.mark.parametrize("type_id,max_rel_rmse", [(Q.Q8_0, 0.01), (Q.Q4_0, 0.12), (Q.Q4_1, 0.1),
                                                  (Q.Q5_0, 0.06), (Q.Q5_1, 0.05), (Q.Q4_K, 0.12),
                                                  (Q.Q6_K, 0.03), (Q.F16, 1e-3), (Q.BF16, 5e-3)],
                         ids=lambda v: Q.type_name(v) if isinstance(v, int) else str(v))
def test_quantize_roundtrip(type_id, max_rel_rmse):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((9, 768)).astype(np.float32) * np.linspace(0.1, 3, 768, dtype=np.float32)
    raw = Q.quantize(x, type_id)
    assert raw.dtype == np.uint8 and raw.shape == (9, Q.bytes_per_row(type_id, 768))
    y = Q.dequantize(info_for(type_id, raw, x.shape))
    rel = np.sqrt(np.mean((x - y) ** 2)) / np.sqrt(np.mean(x**2))
    assert rel < max_rel_rmse, rel
    assert rel > 0 or type_id == Q.F32


def test_q8_0_quantizer_is_ggmls():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(Q.quantize(x, Q.Q8_0), ref)


def test_k_scale_packing_roundtrip():
    rng = np.random.default_rng(2)
    sc = rng.integers(0, 64, (50, 8), dtype=np.uint8)
    m = rng.integers(0, 64, (50, 8), dtype=np.uint8)
    sc2, m2 = Q.k_scales_mins(Q.pack_k_scales_mins(sc, m))
    np.testing.assert_array_equal(sc2, sc)
    np.testing.assert_array_equal(m2, m)


def test_fixture_q8_0_matches_gguf(fixtures_dir):
    """The Q8_0 fixture's tensors decode exactly as gguf-py decodes them, and close to the F16 file's
    (the same weights before quantization)."""
    from minecart.engine.gguf_file import GGUFFile

    q8 = GGUFFile(fixtures_dir / "dense/qwen35-tiny-dense-q8_0.gguf")
    f16 = GGUFFile(fixtures_dir / "dense/qwen35-tiny-dense-f16.gguf")
    for name in ("blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.7.ffn_down.weight"):
        info = q8.tensor(name)
        ref = gguf.quants.dequantize(np.asarray(info.raw), gguf.GGMLQuantizationType.Q8_0)
        got = q8.dequantize(name)
        np.testing.assert_array_equal(got, ref)
        exact = f16.dequantize(name)
        assert np.abs(got - exact).max() <= np.abs(exact).max() / 127 + 1e-6
    ids = [0, 248044, 248319, 1234]
    np.testing.assert_array_equal(q8.dequantize_rows("token_embd.weight", ids), q8.dequantize("token_embd.weight")[ids])
