"""GGUFFile: reads the fixtures and gguf-py-written files correctly, maps tensors without copying, and
rejects every kind of broken header with a GGUFError that names the file, the key or tensor, and a fix."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
from minecart.engine.errors import (
    GGUFError,
    MissingKeyError,
    MissingTensorError,
    UnsupportedQuantError,
)
from minecart.engine.gguf_file import GGUFFile

DENSE = ("dense/qwen35-tiny-dense-f16.gguf", "dense/qwen35-tiny-dense-q8_0.gguf")


# -- a tiny hand-rolled GGUF builder (independent of engine/synth.py) ----------------------------------


def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def kv_u32(key, v):
    return s(key) + struct.pack("<II", 4, v)


def kv_str(key, v):
    return s(key) + struct.pack("<I", 8) + s(v)


def tinfo(name, ne, type_id, offset):
    return s(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, type_id, offset)


def build(kvs=(), tensors=(), data=b"", *, magic=b"GGUF", version=3, n_kv=None, n_tensors=None, align=32):
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(tensors)
    head += b"\0" * (-len(head) % align)
    return head + data


def good_file() -> bytes:
    """Two F32 tensors: a (2, 8) matrix and an (8,) vector."""
    mat = np.arange(16, dtype="<f4").tobytes()
    vec = np.linspace(-1, 1, 8, dtype="<f4").tobytes()
    return build(
        [kv_str("general.architecture", "test"), kv_u32("test.block_count", 1)],
        [tinfo("a.weight", (8, 2), 0, 0), tinfo("b.weight", (8,), 0, 64)],
        mat + b"\0" * (64 - len(mat)) + vec,
    )


def write(tmp_path, data: bytes, name="m.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


# -- reading ---------------------------------------------------------------------------------------------


def test_good_file_roundtrip(tmp_path):
    p = write(tmp_path, good_file())
    with GGUFFile(p) as gf:
        assert gf.architecture == "test"
        assert gf.require("test.block_count") == 1
        assert gf.value_types["test.block_count"] == "UINT32"
        a = gf.tensor("a.weight")
        assert a.shape == (2, 8) and a.type_name == "F32" and a.n_bytes == 64
        assert a.raw.shape == (2, 32)
        np.testing.assert_array_equal(gf.dequantize("a.weight"), np.arange(16, dtype=np.float32).reshape(2, 8))
        np.testing.assert_array_equal(gf.dequantize("b.weight"), np.linspace(-1, 1, 8, dtype=np.float32))
        with pytest.raises(MissingKeyError, match="nope"):
            gf.require("nope")
        with pytest.raises(MissingTensorError, match="c.weight"):
            gf.tensor("c.weight")
    assert gf.closed
    with pytest.raises(GGUFError, match="closed"):
        gf.tensor("a.weight")


def test_matches_gguf_writer_output(tmp_path):
    """Every metadata value type and several tensor types, written by gguf-py's own writer."""
    import gguf

    p = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_str", ["a", "", "ü"])
    w.add_array("t.arr_f", [0.5, 1.5])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    q8 = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    gf = GGUFFile(p)
    m = gf.metadata
    assert m["t.u8"] == 200 and m["t.i8"] == -5 and m["t.u16"] == 60000 and m["t.i16"] == -30000
    assert m["t.u32"] == 4_000_000_000 and m["t.i32"] == -2_000_000_000
    assert m["t.f32"] == pytest.approx(0.1, rel=1e-7) and m["t.f64"] == 1e-300
    assert m["t.u64"] == 2**63 + 5 and m["t.i64"] == -(2**62) and m["t.bool"] is True
    assert m["t.str"] == "héllo ✓"
    assert m["t.arr_i32"] == [1, -2, 3] and m["t.arr_str"] == ["a", "", "ü"] and m["t.arr_f"] == [0.5, 1.5]
    assert gf.value_types["t.arr_str"] == "ARRAY[STRING]"
    np.testing.assert_array_equal(gf.dequantize("f32"), x)
    np.testing.assert_array_equal(gf.dequantize("f16"), x.astype(np.float16).astype(np.float32))
    ref = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(gf.dequantize("q8"), ref)
    assert gf.tensor("q8").shape == (3, 64) and gf.tensor("q8").raw.shape == (3, 68)
    # the same view as gguf-py's reader gives
    r = gguf.GGUFReader(str(p))
    for t in r.tensors:
        mine = gf.tensor(t.name)
        assert mine.shape == tuple(int(v) for v in reversed(t.shape))
        assert mine.n_bytes == int(t.n_bytes)
        assert bytes(mine.raw) == bytes(np.asarray(t.data).view(np.uint8))
    gf.close()


def test_mmproj_fixture_agrees_with_gguf_reader(fixtures_dir):
    import gguf

    path = fixtures_dir / "vision/mmproj-qwen35-tiny-vl-f16.gguf"
    gf = GGUFFile(path)
    r = gguf.GGUFReader(str(path))
    keys = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    assert keys == gf.metadata
    assert [t.name for t in r.tensors] == list(gf.tensors)
    for t in r.tensors:
        mine = gf.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type) and mine.type_name == t.tensor_type.name
        assert bytes(mine.raw) == bytes(np.asarray(t.data).view(np.uint8))


@pytest.mark.parametrize("rel", DENSE)
def test_dense_fixture_facts(fixtures_dir, rel):
    """Known facts from fixtures/README.md."""
    path = fixtures_dir / rel
    t0 = time.perf_counter()
    gf = GGUFFile(path)
    opened = time.perf_counter() - t0
    assert opened < 10  # generous for a loaded CI machine; ~0.3 s idle
    assert len(gf.metadata) == 34 and len(gf.tensors) == 123
    assert gf.architecture == "qwen35" and gf.get("general.name") == "denseA Hf"
    assert gf.require("qwen35.block_count") == 9
    assert gf.get("qwen35.rope.dimension_sections") == [3, 3, 2, 0]
    assert gf.get("qwen35.attention.recurrent_layers") == [True, True, True, False, True, True, True, False, False]
    assert gf.get("qwen35.rope.freq_base") == 1e7
    toks = gf.get("tokenizer.ggml.tokens")
    assert len(toks) == 248320 and toks[:3] == ["!", '"', "#"]
    assert toks[248044:248047] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert toks[248077] == "[PAD248077]"
    assert len(gf.get("tokenizer.ggml.merges")) == 247587 and gf.get("tokenizer.ggml.merges")[0] == "Ġ Ġ"
    q8 = "q8_0" in rel
    emb = gf.tensor("token_embd.weight")
    assert emb.shape == (248320, 32) and emb.type_name == ("Q8_0" if q8 else "F16")
    assert emb.raw.shape == (248320, 34 if q8 else 64)
    conv = gf.tensor("blk.0.ssm_conv1d.weight")
    assert conv.shape == (128, 4) and conv.type_name == "F32"
    assert gf.tensor("blk.3.attn_q.weight").shape == (512, 32)
    assert gf.tensor("blk.8.nextn.eh_proj.weight").shape == (32, 64)
    # raw is the file's bytes, mapped read-only, not a copy
    for info in (emb, conv, gf.tensor("output_norm.weight")):
        assert not info.raw.flags.writeable and not info.raw.flags.owndata
        with open(path, "rb") as f:
            f.seek(info.offset)
            head = f.read(min(info.n_bytes, 4096))
        assert bytes(info.raw.reshape(-1)[: len(head)]) == head
    gf.close()


def test_huge_sparse_file_opens_fast_without_reading_data(tmp_path):
    """A '30 GB' model (sparse file): opening touches only the header."""
    rows, cols = 7_500_000, 4096  # Q8_0 rows of 4096 values: 32.6 GB
    row_bytes = cols // 32 * 34
    head = build([kv_str("general.architecture", "test")], [tinfo("big.weight", (cols, rows), 8, 0)])
    p = tmp_path / "big.gguf"
    with open(p, "wb") as f:
        f.write(head)
        f.truncate(len(head) + rows * row_bytes)
    t0 = time.perf_counter()
    gf = GGUFFile(p)
    dt = time.perf_counter() - t0
    info = gf.tensor("big.weight")
    assert info.n_bytes == rows * row_bytes > 30e9
    assert info.raw.shape == (rows, row_bytes)
    assert dt < 1.0, f"opening took {dt:.2f} s"
    assert gf.dequantize_rows("big.weight", [0, rows - 1]).shape == (2, cols)  # zeros of a sparse file
    gf.close()


def test_close_keeps_taken_views_valid(tmp_path):
    p = write(tmp_path, good_file())
    gf = GGUFFile(p)
    raw = gf.tensor("a.weight").raw
    gf.close()
    gf.close()  # idempotent
    assert raw.view("<f4")[0, 3] == 3.0


# -- broken files ---------------------------------------------------------------------------------------


def _raises(tmp_path, data, *, match, exc=GGUFError, name="m.gguf"):
    p = write(tmp_path, data, name)
    with pytest.raises(exc) as info:
        GGUFFile(p)
    msg = str(info.value)
    assert str(p) in msg
    assert any(w in msg.lower() for w in ("re-download", "re-convert", "re-quantize", "convert", "check", "update")), msg
    import re

    assert re.search(match, msg), msg
    return info.value


def test_missing_and_empty(tmp_path):
    with pytest.raises(GGUFError, match="not found"):
        GGUFFile(tmp_path / "nope.gguf")
    _raises(tmp_path, b"", match="shorter than a GGUF header")


def test_wrong_magic(tmp_path):
    _raises(tmp_path, b"PK\x03\x04" + b"\0" * 60, match="not a GGUF file.*safetensors")
    _raises(tmp_path, b"ggjt" + b"\0" * 60, match="old GGML")
    _raises(tmp_path, b"XXXX" + good_file()[4:], match="not a GGUF file")


@pytest.mark.parametrize("version,match", [(1, "obsolete"), (4, "unsupported GGUF version 4"),
                                           (0x03000000, "big-endian"), (0xFFFFFFFF, "unsupported")])
def test_versions(tmp_path, version, match):
    _raises(tmp_path, build([kv_str("a", "b")], version=version) + b"\0" * 64, match=match)


def test_version_2_reads(tmp_path):
    data = bytearray(good_file())
    data[4:8] = struct.pack("<I", 2)
    gf = GGUFFile(write(tmp_path, bytes(data)))
    assert gf.version == 2 and gf.tensor("b.weight").shape == (8,)


def test_truncations_everywhere(tmp_path):
    data = good_file()
    # every prefix shorter than the whole file fails (header, keys, tensor infos, data) and names
    # the truncation or the inconsistency it causes
    for cut in range(0, len(data)):
        p = write(tmp_path, data[:cut], f"cut{cut}.gguf")
        with pytest.raises(GGUFError, match=r"truncated|shorter than|past the end"):
            GGUFFile(p)


def test_absurd_counts_fail_fast(tmp_path):
    t0 = time.perf_counter()
    _raises(tmp_path, build(n_kv=2**63) + b"\0" * 64, match="metadata entries")
    _raises(tmp_path, build(n_tensors=2**62) + b"\0" * 64, match="tensors, more than")
    huge_str = s("k") + struct.pack("<I", 8) + struct.pack("<Q", 2**60) + b"x" * 64
    _raises(tmp_path, build([huge_str]), match="truncated", name="s.gguf")
    huge_arr = s("k.arr") + struct.pack("<IIQ", 9, 4, 2**40) + b"\0" * 64
    _raises(tmp_path, build([huge_arr]), match="array of", name="a.gguf")
    nested = s("k.nest") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) * 5 + b"\0" * 64
    _raises(tmp_path, build([nested]), match="nested", name="n.gguf")
    long_key = struct.pack("<Q", 70000) + b"k" * 70000 + struct.pack("<I", 4) + b"\0" * 8
    _raises(tmp_path, build([long_key]), match="at most 65535", name="lk.gguf")
    assert time.perf_counter() - t0 < 5


def test_bad_values(tmp_path):
    _raises(tmp_path, build([s("k.x") + struct.pack("<I", 99) + b"\0" * 16]), match="unknown value type id 99")
    _raises(tmp_path, build([s("k.s") + struct.pack("<I", 8) + s(b"\xff\xfe")]), match="UTF-8", name="u.gguf")
    err = _raises(tmp_path, build([kv_u32("k.a", 1), kv_u32("k.a", 2)]), match="twice", name="d.gguf")
    assert err.key == "k.a"
    _raises(tmp_path, build([kv_u32("general.alignment", 24)]), match="power of two", name="al.gguf")


def test_bad_tensor_infos(tmp_path):
    kv = [kv_str("general.architecture", "test")]
    data = b"\0" * 256
    err = _raises(tmp_path, build(kv, [tinfo("w", (32,), 77, 0)], data), match="unknown GGML tensor type id 77",
                  exc=UnsupportedQuantError, name="t1.gguf")
    assert err.tensor == "w"
    _raises(tmp_path, build(kv, [tinfo("w", (8,), 0, 8)], data), match="alignment", name="t2.gguf")
    _raises(tmp_path, build(kv, [tinfo("w", (8,), 0, 0), tinfo("w", (8,), 0, 32)], data), match="two tensors",
            name="t3.gguf")
    _raises(tmp_path, build(kv, [tinfo("w", (8, 1, 1, 1, 1), 0, 0)], data), match="5 dimensions", name="t4.gguf")
    _raises(tmp_path, build(kv, [tinfo("w", (33,), 8, 0)], data), match="whole number of Q8_0 blocks",
            name="t5.gguf")
    _raises(tmp_path, build(kv, [tinfo("w", (2**40, 2**20), 0, 0)], data), match="past the end", name="t6.gguf")
    _raises(tmp_path, build(kv, [tinfo("a", (32,), 0, 0), tinfo("b", (32,), 0, 64)], data), match="overlaps",
            name="t7.gguf")
    _raises(tmp_path, build(kv, [tinfo("w", (8,), 0, 2**63)], data), match="past the end", name="t8.gguf")


def test_unsupported_type_opens_but_does_not_decode(tmp_path):
    """A known type minecart cannot decode (IQ2_XXS) opens fine; dequantize names tensor, type and fix."""
    data = build([kv_str("general.architecture", "test")], [tinfo("w.weight", (256, 2), 16, 0)], b"\0" * 160)
    gf = GGUFFile(write(tmp_path, data))
    assert gf.tensor("w.weight").type_name == "IQ2_XXS" and gf.tensor("w.weight").n_bytes == 132
    with pytest.raises(UnsupportedQuantError, match=r"w\.weight.*IQ2_XXS.*llama-quantize"):
        gf.dequantize("w.weight")
