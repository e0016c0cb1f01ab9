"""The tiny synthetic MoE model the CPU and GPU MoE tests share."""

from __future__ import annotations

from dataclasses import replace


def tiny_moe_file(tmp_path_factory, layout: str):
    """A tiny-moe GGUF (vocab 640, seed 11): layout "separate" (F16, gate and up experts apart) or
    "fused" (Q8_0, one gate_up expert tensor)."""
    from minecart.engine.synth import SHAPES, write_synthetic

    fused = layout == "fused"
    path = tmp_path_factory.mktemp("moe") / f"tiny-moe-{layout}.gguf"
    write_synthetic(path, replace(SHAPES["tiny-moe"], vocab_size=640), "q8_0" if fused else "f16", seed=11,
                    fuse_gate_up=fused)
    return path
