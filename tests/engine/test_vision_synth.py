"""Synthetic mmproj files (engine/vision/synth_mmproj.py, `minecart synth --tower`): the layout llama.cpp's
converter writes (same tensors, shapes and metadata as the fixture tower), loadable and runnable."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine.errors import RequestError
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.vision.mmproj import VisionConfig, load_vision, tensor_shapes
from minecart.engine.vision.synth_mmproj import TOWERS, plan_mmproj, write_synthetic_mmproj


def test_tiny_tower_has_the_fixture_layout(fixtures_dir, tmp_path):
    ref_path = fixtures_dir / "vision" / "mmproj-qwen35-tiny-vl-f16.gguf"
    if not ref_path.is_file():
        pytest.skip("vision fixtures not found")
    out = write_synthetic_mmproj(tmp_path / "mmproj-tiny.gguf", "tiny-dense", "f16", seed=3)
    with GGUFFile(ref_path) as ref, GGUFFile(out["path"]) as syn:
        assert {n: (t.shape, t.type_name) for n, t in syn.tensors.items()} == {
            n: (t.shape, t.type_name) for n, t in ref.tensors.items()}
        assert VisionConfig.from_gguf(syn) == VisionConfig.from_gguf(ref)
    tower = load_vision(out["path"])
    pre, emb = tower.encode(fixtures_dir / "vision" / "images" / "tiny_40x30.png")
    assert emb.shape == (70, 32) and np.isfinite(emb).all() and 0.1 < emb.std() < 10
    tower.close()


@pytest.mark.parametrize("quant", ["q8_0", "f32"])
def test_other_types_load_and_run(tmp_path, quant):
    out = write_synthetic_mmproj(tmp_path / f"mmproj-{quant}.gguf", "tiny-dense", quant)
    tower = load_vision(out["path"])
    rng = np.random.default_rng(0)
    from PIL import Image

    pic = Image.fromarray(rng.integers(0, 255, (100, 140, 3), dtype=np.uint8))
    pre, emb = tower.encode(pic)
    assert emb.shape == (pre.n_tokens, 32) and np.isfinite(emb).all()
    tower.close()


def test_big_tower_plans_match_the_loader():
    for name in ("qwen3.5-27b", "qwen3.5-0.8b"):
        t = TOWERS[name]
        plan = {p.name: p.shape for p in plan_mmproj(t, 1)}
        cfg = VisionConfig("qwen3vl_merger", t.depth, t.hidden, t.ffn, t.n_heads, t.out_hidden, 16, 2,
                           1e-6, (0.5,) * 3, (0.5,) * 3, 2304)
        assert plan == tensor_shapes(cfg)
    nbytes = sum(p.n_bytes for p in plan_mmproj(TOWERS["qwen3.5-27b"], 1))
    assert 0.9e9 < nbytes < 0.95e9  # 27 blocks of d=1152 plus the 4608-wide merger, F16
    with pytest.raises(RequestError, match="unknown tower"):
        write_synthetic_mmproj("/nonexistent/x.gguf", "qwen9")
    with pytest.raises(RequestError, match="f32, f16"):
        write_synthetic_mmproj("/nonexistent/x.gguf", "tiny-dense", "q4_k")
