"""Images in the sequence (engine/vision/insert.py) and the whole vision path end to end on the fixture
vision model: placeholder expansion, M-RoPE positions, embedding rows, logits and greedy tokens against
transformers, sessions across turns, the runtime (the app's message shape), the CLI, and errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from minecart.engine.errors import ImageError, RequestError
from minecart.engine.sampling import greedy_params
from minecart.engine.vision.insert import (
    ImageSpan,
    expand_image_pads,
    has_images,
    image_sources,
    mrope_positions,
    prepare_chat,
)

PAD = 248056
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def vision_dir(fixtures_dir):
    d = fixtures_dir / "vision"
    if not d.is_dir():
        pytest.skip("vision fixtures not found")
    return d


@pytest.fixture(scope="module")
def vl_model(vision_dir):
    from minecart.engine.model import load_model

    model = load_model(vision_dir / "qwen35-tiny-vl-f16.gguf", devices=["cpu"])
    yield model
    model.close()


def _messages(vision_dir, chat: dict) -> list[dict]:
    """The fixture chat's messages with its pictures as the app sends them ({"type": "image", "path"})."""
    images = iter(chat["images"])
    out = []
    for m in chat["messages"]:
        m = dict(m)
        if isinstance(m["content"], list):
            m["content"] = [{"type": "image", "path": str(vision_dir / "images" / next(images))}
                            if p["type"] == "image" else p for p in m["content"]]
        out.append(m)
    return out


# ---- pure layout -----------------------------------------------------------------------------------


def test_positions_worked_example():
    # doc section 6: 4 text tokens, a 14 x 14 image, then text
    ids = [1, 2, 3, 248053, PAD, 248054, 7, 8]
    expanded, spans = expand_image_pads(ids, [(14, 14)], PAD)
    assert len(expanded) == 7 + 196 and spans == [ImageSpan(4, 14, 14)]
    pos, nxt = mrope_positions(len(expanded), spans)
    assert (pos[:, :4] == np.arange(4)).all()
    assert (pos[0, 4:200] == 4).all()
    assert pos[1, 4:200].min() == 4 and pos[1, 4:200].max() == 17
    assert (pos[2, 4:18] == np.arange(4, 18)).all() and (pos[1, 4:18] == 4).all()
    assert (pos[:, 200] == 18).all() and (pos[:, 202] == 20).all() and nxt == 21


def test_positions_wide_and_tall_and_two_images():
    ids = [5, PAD, 6, PAD, 9]
    expanded, spans = expand_image_pads(ids, [(2, 3), (4, 1)], PAD)
    pos, nxt = mrope_positions(len(expanded), spans)
    assert spans == [ImageSpan(1, 2, 3), ImageSpan(8, 4, 1)]
    np.testing.assert_array_equal(pos[:, 1:7], [[1] * 6, [1, 1, 1, 2, 2, 2], [1, 2, 3, 1, 2, 3]])
    assert (pos[:, 7] == 4).all()  # 1 + max(2, 3)
    np.testing.assert_array_equal(pos[:, 8:12], [[5] * 4, [5, 6, 7, 8], [5] * 4])
    assert (pos[:, 12] == 9).all() and nxt == 10
    with pytest.raises(RequestError, match="2 image placeholder"):
        expand_image_pads(ids, [(1, 1)], PAD)


def test_image_parts_in_every_shape():
    msgs = [{"role": "user", "content": [
        {"type": "image", "path": "/a.png"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,xx"}},
        {"type": "text", "text": "hi"},
        {"type": "image", "image": b"raw"},
        {"type": "input_image", "image_url": "/b.png"},
    ]}]
    assert has_images(msgs) and not has_images("text") and not has_images([1, 2])
    assert not has_images([{"role": "user", "content": "just text"}])
    assert image_sources(msgs) == ["/a.png", "data:image/png;base64,xx", b"raw", "/b.png"]
    with pytest.raises(RequestError, match="names no picture"):
        image_sources([{"role": "user", "content": [{"type": "image"}]}])


# ---- against transformers -----------------------------------------------------------------------------


@pytest.mark.parametrize("chat_name", ["chat_image", "chat_two_images"])
def test_chat_matches_transformers(vl_model, vision_dir, fixtures_dir, chat_name):
    chat = json.loads((vision_dir / "chats.json").read_text())[chat_name]
    ref = np.load(vision_dir / "ref_hf" / f"{chat_name}.npz")
    cols = np.load(fixtures_dir / "logit_columns.npy")
    prepared = prepare_chat(vl_model, _messages(vision_dir, chat), enable_thinking=True)
    assert prepared.ids == ref["tokens"].tolist()
    np.testing.assert_array_equal(prepared.positions, ref["position_ids"])
    assert prepared.next_position == int(ref["next_position"]) == chat["next_position"]
    assert prepared.n_image_tokens == chat["n_image_tokens"]
    rows, values = prepared.embed_override
    np.testing.assert_array_equal(rows, np.nonzero(ref["mm_token_type_ids"])[0])
    assert np.abs(values - ref["image_embeds"]).max() / np.abs(ref["image_embeds"]).max() < 1e-4
    logits = vl_model.logits(prepared.ids, positions=prepared.positions,
                             embed_override=prepared.embed_override)
    err = np.abs(logits[:, cols] - ref["logits_cols"]).max() / np.abs(ref["logits_cols"]).max()
    assert err < 1e-4, err
    events = list(vl_model.generate(_messages(vision_dir, chat), greedy_params(max_tokens=16)))
    assert [e.token for e in events] == ref["gen_tokens"].tolist()
    assert events[-1].image_tokens == chat["n_image_tokens"] and events[-1].prompt_tokens == chat["len"]


def test_session_keeps_working_across_turns(vl_model, vision_dir):
    chat = json.loads((vision_dir / "chats.json").read_text())["chat_image"]
    turn1 = _messages(vision_dir, chat)
    session = vl_model.new_session()
    answer = [e for e in vl_model.generate(turn1, greedy_params(max_tokens=4), session=session)]
    reply = vl_model.tokenizer.decode([e.token for e in answer])
    # prompt next position 27 (not 82: positions are not token indices after an image), then the 3 fed tokens
    assert session.position == 27 + len(answer) - 1
    turn2 = turn1 + [{"role": "assistant", "content": reply},
                     {"role": "user", "content": [{"type": "text", "text": "And the colours?"},
                                                  {"type": "image", "path": str(vision_dir / "images" / "tiny_40x30.png")}]}]
    events = list(vl_model.generate(turn2, greedy_params(max_tokens=3), session=session))
    prepared = prepare_chat(vl_model, turn2)
    assert events[-1].cached_tokens >= 70  # the first image and the text before it were reused
    assert events[-1].image_tokens == 66 + 70
    fresh = vl_model.logits(prepared.ids, positions=prepared.positions,
                            embed_override=prepared.embed_override)[-1]
    again = vl_model.new_session()
    logits = again.sync(prepared.ids, positions=prepared.positions, embed_override=prepared.embed_override)
    np.testing.assert_allclose(logits, fresh, rtol=1e-4, atol=1e-4)
    assert events[0].token == int(np.argmax(fresh))


def test_runtime_app_message_shape(vision_dir):
    """The app's path: {"type": "image", "path"} parts -> Runtime.chat -> tower -> tokens and usage."""
    from minecart.engine.runtime import Runtime

    chat = json.loads((vision_dir / "chats.json").read_text())["chat_image"]
    ref = np.load(vision_dir / "ref_hf" / "chat_image.npz")
    rt = Runtime(sample_memory_s=0)
    try:
        info = rt.load(vision_dir / "qwen35-tiny-vl-f16.gguf", devices=["cpu"]).result()
        assert info["model"].has_vision if isinstance(info, dict) else rt.model_info.has_vision
        handle = rt.chat(_messages(vision_dir, chat), greedy_params(max_tokens=16), conversation_id="c1")
        tokens = [ev.generation.token for ev in handle.events() if ev.kind == "token" and ev.generation]
        final = handle.final
        assert final.kind == "done", final.text
        assert tokens == ref["gen_tokens"].tolist()
        assert final.usage.image_tokens == 66 and final.usage.prompt_tokens == 82
        bad = [{"role": "user", "content": [{"type": "image", "path": str(vision_dir / "README.md")},
                                            {"type": "text", "text": "what is this?"}]}]
        failed = rt.chat(bad, greedy_params(max_tokens=2))
        list(failed.events())
        assert failed.final.kind == "error" and isinstance(failed.final.error, ImageError)
        assert "README.md" in failed.final.text
        ok = rt.chat(_messages(vision_dir, chat), greedy_params(max_tokens=2), conversation_id="c1")
        list(ok.events())
        assert ok.final.kind == "done" and ok.final.usage.cached_tokens > 0
        tools = [{"type": "function", "function": {"name": "zoom", "description": "zoom in",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        with_tools = rt.chat(_messages(vision_dir, chat), greedy_params(max_tokens=1), tools=tools)
        list(with_tools.events())
        assert with_tools.final.kind == "done"
        assert with_tools.final.usage.prompt_tokens > 82 + 20  # the tools reached the template
        assert with_tools.final.usage.image_tokens == 66
    finally:
        rt.close()


def test_explicit_mmproj_and_no_vision(vision_dir):
    from minecart.engine.model import load_model
    from minecart.engine.vision import MmprojMismatchError

    with load_model(vision_dir / "qwen35-tiny-vl-f16.gguf", devices=["cpu"],
                    mmproj=vision_dir / "mmproj-qwen35-tiny-vl-f32.gguf", max_image_tokens=70) as m:
        assert m.vision.path.name.endswith("f32.gguf") and m.vision.max_image_tokens == 70
        pre, emb = m.vision.encode(vision_dir / "images" / "gradient_224x224.png")
        assert pre.n_tokens == emb.shape[0] == 64
        pre, _ = m.vision.encode(vision_dir / "images" / "photo_320x180.png")
        assert pre.n_tokens <= 70
    with load_model(vision_dir / "qwen35-tiny-vl-f16.gguf", devices=["cpu"], mmproj=False) as m:
        assert m.vision is None
        with pytest.raises(RequestError, match="cannot read pictures"):
            prepare_chat(m, [{"role": "user", "content": [{"type": "image", "path": "x.png"}]}])
    dense = vision_dir.parent / "dense" / "qwen35-tiny-dense-q8_0.gguf"
    if dense.is_file():  # same hidden size (32): fits; a different size would not
        with pytest.raises(MmprojMismatchError, match="not 'clip'"):
            load_model(dense, devices=["cpu"], mmproj=dense)


def test_cli_run_with_image(vision_dir):
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_COLOR="1")
    args = [sys.executable, "-m", "minecart.engine.cli", "run", str(vision_dir / "qwen35-tiny-vl-f16.gguf"),
            "--mmproj", str(vision_dir / "mmproj-qwen35-tiny-vl-f16.gguf"), "--devices", "cpu",
            "--image", str(vision_dir / "images" / "native_352x192.png"), "-p", "Describe this image.",
            "--temp", "0", "--max-tokens", "4"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert "(66 image)" in out.stderr and "generation: 4 tokens" in out.stderr
    bad = subprocess.run(args[:-8] + ["--image", str(vision_dir / "README.md"), "-p", "x"],
                         capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert bad.returncode != 0 and "README.md" in bad.stderr and "Traceback" not in bad.stderr


def test_unreadable_picture_only_fails_its_own_turn(vl_model, vision_dir, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes((vision_dir / "images" / "photo_320x180.png").read_bytes()[:400])
    good = str(vision_dir / "images" / "native_352x192.png")
    turn = [{"role": "user", "content": [{"type": "image", "path": str(broken)},
                                         {"type": "text", "text": "what is this?"}]}]
    with pytest.raises(ImageError, match="broken.png"):
        prepare_chat(vl_model, turn)
    later = turn + [{"role": "user", "content": [{"type": "image", "path": good},
                                                 {"type": "text", "text": "and this one?"}]}]
    video = [{"role": "user", "content": [{"type": "video", "path": good}, {"type": "text", "text": "?"}]}]
    assert has_images(video)
    with pytest.raises(RequestError, match="video"):
        prepare_chat(vl_model, video)
    prepared = prepare_chat(vl_model, later)  # the old broken picture is left out
    assert prepared.n_image_tokens == 66 and len(prepared.spans) == 1
    assert prepared.ids.count(PAD) == 66


def test_image_rows_across_prefill_chunks(vl_model, vision_dir):
    chat = json.loads((vision_dir / "chats.json").read_text())["chat_two_images"]
    prepared = prepare_chat(vl_model, _messages(vision_dir, chat))
    whole = vl_model.new_session().prefill(prepared.ids, positions=prepared.positions,
                                           embed_override=prepared.embed_override)
    chunked = vl_model.new_session().prefill(prepared.ids, chunk=37, positions=prepared.positions,
                                             embed_override=prepared.embed_override)
    np.testing.assert_allclose(chunked, whole, rtol=1e-4, atol=1e-4)
    wrong = vl_model.new_session().prefill(prepared.ids, embed_override=prepared.embed_override)
    assert np.abs(wrong - whole).max() > 1e-3  # token-index positions would be visibly different
