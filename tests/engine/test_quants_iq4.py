"""IQ4_NL and IQ4_XS in engine/quants.py: blocks written by hand from the format's definition, bit-exact
agreement with gguf.quants on random blocks, and the simple quantizers' round trip."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from minecart.engine import quants as Q

LEVELS = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def test_levels_are_the_format_table():
    assert Q.KVALUES.tolist() == LEVELS
    assert list(gguf.quants.IQ4_NL.kvalues) == LEVELS


def test_iq4_nl_hand_block():
    # d = 0.5; byte j holds code j (value j) in its low nibble and code 15 - j (value j + 16) in its high
    qs = bytes(j | ((15 - j) << 4) for j in range(16))
    block = np.frombuffer(np.float16(0.5).tobytes() + qs, dtype=np.uint8)
    low = [-63.5, -52.0, -41.5, -32.5, -24.5, -17.5, -11.0, -5.0, 0.5, 6.5, 12.5, 19.0, 26.5, 34.5, 44.5, 56.5]
    np.testing.assert_array_equal(Q.dequantize_blocks(block, Q.IQ4_NL), np.array(low + low[::-1], np.float32))


def test_iq4_xs_hand_block():
    # d = 0.25; sub-block 6-bit scales ls = 0, 1, 31, 32, 33, 47, 62, 63 (ls - 32 = -32, -31, -1, 0, 1,
    # 15, 30, 31). Low 4 bits 0, 1, 15, 0, 1, 15, 14, 15 -> scales_l bytes 0x10, 0x0F, 0xF1, 0xFE; high
    # 2 bits 0, 0, 1, 2, 2, 2, 3, 3 at bits 2 ib -> scales_h = 0xFA90.
    ls_minus_32 = [-32, -31, -1, 0, 1, 15, 30, 31]
    head = np.float16(0.25).tobytes() + (0xFA90).to_bytes(2, "little") + bytes([0x10, 0x0F, 0xF1, 0xFE])
    # sub-block ib, byte j: code (j + ib) % 16 for value j, code j for value j + 16
    qs = bytes(((j + ib) % 16) | (j << 4) for ib in range(8) for j in range(16))
    block = np.frombuffer(head + qs, dtype=np.uint8)
    assert block.size == 136
    want = []
    for ib in range(8):
        dl = 0.25 * ls_minus_32[ib]
        want += [dl * LEVELS[(j + ib) % 16] for j in range(16)] + [dl * LEVELS[j] for j in range(16)]
    got = Q.dequantize_blocks(block, Q.IQ4_XS)
    np.testing.assert_array_equal(got, np.array(want, np.float32))
    assert got[0] == 1016.0 and got[32 * 3] == 0.0 and got[32 * 7 + 31] == 31 * 0.25 * 113


@pytest.mark.parametrize("type_id", [Q.IQ4_NL, Q.IQ4_XS], ids=Q.type_name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_iq4_bit_exact_with_gguf(type_id, seed):
    rng = np.random.default_rng(seed)
    bv, bb = Q.BLOCK_SIZES[type_id]
    blocks = rng.integers(0, 256, (97, bb), dtype=np.uint8)
    d = rng.standard_normal(97) * rng.choice([1e-3, 1.0, 100.0], 97)
    blocks[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(type_id)).reshape(-1)
    got = Q.dequantize_blocks(blocks, type_id)
    np.testing.assert_array_equal(got.view(np.uint32), np.asarray(ref, np.float32).view(np.uint32))


@pytest.mark.parametrize("type_id", [Q.IQ4_NL, Q.IQ4_XS], ids=Q.type_name)
def test_iq4_quantize_round_trip(type_id):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 512)).astype(np.float32) * np.float32(0.03)
    raw = Q.quantize(x, type_id)
    assert raw.shape == (7, Q.bytes_per_row(type_id, 512))
    y = Q.dequantize_blocks(raw, type_id).reshape(x.shape)
    err = np.linalg.norm(y - x) / np.linalg.norm(x)
    assert err < 0.12  # 16 levels per block: ~8% for Gaussian values
    # the largest magnitude of each block is represented (it maps to the -127 level)
    bv = 32
    blk_x, blk_y = x.reshape(-1, bv), y.reshape(-1, bv)
    i = np.abs(blk_x).argmax(axis=1)
    top_x, top_y = blk_x[np.arange(len(i)), i], blk_y[np.arange(len(i)), i]
    assert np.all(np.sign(top_x) == np.sign(top_y))
    zeros = Q.dequantize_blocks(Q.quantize(np.zeros((2, 256), np.float32), type_id), type_id)
    assert np.all(zeros == 0)


def test_iq4_types_are_supported():
    assert {Q.IQ4_NL, Q.IQ4_XS} <= Q.SUPPORTED_TYPES
