"""Synthetic models: the fixture's exact tensor inventory and metadata, real sizes for the named models,
sane values for every quant type, a readable tokenizer, determinism, and the `minecart synth` command."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from minecart.engine import quants as Q
from minecart.engine.config import ModelConfig, validate_tensors
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.quant_mix import QUANTS
from minecart.engine.synth import SHAPES, SPECIAL_TOKENS, plan_tensors, write_synthetic


def small(name: str, vocab: int = 512):
    return dataclasses.replace(SHAPES[name], vocab_size=vocab)


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    p = tmp_path_factory.mktemp("synth") / "tiny-dense-q8_0.gguf"
    info = write_synthetic(p, "tiny-dense", "q8_0", seed=0)
    return GGUFFile(p), info


def test_tiny_dense_matches_fixture_inventory(tiny_q8, fixtures_dir):
    gf, info = tiny_q8
    ref = GGUFFile(fixtures_dir / "dense/qwen35-tiny-dense-q8_0.gguf")
    assert set(gf.tensors) == set(ref.tensors)
    for name, t in ref.tensors.items():
        mine = gf.tensors[name]
        assert mine.shape == t.shape, name
        assert mine.type_name == t.type_name, name  # Q8_0 matrices, F32 small tensors, as the converter
    c, rc = ModelConfig.from_gguf(gf), ModelConfig.from_gguf(ref)
    assert dataclasses.replace(c, name=rc.name) == rc
    for key, value in ref.metadata.items():
        if key.startswith("qwen35.") or key in ("general.architecture", "general.file_type",
                                                "tokenizer.ggml.model", "tokenizer.ggml.pre",
                                                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"):
            assert gf.metadata[key] == value, key
    validate_tensors(c, gf)
    assert info["bytes"] == gf.file_size and info["tensors"] == 123 and info["mb_per_s"] > 0


def test_tokenizer_metadata(tiny_q8, fixtures_dir):
    gf, _ = tiny_q8
    toks, types = gf.get("tokenizer.ggml.tokens"), gf.get("tokenizer.ggml.token_type")
    assert len(toks) == len(types) == 248320
    ref = GGUFFile(fixtures_dir / "qwen35-vocab.gguf")
    rtoks, rtypes = ref.get("tokenizer.ggml.tokens"), ref.get("tokenizer.ggml.token_type")
    assert toks[:256] == rtoks[:256]  # GPT-2 byte-level tokens in the same id order
    for i, text in SPECIAL_TOKENS.items():
        assert toks[i] == rtoks[i] == text and types[i] == rtypes[i], i
    assert toks[300] == "<|synth_300|>" and types[300] == 5 and toks[248319] == "<|synth_248319|>"
    assert len(set(toks)) == len(toks)
    assert gf.get("tokenizer.ggml.merges") == []
    assert "<|im_start|>" in gf.get("tokenizer.chat_template")
    assert gf.get("tokenizer.ggml.add_bos_token") is False


def test_values_are_sane(tiny_q8):
    gf, _ = tiny_q8
    for name in gf.tensors:
        x = gf.dequantize(name)
        assert np.isfinite(x).all(), name
    qkv = gf.dequantize("blk.0.attn_qkv.weight")
    assert abs(qkv.std() - 0.7 / np.sqrt(32)) < 0.1 * 0.7 / np.sqrt(32) and abs(qkv.mean()) < 0.01
    out = gf.dequantize("blk.0.ssm_out.weight")
    assert abs(out.std() - 0.3 / np.sqrt(64)) < 0.1 * 0.3 / np.sqrt(64)
    assert (gf.dequantize("blk.0.ssm_a") < 0).all()
    assert 0.8 < gf.dequantize("blk.1.attn_norm.weight").mean() < 1.2
    emb = gf.dequantize_rows("token_embd.weight", [0, 1000, 248319])
    assert 0.3 < emb.std() < 0.7
    # neighbouring blocks carry different scales (kernels that mix up blocks must fail their tests)
    raw = gf.tensor("blk.0.ffn_up.weight").raw.reshape(-1, 34)
    assert len(np.unique(raw[:, :2].view("<f2"))) > 10


@pytest.mark.parametrize("quant", sorted(QUANTS))
def test_every_quant_type(tmp_path, quant):
    s = small("small-dense")  # rows of 256/512: K-quants apply without fallback
    p = tmp_path / f"s-{quant}.gguf"
    write_synthetic(p, s, quant, seed=1, n_layers=4)
    gf = GGUFFile(p)
    validate_tensors(ModelConfig.from_gguf(gf), gf)
    want = Q.type_name(QUANTS[quant])
    w = gf.tensor("blk.3.attn_q.weight")
    assert w.type_name == want and gf.tensor("blk.0.ssm_conv1d.weight").type_name == "F32"
    x = gf.dequantize("blk.3.attn_q.weight")
    target = 0.7 / np.sqrt(256)
    assert np.isfinite(x).all() and abs(x.std() - target) < 0.15 * target, (quant, x.std())
    # Q4_0/Q5_0 grids are asymmetric (q - 8 on [-8, 7]): a mean of -d/2, about -0.11 std for Q4_0
    assert abs(x.mean()) < 0.15 * target, (quant, x.mean())


def test_k_quant_fallback_on_narrow_rows(tmp_path):
    p = tmp_path / "t.gguf"
    write_synthetic(p, small("tiny-moe"), "q4_k", seed=2)
    gf = GGUFFile(p)
    assert gf.tensor("blk.0.attn_qkv.weight").type_name == "Q5_0"  # 32-wide rows: llama-quantize's fallback
    assert gf.tensor("blk.3.attn_output.weight").type_name == "Q4_K"  # 256-wide rows
    assert gf.tensor("blk.0.ffn_gate_inp.weight").type_name == "F32"
    assert gf.tensor("blk.0.ffn_gate_exps.weight").shape == (8, 32, 32)
    assert gf.tensor("blk.0.ffn_gate_inp_shexp.weight").shape == (1, 32)
    validate_tensors(ModelConfig.from_gguf(gf), gf)


def test_deterministic_and_seeded(tmp_path):
    def digest(seed, name):
        p = tmp_path / name
        write_synthetic(p, small("tiny-dense"), "q4_0", seed=seed, n_layers=2)
        return hashlib.sha256(p.read_bytes()).hexdigest()

    assert digest(5, "a.gguf") == digest(5, "b.gguf")
    assert digest(5, "a.gguf") != digest(6, "c.gguf")


def test_layers_and_mtp_options(tmp_path):
    p = tmp_path / "l.gguf"
    write_synthetic(p, small("tiny-dense"), "f16", n_layers=2)
    gf = GGUFFile(p)
    c = ModelConfig.from_gguf(gf)
    assert c.n_layers == 2 and c.n_mtp_layers == 1 and gf.get("qwen35.block_count") == 3
    assert "blk.2.nextn.eh_proj.weight" in gf.tensors and "blk.3.attn_norm.weight" not in gf.tensors
    validate_tensors(c, gf)
    write_synthetic(p, small("tiny-dense"), "f16", n_layers=4, mtp=False)
    gf = GGUFFile(p)
    c = ModelConfig.from_gguf(gf)
    assert c.n_layers == 4 and c.n_mtp_layers == 0 and gf.get("qwen35.nextn_predict_layers") is None
    assert c.layer_types[3] == "attention"


def test_gguf_py_reads_our_files(tmp_path):
    """gguf-py's reader (an independent parser) agrees with ours on a synthetic file."""
    import gguf

    p = tmp_path / "g.gguf"
    write_synthetic(p, small("tiny-moe", 300), "q6_k", seed=4)
    r = gguf.GGUFReader(str(p))
    gf = GGUFFile(p)
    assert {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")} == gf.metadata
    for t in r.tensors:
        mine = gf.tensors[t.name]
        assert mine.shape == tuple(int(v) for v in reversed(t.shape)) and mine.ggml_type == int(t.tensor_type)
        np.testing.assert_array_equal(gf.dequantize(t.name),
                                      np.asarray(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(mine.shape))


def _params(shape: str, quant="q8_0", mtp=False):
    s = SHAPES[shape]
    if not mtp:
        s = dataclasses.replace(s, n_mtp=0)
    plan = plan_tensors(s, QUANTS[quant])
    return sum(int(np.prod(t.shape)) for t in plan), sum(t.n_bytes for t in plan), plan


# sha256 of files written before the tensor table moved into engine/models/qwen35.py SPEC (vocab 512,
# seed 7): the plan derived from the spec must write the very same bytes.
@pytest.mark.parametrize("shape,quant,fuse,sha256", [
    ("tiny-dense", "q8_0", False, "3f2a9e537941c720902f6664878e4421e02922ee74621ddc0025e9a99c325e08"),
    ("tiny-moe", "q4_k", True, "c0c2f3ec1ba52c00b98f02c779aba0aba9187c5c2f6f57c0edc1ffd135391209"),
    ("tiny-moe", "f16", False, "10990b88226e9b7f9e21538740650fc2d9e905ca0c9784a5c325dc41c591e2e8"),
    ("small-dense", "q4_k", False, "771a8b4302b94a452b758a9ccaa58f3ee56e9f49f3491dbcdc1bacc2e294d796"),
])
def test_same_seed_same_bytes_as_before(tmp_path, shape, quant, fuse, sha256):
    p = tmp_path / "s.gguf"
    write_synthetic(p, small(shape), quant, seed=7, fuse_gate_up=fuse)
    assert hashlib.sha256(p.read_bytes()).hexdigest() == sha256


@pytest.mark.parametrize("shape,params,q8_bytes", [
    ("qwen3.5-9b", 8.95e9, 9.52e9),  # docs/qwen35.md 6.2
    ("qwen3.5-27b", 26.9e9, 28.58e9),
])
def test_real_sizes_match_the_docs(shape, params, q8_bytes):
    n, b, _ = _params(shape)
    assert abs(n - params) / params < 0.01, n
    assert abs(b - q8_bytes) / q8_bytes < 0.01, b


def test_real_shapes_per_layer():
    _, _, plan = _params("qwen3.5-9b")
    by_name = {t.name: t for t in plan}
    assert by_name["blk.0.attn_qkv.weight"].shape == (8192, 4096)
    assert by_name["blk.3.attn_q.weight"].shape == (8192, 4096)
    assert by_name["blk.0.ssm_out.weight"].shape == (4096, 4096)
    assert by_name["output.weight"].shape == (248320, 4096)
    layer_bytes = sum(t.n_bytes for t in plan if t.name.startswith("blk.3."))
    assert layer_bytes == 222_822_400 + 34_816  # doc 6.2: full-attention layer at Q8_0 + F32 tensors
    gdn_bytes = sum(t.n_bytes for t in plan if t.name.startswith("blk.0."))
    assert gdn_bytes == 232_013_824 + 164_608  # doc 6.2: GDN layer
    _, _, moe = _params("qwen3.6-35b-a3b", mtp=True)
    m = {t.name: t for t in moe}
    assert m["blk.0.ffn_gate_exps.weight"].shape == (256, 512, 2048)
    routed = sum(int(np.prod(m[f"blk.0.ffn_{p}_exps.weight"].shape)) for p in ("gate", "up", "down"))
    assert routed == 805_306_368  # doc 6.2
    assert m["blk.0.ffn_down_exps.weight"].shape == (256, 2048, 512)
    assert m["blk.0.ffn_gate_inp.weight"].shape == (256, 2048) and m["blk.0.ffn_gate_inp.weight"].type_id == Q.F32
    assert m["blk.40.nextn.eh_proj.weight"].shape == (2048, 4096)
    assert "output.weight" in m
    _, _, small08 = _params("qwen3.5-0.8b")
    assert "output.weight" not in {t.name for t in small08}  # tied


def test_real_shape_file_with_one_layer(tmp_path):
    p = tmp_path / "08b.gguf"
    write_synthetic(p, "qwen3.5-0.8b", "q4_0", seed=0, n_layers=1, mtp=False)
    gf = GGUFFile(p)
    c = ModelConfig.from_gguf(gf)
    assert (c.hidden, c.n_heads, c.n_kv_heads, c.gdn_k_heads, c.gdn_v_heads, c.ffn) == (1024, 8, 2, 16, 16, 3584)
    assert c.vocab_size == 248320 and c.tied_embeddings and c.head_dim == 256 and c.rope_dims == 64
    assert gf.get("qwen35.rope.dimension_sections") == [11, 11, 10, 0]
    validate_tensors(c, gf)


def test_cli_synth(tmp_path, capsys):
    from minecart.engine.cli import main

    out = tmp_path / "cli.gguf"
    assert main(["synth", "--shape", "tiny-moe", "--quant", "q4_0", "--layers", "1", "--fuse-gate-up",
                 "--seed", "3", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MB/s" in text and str(out) in text
    gf = GGUFFile(out)
    assert "blk.0.ffn_gate_up_exps.weight" in gf.tensors and gf.get("qwen35moe.block_count") == 2
    assert main(["synth", "--list"]) == 0
    assert "qwen3.6-35b-a3b" in capsys.readouterr().out
    assert main(["synth", "--shape", "tiny-dense"]) == 1  # no output path: a RequestError, exit code 1


@pytest.mark.parametrize("shape,quant", [("tiny-dense", "q4_0"), ("tiny-moe", "q8_0"), ("small-dense", "q4_k"),
                                         ("small-dense", "q6_k")])
def test_synthetic_models_run_without_overflow(tmp_path, shape, quant):
    """The engine's reference model runs on the random weights: finite logits of a sane spread."""
    from minecart.engine import load_model

    p = tmp_path / "run.gguf"
    write_synthetic(p, small(shape, 1024), quant, seed=9)
    model = load_model(p)
    try:
        logits = model.logits([1, 500, 1023, 7, 7, 7, 300, 2] * 4)
    finally:
        getattr(model, "close", lambda: None)()
    assert logits.shape == (32, 1024) and np.isfinite(logits).all()
    assert 0.2 < logits.std() < 20, logits.std()
