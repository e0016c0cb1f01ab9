"""Hostile model files: a vision projector found beside a model, a forged text model, a retyped
vocabulary. Each must fail in milliseconds with an error that names the key or tensor, never with a
ZeroDivisionError, TypeError, AttributeError or a 10 GB allocation.

Each case failed before its fix: head_count 0 divided by zero, a string where a number belongs raised
ValueError, a 4-entry image mean and a [64, 0] position table loaded, block_count 2**31 built a 2**31-layer
tensor table (10 GB in 60 s), dimensions [0, 2**64-1] reached numpy as a raw ValueError, integer merges
raised AttributeError and a float token list loaded as the strings "1.0".
"""

from __future__ import annotations

import time

import pytest
from minecart.engine.errors import GGUFError, MinecartError, TokenizerError
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.tokenizer import Tokenizer
from minecart.engine.vision.mmproj import VisionConfig, find_mmproj, load_vision

from tests.fuzz.gguf_forge import TYPE_IDS, Forged

U32, F32, STR, ARR = TYPE_IDS["UINT32"], TYPE_IDS["FLOAT32"], TYPE_IDS["STRING"], TYPE_IDS["ARRAY"]


@pytest.fixture(scope="module")
def mmproj(fixtures_dir):
    return fixtures_dir / "vision" / "mmproj-qwen35-tiny-vl-f16.gguf"


@pytest.fixture(scope="module")
def dense(fixtures_dir):
    return fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"


def _position_64_0(f: Forged) -> Forged:
    f.tensor("v.position_embd.weight").ne = [64, 0]
    return f


MMPROJ_CASES = [
    ("head_count 0", lambda f: f.set("clip.vision.attention.head_count", U32, 0),
     "clip.vision.attention.head_count"),
    ("head_count a string", lambda f: f.set("clip.vision.attention.head_count", STR, "x"),
     "clip.vision.attention.head_count"),
    ("patch_size a float", lambda f: f.set("clip.vision.patch_size", F32, 16.5), "clip.vision.patch_size"),
    ("mean of length 4", lambda f: f.set("clip.vision.image_mean", ARR, (F32, [0.5] * 4)),
     "clip.vision.image_mean"),
    ("std a string", lambda f: f.set("clip.vision.image_std", STR, "abc"), "clip.vision.image_std"),
    ("std of zeros", lambda f: f.set("clip.vision.image_std", ARR, (F32, [0.0] * 3)),
     "clip.vision.image_std"),
    ("epsilon a string", lambda f: f.set("clip.vision.attention.layer_norm_epsilon", STR, "e"),
     "layer_norm_epsilon"),
    ("position table [64, 0]", _position_64_0, "v.position_embd.weight"),
    ("block_count 2**31", lambda f: f.set("clip.vision.block_count", U32, 2**31), "clip.vision.block_count"),
    ("block_count beyond the tensors", lambda f: f.set("clip.vision.block_count", U32, 40),
     "clip.vision.block_count"),
]


@pytest.mark.parametrize("case, forge, key", MMPROJ_CASES, ids=[c[0] for c in MMPROJ_CASES])
def test_a_hostile_projector_is_a_clear_error_in_milliseconds(mmproj, tmp_path, case, forge, key):
    path = forge(Forged.from_file(mmproj)).write(tmp_path / "mmproj-model.gguf")
    t0 = time.perf_counter()
    with pytest.raises(GGUFError) as info:
        load_vision(path).close()
    assert time.perf_counter() - t0 < 2.0
    assert key in str(info.value), str(info.value)
    # beside a model it is skipped, not fatal
    assert find_mmproj(tmp_path / "model.gguf") is None


def test_the_real_projector_still_loads(mmproj, tmp_path):
    path = Forged.from_file(mmproj).write(tmp_path / "mmproj-model.gguf")
    with GGUFFile(path) as gf:
        cfg = VisionConfig.from_gguf(gf)
    assert cfg.n_heads >= 1 and len(cfg.image_mean) == 3
    assert find_mmproj(tmp_path / "model.gguf") == path


def test_a_zero_dimension_beside_a_huge_one_is_refused_by_the_parser(dense, tmp_path):
    f = Forged.from_file(dense)
    f.tensors[0].ne = [0, 2**64 - 1]
    with pytest.raises(GGUFError, match="2\\*\\*63") as info:
        GGUFFile(f.write(tmp_path / "huge.gguf"))
    assert info.value.tensor == f.tensors[0].name


def test_a_product_of_dimensions_past_int64_is_refused(dense, tmp_path):
    f = Forged.from_file(dense)
    f.tensors[0].ne = [2**32, 2**32]
    with pytest.raises(GGUFError, match="2\\*\\*63"):
        GGUFFile(f.write(tmp_path / "huge.gguf"))


@pytest.mark.parametrize("key, type_id, value", [
    ("tokenizer.ggml.merges", ARR, (U32, [1, 2, 3])),
    ("tokenizer.ggml.tokens", ARR, (F32, [1.0] * 8)),
    ("tokenizer.ggml.token_type", ARR, None),  # strings, one per token
    ("tokenizer.ggml.tokens", STR, "not an array"),
    ("tokenizer.ggml.eos_token_id", STR, "7"),
])
def test_a_retyped_vocabulary_is_a_tokenizer_error(dense, tmp_path, key, type_id, value):
    f = Forged.from_file(dense)
    if value is None:
        n = len(next(v for k, _, v in f.kv if k == "tokenizer.ggml.tokens")[1])
        value = (STR, ["1"] * n)
    f.set(key, type_id, value)
    with GGUFFile(f.write(tmp_path / "retyped.gguf")) as gf, pytest.raises(TokenizerError) as info:
        Tokenizer.from_gguf(gf)
    assert key in str(info.value)


def test_rope_dimension_count_beyond_the_head_is_refused(dense, tmp_path):
    from minecart.engine import load_model

    f = Forged.from_file(dense).set("qwen35.rope.dimension_count", U32, 4096)
    with pytest.raises(MinecartError, match="rope.dimension_count"):
        load_model(f.write(tmp_path / "rope.gguf"), devices=["cpu:0"])


def test_inspect_of_a_retyped_vocabulary_answers_without_a_traceback(dense, tmp_path, capsys):
    from minecart.engine.cli import main

    f = Forged.from_file(dense)
    n = len(next(v for k, _, v in f.kv if k == "tokenizer.ggml.tokens")[1])
    path = f.set("tokenizer.ggml.tokens", ARR, (F32, [1.0] * n)).write(tmp_path / "retyped.gguf")
    assert main(["inspect", str(path)]) in (0, 1)
    assert "Traceback" not in capsys.readouterr().err
