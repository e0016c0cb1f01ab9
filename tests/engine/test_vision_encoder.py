"""The vision tower (engine/vision/mmproj.py + encoder.py) and its Backend ops: every encoder stage against
transformers' references on the fixture tower (F16 and F32 mmproj), the NumPy ops against direct
formulas, and clear errors for projectors that are unknown or do not fit the text model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
from minecart.engine.backends.numpy_backend import NumpyBackend
from minecart.engine.errors import GGUFError
from minecart.engine.vision import encoder
from minecart.engine.vision.mmproj import (
    MmprojMismatchError,
    find_mmproj,
    load_vision,
    mmproj_candidates,
)
from minecart.engine.vision.preprocess import position_interpolation, preprocess_image

IMAGES = ["gradient_224x224", "photo_320x180", "native_352x192", "tiny_40x30", "rgba_336x272",
          "palette_80x100"]


@dataclass(frozen=True)
class _TextConfig:
    architecture: str = "qwen35"
    hidden: int = 32


@pytest.fixture(scope="module")
def vision_dir(fixtures_dir):
    d = fixtures_dir / "vision"
    if not d.is_dir():
        pytest.skip("vision fixtures not found")
    return d


@pytest.fixture(scope="module", params=["f16", "f32"])
def tower(request, vision_dir):
    t = load_vision(vision_dir / f"mmproj-qwen35-tiny-vl-{request.param}.gguf", _TextConfig())
    yield t
    t.close()


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", IMAGES)
def test_every_stage_matches_transformers(tower, vision_dir, name):
    ref = np.load(vision_dir / "ref_hf" / f"image_{name}.npz")
    pre = preprocess_image(vision_dir / "images" / f"{name}.png", tower.config, max_tokens=None)
    idx, wts = position_interpolation(pre.patch_rowcol, pre.grid_hw)
    seen = {}
    out = encoder.encode(tower.config, tower.backend, tower.weights, pre.pixel_values,
                         pre.patch_rowcol.T, idx, wts, hook=lambda n, a: seen.__setitem__(n, np.array(a)))
    assert _rel(seen["patch_embed"], ref["patch_embed"]) < 1e-4
    assert _rel(seen["pos_embed"], ref["pos_embed"]) < 1e-4
    for i in range(tower.config.n_layers):
        assert _rel(seen[f"block.{i}"], ref["block_out"][i]) < 1e-4, i
    assert out.shape == ref["image_embeds"].shape
    assert _rel(out, ref["image_embeds"]) < 1e-4
    # a wrong patch order must be visible (the test can fail)
    shuffled = encoder.encode(tower.config, tower.backend, tower.weights, pre.pixel_values[::-1].copy(),
                              pre.patch_rowcol.T, idx, wts)
    assert _rel(shuffled, ref["image_embeds"]) > 1e-2


def test_tower_encode_caches_by_content(tower, vision_dir):
    path = vision_dir / "images" / "native_352x192.png"
    pre, first = tower.encode(path)
    _, again = tower.encode(path.read_bytes())
    assert again is first and pre.n_tokens == first.shape[0] == 66
    assert first.shape[1] == tower.config.projection_dim


def test_config_from_metadata(tower):
    c = tower.config
    assert (c.n_layers, c.hidden, c.ffn, c.n_heads, c.head_dim, c.projection_dim) == (3, 64, 160, 2, 32, 32)
    assert (c.patch_size, c.merge_size, c.position_side, c.eps) == (16, 2, 48, pytest.approx(1e-6))
    assert c.image_mean == (0.5, 0.5, 0.5) and c.projector_type == "qwen3vl_merger"


# ---- backend ops ------------------------------------------------------------------------------------


def test_layer_norm_and_gelu():
    be = NumpyBackend()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 33)).astype(np.float32) * 3 + 1
    w = rng.normal(size=33).astype(np.float32)
    b = rng.normal(size=33).astype(np.float32)
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6) * w + b
    np.testing.assert_allclose(be.layer_norm(x, w, b, 1e-6), ref, rtol=1e-5, atol=1e-5)
    z = np.linspace(-6, 6, 101).astype(np.float32)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in z.astype(np.float64)])
    np.testing.assert_allclose(be.gelu(z, exact=True), exact, rtol=1e-6, atol=1e-7)
    tanh = be.gelu(z)
    assert np.abs(tanh - exact).max() < 1e-3 and np.abs(tanh - exact).max() > 1e-6  # two distinct GELUs


def test_vision_rope_formula():
    be = NumpyBackend()
    rng = np.random.default_rng(2)
    T, nh, d = 9, 3, 24
    x = rng.normal(size=(T, nh, d)).astype(np.float32)
    pos = np.stack([rng.integers(0, 20, T), rng.integers(0, 30, T)])
    y = be.vision_rope(x, pos, 10000.0)
    q4, half = d // 4, d // 2
    for t in range(T):
        for j in range(half):
            comp = pos[0, t] if j < q4 else pos[1, t]
            ang = comp * 10000.0 ** (-4.0 * (j % q4) / d)
            c, s = math.cos(ang), math.sin(ang)
            a, b = x[t, :, j].astype(np.float64), x[t, :, j + half].astype(np.float64)
            np.testing.assert_allclose(y[t, :, j], a * c - b * s, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(y[t, :, j + half], a * s + b * c, rtol=1e-5, atol=1e-6)
    zero = be.vision_rope(x, np.zeros((2, T), np.int64), 10000.0)
    np.testing.assert_array_equal(zero, x)


def test_attention_full_is_bidirectional_softmax():
    be = NumpyBackend()
    rng = np.random.default_rng(3)
    T, nh, d = 300, 2, 8  # more than one query block
    q, k, v = (rng.normal(size=(T, nh, d)).astype(np.float32) for _ in range(3))
    out = be.attention_full(q, k, v, scale=0.3)
    for h in range(nh):
        s = q[:, h].astype(np.float64) @ k[:, h].T.astype(np.float64) * 0.3
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        np.testing.assert_allclose(out[:, h], p @ v[:, h], rtol=1e-5, atol=1e-6)


# ---- loading errors and discovery --------------------------------------------------------------------


def _write_clip(path: Path, projector: str) -> Path:
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", projector)
    w.add_bool("clip.has_vision_encoder", True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_mismatches_are_clear(vision_dir, tmp_path):
    mm = vision_dir / "mmproj-qwen35-tiny-vl-f16.gguf"
    with pytest.raises(MmprojMismatchError, match="hidden size is 64"):
        load_vision(mm, _TextConfig(hidden=64))
    with pytest.raises(MmprojMismatchError, match="architecture"):
        load_vision(mm, _TextConfig(architecture="gemma3"))
    with pytest.raises(MmprojMismatchError, match="not 'clip'"):
        load_vision(vision_dir / "qwen35-tiny-vl-f16.gguf")
    with pytest.raises(MmprojMismatchError, match="projector type 'ldp'"):
        load_vision(_write_clip(tmp_path / "mmproj-other.gguf", "ldp"))
    broken = tmp_path / "mmproj-broken.gguf"
    broken.write_bytes(mm.read_bytes()[:5000])
    with pytest.raises(GGUFError):
        load_vision(broken)


def test_find_mmproj_beside_the_model(vision_dir, tmp_path):
    model = tmp_path / "qwen35-tiny-vl-f16.gguf"
    model.symlink_to(vision_dir / "qwen35-tiny-vl-f16.gguf")
    assert find_mmproj(model, _TextConfig()) is None
    _write_clip(tmp_path / "mmproj-aaa-other.gguf", "ldp")  # unknown projector: skipped
    for kind in ("f32", "f16"):
        (tmp_path / f"mmproj-qwen35-tiny-vl-{kind}.gguf").symlink_to(
            vision_dir / f"mmproj-qwen35-tiny-vl-{kind}.gguf")
    assert mmproj_candidates(model)[0].name == "mmproj-qwen35-tiny-vl-f16.gguf"
    assert find_mmproj(model, _TextConfig()).name == "mmproj-qwen35-tiny-vl-f16.gguf"
    assert find_mmproj(model, _TextConfig(hidden=48)) is None  # none fits another model size
