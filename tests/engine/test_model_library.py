"""Model library: GGUF header summaries (architecture, parameters, quant mix, size, context, mmproj),
folder scans with duplicates and broken files, and the usual model locations."""

from __future__ import annotations

import numpy as np
import pytest
from minecart.engine import model_library as ml


def _write_gguf(path, arch="qwen35", ctx=8192, extra_tensors=(), general_type=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("Written Model")
    w.add_context_length(ctx)
    w.add_block_count(2)
    if general_type:
        w.add_type(general_type)
    w.add_token_list([f"t{i}" for i in range(300)])  # a long array the summary must skip
    w.add_tensor("token_embd.weight", np.ones((300, 64), dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.ones((128, 64), dtype=np.float16))
    for name, arr in extra_tensors:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_summary_of_written_file(tmp_path):
    p = _write_gguf(tmp_path / "m.gguf")
    s = ml.summarize(p, source="test")
    assert s.ok, s.error
    assert (s.architecture, s.name, s.context_length, s.n_layers) == ("qwen35", "Written Model", 8192, 2)
    assert s.n_params == 300 * 64 + 64 + 128 * 64
    assert s.quant_mix == {"F32": (300 * 64 + 64) * 4, "F16": 128 * 64 * 2}
    assert s.file_size == p.stat().st_size
    assert s.quant_text.startswith("F32 ") and "F16" in s.quant_text
    assert s.params_text == "27K"
    assert not s.is_mmproj


def test_summary_of_fixture(fixtures_dir):
    s = ml.summarize(fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf")
    assert s.ok and s.architecture == "qwen35" and s.context_length == 262144
    assert s.file_type == "Q8_0" and s.quant_text.startswith("Q8_0")  # general.file_type 7
    assert 8_000_000 < s.n_params < 9_000_000


def test_file_type_label_comes_from_metadata():
    assert ml._file_type_label(15) == "Q4_K_M" and ml._file_type_label(1) == "F16"
    assert ml._file_type_label(None) == "" and ml._file_type_label(99999) == ""


@pytest.mark.parametrize("cut", [3, 20, 200, 3000])
def test_truncated_or_foreign_files_become_errors(tmp_path, cut):
    good = _write_gguf(tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good[:cut])
    s = ml.summarize(bad)
    assert not s.ok and "header" in s.error
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 definitely a zip")
    assert "magic" in ml.summarize(junk).error
    assert "cannot read" in ml.summarize(tmp_path / "missing.gguf").error


def test_scan_finds_models_once_and_pairs_mmproj(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    folder = tmp_path / "models" / "vendor"
    folder.mkdir(parents=True)
    model = _write_gguf(folder / "vl-model.gguf")
    proj = _write_gguf(folder / "mmproj-vl-model-f16.gguf", arch="clip", general_type="mmproj")
    (folder / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    (folder / "notes.txt").write_text("not a model")
    (tmp_path / "later").mkdir()
    (tmp_path / "later" / "link.gguf").symlink_to(model)
    rows = ml.scan([tmp_path / "models", folder, tmp_path / "later"], include_defaults=True, include_demo=False)
    by_name = {r.path.name: r for r in rows}
    assert set(by_name) == {"vl-model.gguf", "mmproj-vl-model-f16.gguf", "broken.gguf"}  # link = duplicate
    assert by_name["vl-model.gguf"].mmproj_path == proj and by_name["vl-model.gguf"].has_vision
    assert by_name["mmproj-vl-model-f16.gguf"].is_mmproj
    assert by_name["broken.gguf"].error


def test_default_locations_follow_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama"))
    locs = dict((str(p), label) for label, p in ml.default_locations())
    assert locs[str(tmp_path / "hf" / "hub")] == "Hugging Face cache"
    assert locs[str(tmp_path / "llama")] == "llama.cpp cache"
    assert any(p.endswith(".lmstudio/models") for p in locs)


def test_scan_cancel_stops_early(tmp_path):
    for i in range(3):
        _write_gguf(tmp_path / f"m{i}.gguf")
    import threading

    ev = threading.Event()
    ev.set()
    assert ml.scan([tmp_path], include_defaults=False, include_demo=False, cancel=ev) == []
