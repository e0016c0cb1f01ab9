"""ModelConfig from GGUF metadata, and validate_tensors: every needed tensor present with the shape the
metadata implies (qwen35, qwen35moe with split or fused experts and 1-D/2-D shared gate, gemma3)."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
from minecart.engine.config import ATTN, GDN, ModelConfig, validate_tensors
from minecart.engine.errors import (
    GGUFError,
    MissingKeyError,
    MissingTensorError,
    ShapeMismatchError,
)
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.synth import SHAPES, write_synthetic


class FakeFile:
    """A GGUFFile stand-in whose tensor shapes and metadata a test can edit."""

    def __init__(self, gf: GGUFFile, drop=(), reshape=None, meta=None):
        self.path = gf.path
        self.metadata = {**gf.metadata, **(meta or {})}
        self.tensors = {n: SimpleNamespace(name=n, shape=t.shape) for n, t in gf.tensors.items() if n not in drop}
        for name, shape in (reshape or {}).items():
            self.tensors[name] = SimpleNamespace(name=name, shape=tuple(shape))

    @property
    def architecture(self):
        return self.metadata["general.architecture"]

    def get(self, key, default=None):
        return self.metadata.get(key, default)

    def require(self, key):
        return GGUFFile.require(self, key)


@pytest.fixture(scope="module")
def synth_files(tmp_path_factory):
    """Small-vocabulary synthetic models (fast to write and open)."""
    d = tmp_path_factory.mktemp("cfg")
    out = {}
    for key, shape, kw in (("dense", "tiny-dense", {}), ("moe", "tiny-moe", {}),
                           ("moe_fused", "tiny-moe", {"fuse_gate_up": True})):
        s = dataclasses.replace(SHAPES[shape], vocab_size=512)
        p = d / f"{key}.gguf"
        write_synthetic(p, s, "q8_0", seed=3, **kw)
        out[key] = GGUFFile(p)
    return out


@pytest.mark.parametrize("rel", ["dense/qwen35-tiny-dense-f16.gguf", "dense/qwen35-tiny-dense-q8_0.gguf"])
def test_fixture_config(fixtures_dir, rel):
    gf = GGUFFile(fixtures_dir / rel)
    c = ModelConfig.from_gguf(gf)
    assert (c.architecture, c.n_layers, c.n_mtp_layers, c.hidden, c.vocab_size) == ("qwen35", 8, 1, 32, 248320)
    assert c.layer_types == (GDN, GDN, GDN, ATTN, GDN, GDN, GDN, ATTN)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dims, c.rope_sections) == (4, 2, 64, 16, (3, 3, 2, 0))
    assert (c.gdn_k_heads, c.gdn_v_heads, c.gdn_key_dim, c.gdn_value_dim, c.gdn_conv_dim) == (2, 4, 16, 16, 128)
    assert c.ffn == 96 and c.tied_embeddings and not c.is_moe
    validate_tensors(c, gf)


def test_vision_language_fixture_validates(fixtures_dir):
    gf = GGUFFile(fixtures_dir / "vision/qwen35-tiny-vl-f16.gguf")
    validate_tensors(ModelConfig.from_gguf(gf), gf)


def test_synthetic_models_validate(synth_files):
    for key, gf in synth_files.items():
        c = ModelConfig.from_gguf(gf)
        validate_tensors(c, gf)
        if key.startswith("moe"):
            assert c.is_moe and (c.n_experts, c.n_experts_used, c.expert_ffn, c.shared_expert_ffn) == (8, 2, 32, 32)
            assert not c.tied_embeddings
    assert "blk.0.ffn_gate_up_exps.weight" in synth_files["moe_fused"].tensors
    assert "blk.0.ffn_gate_exps.weight" not in synth_files["moe_fused"].tensors


def _check(gf, **kw):
    fake = FakeFile(gf, **kw)
    validate_tensors(ModelConfig.from_gguf(fake), fake)


def test_missing_tensor_is_named(synth_files):
    gf = synth_files["dense"]
    for name in ("blk.3.attn_q.weight", "blk.0.ssm_a", "blk.6.ffn_down.weight", "output_norm.weight",
                 "token_embd.weight", "blk.7.attn_k_norm.weight"):
        with pytest.raises(MissingTensorError) as err:
            _check(gf, drop=[name])
        assert err.value.tensor == name and name in str(err.value) and "re-convert" in str(err.value)
    _check(gf, drop=["blk.8.attn_q.weight", "blk.8.nextn.eh_proj.weight"])  # MTP tensors are optional


def test_shape_mismatch_message_names_keys(synth_files):
    gf = synth_files["dense"]
    with pytest.raises(ShapeMismatchError) as err:
        _check(gf, reshape={"blk.3.attn_q.weight": (256, 32)})
    msg = str(err.value)
    assert re.search(r"blk\.3\.attn_q\.weight has shape \(256, 32\), the metadata \(.*"
                     r"qwen35\.attention\.head_count=4.*\) implies \(512, 32\)", msg), msg
    # same tensors, metadata that disagrees with them
    with pytest.raises(ShapeMismatchError, match=r"ssm_conv1d.*ssm\.conv_kernel=3.*implies \(128, 3\)"):
        _check(gf, meta={"qwen35.ssm.conv_kernel": 3})
    with pytest.raises(ShapeMismatchError, match=r"ffn_gate\.weight has shape \(96, 32\).*feed_forward_length=64"):
        _check(gf, meta={"qwen35.feed_forward_length": 64})
    with pytest.raises(ShapeMismatchError, match=r"blk\.8\.nextn\.eh_proj\.weight"):  # present MTP tensors are checked
        _check(gf, reshape={"blk.8.nextn.eh_proj.weight": (32, 32)})


def test_inconsistent_head_metadata(synth_files):
    with pytest.raises(GGUFError, match="KV heads"):
        _check(synth_files["dense"], meta={"qwen35.attention.head_count_kv": 3})
    with pytest.raises(GGUFError, match="whole heads"):
        _check(synth_files["dense"], meta={"qwen35.ssm.inner_size": 66})


def test_moe_layouts(synth_files):
    moe, fused = synth_files["moe"], synth_files["moe_fused"]
    # the shared-expert gate may be 2-D (converter) or 1-D (llama.cpp C++ tools)
    _check(moe, reshape={f"blk.{i}.ffn_gate_inp_shexp.weight": (32,) for i in range(8)})
    with pytest.raises(ShapeMismatchError, match="ffn_gate_inp_shexp"):
        _check(moe, reshape={"blk.2.ffn_gate_inp_shexp.weight": (2, 32)})
    with pytest.raises(MissingTensorError, match="ffn_up_exps"):
        _check(moe, drop=["blk.1.ffn_up_exps.weight"])
    with pytest.raises(MissingTensorError, match="ffn_gate_exps.*or blk.1.ffn_gate_up_exps"):
        _check(moe, drop=["blk.1.ffn_gate_exps.weight"])
    with pytest.raises(ShapeMismatchError, match=r"ffn_gate_up_exps\.weight has shape \(8, 32, 32\).*\(8, 64, 32\)"):
        _check(fused, reshape={"blk.0.ffn_gate_up_exps.weight": (8, 32, 32)})
    with pytest.raises(ShapeMismatchError, match=r"ffn_gate_inp\.weight has shape \(8, 32\).*expert_count=4"):
        _check(moe, meta={"qwen35moe.expert_count": 4})
    with pytest.raises(MissingKeyError, match="expert_shared_feed_forward_length"):
        fake = FakeFile(moe)
        del fake.metadata["qwen35moe.expert_shared_feed_forward_length"]
        validate_tensors(ModelConfig.from_gguf(fake), fake)
    with pytest.raises(ShapeMismatchError, match=r"output\.weight has shape \(100, 32\)"):
        _check(moe, reshape={"output.weight": (100, 32)})


def test_tokenizer_larger_than_embedding(synth_files):
    gf = synth_files["dense"]
    with pytest.raises(ShapeMismatchError, match="tokenizer has 600 tokens"):
        _check(gf, meta={"tokenizer.ggml.tokens": ["a"] * 600})


def test_gemma3_demo_model():
    try:
        from minecart.engine.demo import demo_model_path

        path = demo_model_path()
    except Exception as exc:  # the demo package is an optional extra
        pytest.skip(f"demo model unavailable: {exc}")
    gf = GGUFFile(path)
    c = ModelConfig.from_gguf(gf)
    assert (c.architecture, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim) == ("gemma3", 18, 640, 4, 1, 256)
    validate_tensors(c, gf)
    with pytest.raises(MissingTensorError, match="blk.4.post_ffw_norm.weight"):
        _check(gf, drop=["blk.4.post_ffw_norm.weight"])
    with pytest.raises(ShapeMismatchError, match=r"blk\.0\.attn_k\.weight has shape \(512, 640\).*head_count_kv=1"):
        _check(gf, reshape={"blk.0.attn_k.weight": (512, 640)})
