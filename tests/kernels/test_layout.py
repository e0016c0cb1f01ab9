"""kernels/layout.py on the CPU: `relayout` (the scale split of Q8_0 / Q4_0 / Q5_0 / IQ4_NL, rows as
stored for the rest) keeps every byte, puts each block's fp16 scale in `wd` and the rest of the block
in `wq` in order, and is lossless: dequantizing from (wq, wd) gives engine/quants.py's values bit for
bit (Q8_0, Q4_0). The GPU test (tests/gpu/test_experts_stream.py) checks the host layout against
ops.upload_weight byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.gguf_file import TensorInfo
from minecart.kernels import kquant_layout
from minecart.kernels.layout import SPLIT_SCALES, array_bytes, relayout


def _blocks(type_name: str, rows: int, K: int, rng) -> np.ndarray:
    """Random raw blocks (every quant bit pattern) with finite, varied fp16 scales."""
    nb = SPLIT_SCALES[type_name]
    raw = rng.integers(0, 256, (rows, K // 32, nb), dtype=np.uint8)
    scales = (rng.standard_normal((rows, K // 32)) * rng.choice([1e-3, 1.0, 50.0], (rows, K // 32)))
    raw[:, :, :2] = scales.astype(np.float16).view(np.uint8).reshape(rows, K // 32, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", list(SPLIT_SCALES))
@pytest.mark.parametrize("rows,K", [(1, 32), (3, 96), (17, 256), (5, 4096)])
def test_split_keeps_every_byte_in_place(type_name, rows, K):
    rng = np.random.default_rng(rows * K)
    raw = _blocks(type_name, rows, K, rng)
    wq, wd = relayout(np, raw, type_name, rows, K)
    nb = SPLIT_SCALES[type_name]
    blk = raw.reshape(rows, K // 32, nb)
    assert wd is not None and wd.dtype == np.uint16 and wd.shape == (rows, K // 32)
    assert wq.dtype == np.uint8 and wq.shape == (rows, K // 32 * (nb - 2))
    np.testing.assert_array_equal(wd.view(np.uint8).reshape(rows, K // 32, 2), blk[:, :, :2])
    np.testing.assert_array_equal(wq.reshape(rows, K // 32, nb - 2), blk[:, :, 2:])
    assert wq.nbytes + wd.nbytes == raw.nbytes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q8_0_and_q4_0_dequantize_from_the_split_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    rows, K = 7, 160
    for type_name, tid in (("Q8_0", Q.Q8_0), ("Q4_0", Q.Q4_0)):
        raw = _blocks(type_name, rows, K, rng)
        info = TensorInfo("blk.0.w.weight", tid, type_name, (rows, K), raw, raw.nbytes)
        want = Q.dequantize(info).reshape(rows, K)
        wq, wd = relayout(np, raw, type_name, rows, K)
        d = wd.view(np.float16).astype(np.float32)[:, :, None]  # (rows, K/32, 1)
        if type_name == "Q8_0":
            q = wq.view(np.int8).reshape(rows, K // 32, 32).astype(np.float32)
        else:  # low nibbles are values 0-15 of a block, high nibbles 16-31, offset 8
            b = wq.reshape(rows, K // 32, 16)
            q = np.concatenate([b & 15, b >> 4], axis=2).astype(np.float32) - 8
        got = (d * q).reshape(rows, K)
        np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("type_name,width", [("F16", 2), ("F32", 4), ("Q4_K", 144 / 256), ("Q6_K", 210 / 256)])
def test_other_types_keep_their_rows(type_name, width):
    rows, K = 4, 512
    raw = np.random.default_rng(3).integers(0, 256, int(rows * K * width), dtype=np.uint8)
    wq, wd = relayout(np, raw, type_name, rows, K)
    assert wd is None and wq.shape == (rows, int(K * width))
    np.testing.assert_array_equal(wq.reshape(-1), raw)


def test_bytes_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="not whole 34-byte blocks"):
        relayout(np, np.zeros(33, np.uint8), "Q8_0", 1, 32)


@pytest.mark.parametrize("type_name", [*SPLIT_SCALES, *kquant_layout.KQUANT_TYPES, "F16", "Q4_1"])
@pytest.mark.parametrize("rows,K", [(1, 256), (3, 5120), (2, 17408)])
def test_array_bytes_are_the_layouts_arrays(type_name, rows, K):
    """array_bytes (what CupyBackend sizes a part's weight arena from, before any upload) is the nbytes
    of the arrays the layout makes: relayout's for the scale split and the rows kept as stored,
    kquant_layout.repack's for the K-quants (Q6_K's group headers included: K = 5120 and 17408 are 20
    and 68 super-blocks, not whole groups of 8, so its arrays are not the file's bytes)."""
    rng = np.random.default_rng(rows * K)
    if type_name in kquant_layout.KQUANT_TYPES:
        from tests.kernels.test_kquant_layout import random_blocks

        raw = random_blocks(type_name, rows, K, rng).reshape(rows, -1)
        wq, wd = kquant_layout.repack(raw, type_name, K)
    else:
        row_bytes = {"F16": 2 * K, "Q4_1": K // 32 * 20}.get(type_name) or K // 32 * SPLIT_SCALES[type_name]
        raw = rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8)
        wq, wd = relayout(np, raw, type_name, rows, K)
    assert array_bytes(type_name, rows, K, raw.shape[1]) == (wq.nbytes, 0 if wd is None else wd.nbytes)
