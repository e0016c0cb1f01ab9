"""Synthetic vision projectors: an mmproj GGUF with random weights and a named Qwen3.5/3.6 tower's shape.

For images/s benchmarks and loader tests without downloading a tower: `write_synthetic_mmproj(path,
"qwen3.5-27b", "f16")` streams a `clip` / `qwen3vl_merger` file with the metadata and tensor layout of
llama.cpp's converter (docs/qwen35-vision.md section 2), reusing engine/synth.py's writer.
Values follow the vision fixture's recipe (README "How it was produced"): patch embedding N(0, 1/1536),
position table N(0, 0.5^2), LayerNorm weights 1 + N(0, 0.2^2), biases N(0, 0.1^2), qkv 1/sqrt(d),
residual-writing projections 0.3/sqrt(fan_in), ffn_up 0.7/sqrt(d), merger 1/sqrt(4d). Matrices whose
rows do not split into blocks of the asked type fall back as engine/synth.py does (F16).

What this is not: a tower that sees anything. The outputs are noise of a sane size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import quants as Q
from ..errors import RequestError
from ..quant_mix import QUANTS, matrix_type
from ..synth import PlannedTensor, _tensor_chunks, encode_kv, write_gguf


@dataclass(frozen=True)
class TowerShape:
    """Hyper-parameters of a qwen3vl_merger tower (docs/qwen35-vision.md section 1)."""

    name: str
    depth: int
    hidden: int
    n_heads: int
    ffn: int
    out_hidden: int  # = the text model's hidden size
    patch_size: int = 16
    merge_size: int = 2
    n_positions: int = 2304


TOWERS: dict[str, TowerShape] = {
    t.name: t
    for t in (
        TowerShape("qwen3.5-0.8b", 12, 768, 12, 3072, 1024),
        TowerShape("qwen3.5-2b", 24, 1024, 16, 4096, 2048),  # assumed as the 4B (doc: unconfirmed)
        TowerShape("qwen3.5-4b", 24, 1024, 16, 4096, 2560),
        TowerShape("qwen3.5-9b", 27, 1152, 16, 4304, 4096),
        TowerShape("qwen3.5-27b", 27, 1152, 16, 4304, 5120),
        TowerShape("qwen3.6-35b-a3b", 27, 1152, 16, 4304, 2048),
        TowerShape("tiny-dense", 3, 64, 2, 160, 32),  # the vision fixture's tower
    )
}


def plan_mmproj(t: TowerShape, type_id: int) -> list[PlannedTensor]:
    """Every tensor of the tower, as llama.cpp's converter names and types them."""
    d, f, D = t.hidden, t.ffn, t.out_hidden
    m = d * t.merge_size ** 2
    small = Q.F32
    patch_type = Q.F32 if type_id == Q.F32 else Q.F16  # 16-wide rows: never block-quantized
    out = [
        PlannedTensor("v.patch_embd.weight", (d, 3, t.patch_size, t.patch_size), patch_type, "normal",
                      1.0 / np.sqrt(6 * t.patch_size ** 2)),
        PlannedTensor("v.patch_embd.weight.1", (d, 3, t.patch_size, t.patch_size), patch_type, "normal",
                      1.0 / np.sqrt(6 * t.patch_size ** 2)),
        PlannedTensor("v.patch_embd.bias", (d,), small, "normal", 0.1),
        PlannedTensor("v.position_embd.weight", (t.n_positions, d), small, "normal", 0.5),
    ]

    def mat(name, rows, n_in, std):
        out.append(PlannedTensor(name + ".weight", (rows, n_in), matrix_type(type_id, n_in), "linear", std))
        out.append(PlannedTensor(name + ".bias", (rows,), small, "normal", 0.1))

    for i in range(t.depth):
        b = f"v.blk.{i}."
        for ln in ("ln1", "ln2"):
            out.append(PlannedTensor(b + ln + ".weight", (d,), small, "norm"))
            out.append(PlannedTensor(b + ln + ".bias", (d,), small, "normal", 0.1))
        mat(b + "attn_qkv", 3 * d, d, 1.0 / np.sqrt(d))
        mat(b + "attn_out", d, d, 0.3 / np.sqrt(d))
        mat(b + "ffn_up", f, d, 0.7 / np.sqrt(d))
        mat(b + "ffn_down", d, f, 0.3 / np.sqrt(f))
    out.append(PlannedTensor("v.post_ln.weight", (d,), small, "norm"))
    out.append(PlannedTensor("v.post_ln.bias", (d,), small, "normal", 0.1))
    mat("mm.0", m, m, 1.0 / np.sqrt(m))
    mat("mm.2", D, m, 1.0 / np.sqrt(m))
    return out


def mmproj_kvs(t: TowerShape, type_id: int) -> list[bytes]:
    file_type = {Q.F32: 0, Q.F16: 1, Q.Q8_0: 7, Q.BF16: 32}.get(type_id, 1)
    side = int(round(t.n_positions ** 0.5))
    return [
        encode_kv("general.architecture", "STRING", "clip"),
        encode_kv("general.type", "STRING", "mmproj"),
        encode_kv("general.name", "STRING", f"synthetic {t.name} vision tower"),
        encode_kv("general.file_type", "UINT32", file_type),
        encode_kv("general.quantization_version", "UINT32", 2),
        encode_kv("clip.projector_type", "STRING", "qwen3vl_merger"),
        encode_kv("clip.has_vision_encoder", "BOOL", True),
        encode_kv("clip.use_gelu", "BOOL", True),
        encode_kv("clip.vision.projection_dim", "UINT32", t.out_hidden),
        encode_kv("clip.vision.image_size", "UINT32", side * t.patch_size),
        encode_kv("clip.vision.patch_size", "UINT32", t.patch_size),
        encode_kv("clip.vision.embedding_length", "UINT32", t.hidden),
        encode_kv("clip.vision.feed_forward_length", "UINT32", t.ffn),
        encode_kv("clip.vision.block_count", "UINT32", t.depth),
        encode_kv("clip.vision.attention.head_count", "UINT32", t.n_heads),
        encode_kv("clip.vision.attention.layer_norm_epsilon", "FLOAT32", 1e-6),
        encode_kv("clip.vision.image_mean", "ARRAY", [0.5, 0.5, 0.5], "FLOAT32"),
        encode_kv("clip.vision.image_std", "ARRAY", [0.5, 0.5, 0.5], "FLOAT32"),
        encode_kv("clip.vision.spatial_merge_size", "UINT32", t.merge_size),
        encode_kv("clip.vision.is_deepstack_layers", "ARRAY", [False] * t.depth, "BOOL"),
    ]


def write_synthetic_mmproj(path: str | Path, tower: str | TowerShape, quant: str = "f16", seed: int = 0,
                           progress: Callable[[int, int], None] | None = None) -> dict:
    """Write a synthetic mmproj; returns {"path", "bytes", "seconds", "mb_per_s", "tensors"}."""
    if isinstance(tower, str):
        if tower not in TOWERS:
            raise RequestError(f"unknown tower '{tower}'; choose one of {', '.join(TOWERS)}")
        tower = TOWERS[tower]
    if quant.lower() not in ("f32", "f16", "bf16", "q8_0"):
        raise RequestError(f"an mmproj is written as f32, f16, bf16 or q8_0 (got '{quant}')")
    type_id = QUANTS[quant.lower()]
    t0 = time.perf_counter()
    rng = np.random.Generator(np.random.SFC64(seed))
    tensors = plan_mmproj(tower, type_id)
    size = write_gguf(path, mmproj_kvs(tower, type_id), tensors, lambda t: _tensor_chunks(rng, t),
                      progress=progress)
    seconds = time.perf_counter() - t0
    return {"path": str(path), "bytes": size, "seconds": seconds,
            "mb_per_s": size / 1e6 / max(seconds, 1e-9), "tensors": len(tensors)}
