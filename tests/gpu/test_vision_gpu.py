"""The vision tower on the CuPy backend: the fixture tower's embeddings against transformers' references,
and a synthetic 27B-shaped tower (MLP 4304 wide: zero-padded to whole 32-value blocks on the GPU)
against the NumPy backend. Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine.vision.mmproj import load_vision
from minecart.engine.vision.preprocess import preprocess_image

IMAGES = ["gradient_224x224", "photo_320x180", "tiny_40x30", "palette_80x100"]


def _backend():
    from minecart.engine.backends.cupy_backend import CupyBackend

    return CupyBackend(device="cuda:0")


def test_fixture_tower_on_gpu(fixtures_dir):
    vision = fixtures_dir / "vision"
    if not vision.is_dir():
        pytest.skip("vision fixtures not found")
    for kind in ("f16", "f32"):
        tower = load_vision(vision / f"mmproj-qwen35-tiny-vl-{kind}.gguf", backend=_backend())
        assert tower.backend.name == "cupy"
        for name in IMAGES:
            ref = np.load(vision / "ref_hf" / f"image_{name}.npz")["image_embeds"]
            pre = preprocess_image(vision / "images" / f"{name}.png", tower.config, max_tokens=None)
            emb = tower.encode_pixels(pre)
            err = np.abs(emb - ref).max() / np.abs(ref).max()
            assert err < 2e-3, (kind, name, err)
        tower.close()


def test_27b_shaped_tower_matches_numpy(tmp_path):
    from minecart.engine.vision.synth_mmproj import write_synthetic_mmproj

    path = write_synthetic_mmproj(tmp_path / "mmproj-27b.gguf", "qwen3.5-27b", "f16")["path"]
    gpu = load_vision(path, backend=_backend())
    cpu = load_vision(path)
    rng = np.random.default_rng(0)
    from PIL import Image

    pre = gpu.preprocess(Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)))
    a, b = gpu.encode_pixels(pre), cpu.encode_pixels(pre)
    assert a.shape == (64, 5120) and np.isfinite(a).all()
    assert np.abs(a - b).max() / np.abs(b).max() < 5e-3
