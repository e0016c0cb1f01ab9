"""`minecart inspect` prints the right facts for every fixture GGUF (numbers from fixtures/README.md)."""

from __future__ import annotations

import json
import sys

import pytest
from minecart.engine.cli import main


def inspect_json(path, capsys) -> dict:
    assert main(["inspect", "--json", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("rel,kind,n_bytes", [("dense/qwen35-tiny-dense-f16.gguf", "F16", 27327328),
                                              ("dense/qwen35-tiny-dense-q8_0.gguf", "Q8_0", 19658656)])
def test_dense_fixtures(fixtures_dir, capsys, rel, kind, n_bytes):
    f = inspect_json(fixtures_dir / rel, capsys)
    assert f["architecture"] == "qwen35" and f["name"] == "denseA Hf" and f["supported"]
    assert f["file_bytes"] == n_bytes and f["n_tensors"] == 123 and f["n_metadata_keys"] == 34
    p = f["params"]
    assert round(p["total"] / 1e6, 2) == 8.14  # "8.14 M parameters (+0.04 M in the MTP block)"
    assert round(p["embeddings"] / 1e6, 2) == 7.95 and p["embeddings"] == 248320 * 32
    assert round(p["mtp"] / 1e6, 2) == 0.04
    assert f["layer_summary"] == "GDN x6, attention x2" and f["n_layers"] == 8 and f["n_mtp_layers"] == 1
    assert f["layer_types"] == ["gdn", "gdn", "gdn", "attention", "gdn", "gdn", "gdn", "attention"]
    # matrices in the file's type, 1-D tensors / conv / ssm_a / dt bias in F32 (README tensor table)
    assert {k: v["tensors"] for k, v in f["quant_mix"].items()} == {kind: 71, "F32": 52}
    assert sum(v["bytes"] for v in f["quant_mix"].values()) == f["tensor_bytes"] < f["file_bytes"]
    assert f["context_length"] == 262144 and f["hidden"] == 32 and f["ffn"] == 96
    assert f["attention"] == {"heads": 4, "kv_heads": 2, "head_dim": 64, "value_head_dim": 64, "rope_dims": 16,
                              "rope_base": 1e7, "rms_eps": pytest.approx(1e-6)}
    assert f["gdn"] == {"key_heads": 2, "value_heads": 4, "key_dim": 16, "value_dim": 16, "conv_kernel": 4,
                        "conv_channels": 128}
    assert "moe" not in f and f["tied_embeddings"] and f["vocab_size"] == 248320
    t = f["tokenizer"]
    assert (t["model"], t["pre"], t["tokens"], t["merges"], t["eos_id"]) == ("gpt2", "qwen35", 248320, 247587, 248046)
    assert t["has_chat_template"]
    assert f["tensors_ok"]
    kinds = {row["kind"] for row in f["layers"]}
    assert kinds == {"gdn", "attention"} and len(f["layers"]) == 8
    gdn_bytes = {row["bytes"] for row in f["layers"] if row["kind"] == "gdn"}
    assert len(gdn_bytes) == 1  # every GDN layer has the same tensors


def test_text_output(fixtures_dir, capsys):
    assert main(["inspect", "--layers", str(fixtures_dir / "dense/qwen35-tiny-dense-q8_0.gguf")]) == 0
    out = capsys.readouterr().out
    for needle in ("qwen35", "8.14 M", "GDN x6, attention x2", "Q8_0", "262,144", "248,320 tokens",
                   "chat template yes", "4 heads / 2 KV heads, head dim 64", "2 key heads x 16",
                   "all present", "18.75 MiB"):
        assert needle in out, needle
    assert out.count(" GDN ") >= 6  # one row per layer with --layers


def test_vocab_only_and_vision_files(fixtures_dir, capsys):
    v = inspect_json(fixtures_dir / "qwen35-vocab.gguf", capsys)
    assert v["n_tensors"] == 0 and v["vocab_only"] and v["params"]["total"] == 0
    assert v["tokenizer"]["tokens"] == 248320 and "tensors_ok" not in v
    m = inspect_json(fixtures_dir / "vision/mmproj-qwen35-tiny-vl-f16.gguf", capsys)
    assert m["architecture"] == "clip" and not m["supported"] and m["n_tensors"] == 46
    assert set(m["quant_mix"]) == {"F16", "F32"} and m["params"]["total"] > 0
    m32 = inspect_json(fixtures_dir / "vision/mmproj-qwen35-tiny-vl-f32.gguf", capsys)
    assert set(m32["quant_mix"]) == {"F32"} and m32["params"]["total"] == m["params"]["total"]
    vl = inspect_json(fixtures_dir / "vision/qwen35-tiny-vl-f16.gguf", capsys)
    assert vl["architecture"] == "qwen35" and vl["tensors_ok"] and vl["n_tensors"] == 108


def test_synthetic_moe(tmp_path, capsys):
    import dataclasses

    from minecart.engine.synth import SHAPES, write_synthetic

    p = tmp_path / "moe.gguf"
    write_synthetic(p, dataclasses.replace(SHAPES["tiny-moe"], vocab_size=400), "q8_0", fuse_gate_up=True)
    f = inspect_json(p, capsys)
    assert f["moe"] == {"experts": 8, "experts_used": 2, "expert_ffn": 32, "shared_expert_ffn": 32,
                        "gate_up": "fused"}
    assert not f["tied_embeddings"] and f["params"]["embeddings"] == 2 * 400 * 32 and f["tensors_ok"]


def test_broken_file_exits_1_with_message(tmp_path, capsys):
    p = tmp_path / "broken.gguf"
    p.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 16)
    assert main(["inspect", str(p)]) == 1
    err = capsys.readouterr().err
    assert "broken.gguf" in err and "re-download" in err


def test_gpu_flag(capsys, monkeypatch):
    assert main(["inspect", "--gpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("devices:") and len(out.splitlines()) >= 2
    monkeypatch.setitem(sys.modules, "minecart.engine.devices", None)  # as if the module did not exist
    assert main(["inspect", "--gpu", "--json"]) == 0
    assert "no device module" in json.loads(capsys.readouterr().out)["devices"][0]
    assert main(["inspect"]) == 1  # neither a file nor --gpu


def test_mmproj_and_vocab_only_are_explained_in_words(fixtures_dir, capsys):
    assert main(["inspect", str(fixtures_dir / "vision/mmproj-qwen35-tiny-vl-f16.gguf")]) == 0
    out = capsys.readouterr().out
    assert "vision projector (mmproj)" in out and "not supported" not in out
    assert "qwen3vl_merger: 3 blocks 64 wide, 2 heads, 16-pixel patches merged 2x2" in out
    assert "--mmproj" in out and "--image" in out  # how to use it
    m = inspect_json(fixtures_dir / "vision/mmproj-qwen35-tiny-vl-f16.gguf", capsys)
    assert m["mmproj"]["output_width"] == 32 and "config_error" not in m
    assert main(["inspect", str(fixtures_dir / "qwen35-vocab.gguf")]) == 0
    out = capsys.readouterr().out
    assert "vocabulary-only file" in out and "cannot generate with it" in out
    assert "quantization mix" not in out  # no tensors, no empty table
