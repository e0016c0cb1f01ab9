"""The architecture spec (engine/models/spec.py): one description per model file from which config
validation, the loader's roles, the synthetic-file plan and the placement costs are all derived.

A toy architecture filled in here shows that a spec alone is enough for each of them; the Qwen3.5 spec
is checked against files `minecart synth` writes and the reader parses back."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from minecart.engine.config import ModelConfig, validate_tensors
from minecart.engine.errors import (
    MissingTensorError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
)
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.models import module_for, qwen35, spec_for
from minecart.engine.models.spec import (
    ATTN,
    EMBEDDING,
    MATMUL,
    VECTOR,
    ArchSpec,
    Group,
    LayerCosts,
    TensorDef,
)
from minecart.engine.synth import write_synthetic


def _toy_config(n_layers: int = 2, tied: bool = True) -> ModelConfig:
    return ModelConfig(architecture="toy", name="toy", n_layers=n_layers, hidden=8, vocab_size=16,
                       context_length=64, n_heads=2, n_kv_heads=1, head_dim=4, value_head_dim=4, rms_eps=1e-6,
                       rope_base=1e4, rope_dims=4, layer_types=(ATTN,) * n_layers, ffn=12,
                       tied_embeddings=tied)


TOY = ArchSpec(
    architectures=("toy",),
    read_config=lambda gf: _toy_config(),
    global_tensors=(TensorDef("token_embd.weight", lambda c: (c.vocab_size, c.hidden), EMBEDDING,
                              ("embedding_length",)),),
    layer_groups=(Group((
        TensorDef("attn_norm.weight", lambda c: (c.hidden,), VECTOR, ("embedding_length",), f32=True),
        TensorDef("attn_q.weight", lambda c: (c.n_heads * c.head_dim, c.hidden), MATMUL,
                  ("embedding_length", "attention.head_count")),
        TensorDef("ffn_up.weight", lambda c: (c.ffn, c.hidden), MATMUL, ("feed_forward_length",)),
    )),),
    head_tensors=(TensorDef("output_norm.weight", lambda c: (c.hidden,), VECTOR, ("embedding_length",)),
                  TensorDef("output.weight", lambda c: (c.vocab_size, c.hidden), MATMUL, ("embedding_length",))),
    layer_costs=lambda c, kind: LayerCosts(kv_values_per_token=c.n_kv_heads * 8),
)


def _toy_file(config: ModelConfig, drop: tuple[str, ...] = (), reshape: dict[str, tuple[int, ...]] | None = None
              ) -> Any:
    shapes = {name: t.shape(config) for name, t in TOY.plan(config)}
    shapes.update(reshape or {})
    tensors = {n: SimpleNamespace(shape=s) for n, s in shapes.items() if n not in drop}
    meta = {"toy.embedding_length": 8, "toy.attention.head_count": 2, "toy.feed_forward_length": 12}
    return SimpleNamespace(path=Path("toy.gguf"), tensors=tensors, architecture="toy",
                           get=lambda k, d=None: meta.get(k, d), require=lambda k: meta[k])


def test_a_toy_spec_gives_plan_roles_and_validation():
    c = _toy_config()
    names = [n for n, _ in TOY.plan(c)]
    assert names == ["token_embd.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight",
                     "blk.1.attn_norm.weight", "blk.1.attn_q.weight", "blk.1.ffn_up.weight", "output_norm.weight"]
    roles = TOY.tensor_roles(c)
    assert roles["layer.1"] == {"blk.1.attn_norm.weight": VECTOR, "blk.1.attn_q.weight": MATMUL,
                                "blk.1.ffn_up.weight": MATMUL}
    assert roles["head"] == {"output_norm.weight": VECTOR, "token_embd.weight": EMBEDDING}  # tied
    untied = _toy_config(tied=False)
    assert "output.weight" in dict(TOY.plan(untied))
    assert TOY.tensor_roles(c, available={*names, "output.weight"})["head"]["output.weight"] == MATMUL
    TOY.validate_tensors(c, _toy_file(c))
    with pytest.raises(MissingTensorError, match=r"required by toy layer 1 \(full attention\)") as err:
        TOY.validate_tensors(c, _toy_file(c, drop=("blk.1.ffn_up.weight",)))
    assert err.value.tensor == "blk.1.ffn_up.weight"
    with pytest.raises(ShapeMismatchError, match=r"blk\.0\.attn_q\.weight has shape \(4, 8\), the metadata "
                       r"\(toy\.embedding_length=8, toy\.attention\.head_count=2\) implies \(8, 8\)"):
        TOY.validate_tensors(c, _toy_file(c, reshape={"blk.0.attn_q.weight": (4, 8)}))
    with pytest.raises(ShapeMismatchError, match=r"output\.weight has shape \(3, 8\)"):  # optional, checked
        TOY.validate_tensors(c, _toy_file(c, reshape={"output.weight": (3, 8)}))


def test_registry():
    assert module_for("qwen35moe") is module_for("qwen35") is qwen35
    assert spec_for("gemma3") is module_for("gemma3").SPEC
    with pytest.raises(UnsupportedArchitectureError, match="'llama' is not supported; minecart runs qwen35"):
        spec_for("llama", "x.gguf")


@pytest.mark.parametrize("name,layers,fuse", [("tiny-dense", None, False), ("tiny-moe", None, False),
                                              ("tiny-moe", 3, True), ("small-dense", None, False),
                                              ("qwen3.5-0.8b", 1, False)])
def test_shape_config_roles_and_plan_match_the_written_file(tmp_path, name, layers, fuse):
    """What a named shape says of itself (config, plan, roles) is what its file reads back as."""
    shape = dataclasses.replace(qwen35.SHAPES[name], vocab_size=512).truncated(layers)
    p = tmp_path / "m.gguf"
    write_synthetic(p, shape, "q4_0", seed=1, fuse_gate_up=fuse)
    gf = GGUFFile(p)
    read = ModelConfig.from_gguf(gf)
    want = shape.config(read.name)
    assert dataclasses.replace(read, rms_eps=want.rms_eps) == want
    assert read.rms_eps == pytest.approx(want.rms_eps)  # written as float32
    validate_tensors(read, gf)
    options = frozenset({qwen35.FUSED_GATE_UP}) if fuse else frozenset()
    assert [n for n, _ in qwen35.SPEC.plan(want, options)] == list(gf.tensors)  # converter order
    from_file = qwen35.tensor_roles(read, available=set(gf.tensors))
    mtp = f"blk.{read.n_layers}."
    assert {n for part in from_file.values() for n in part} == {n for n in gf.tensors if not n.startswith(mtp)}
    if not fuse:  # without the file, the config alone implies the same roles
        assert qwen35.tensor_roles(read) == from_file
