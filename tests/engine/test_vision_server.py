"""Pictures through the OpenAI-compatible API: a data: URL image_url part reaches the tower of the fixture
vision model (usage counts the image tokens' prompt), a broken picture is a 400 that names the problem."""

from __future__ import annotations

import base64

import pytest
from fastapi.testclient import TestClient
from minecart.engine.runtime import Runtime
from minecart.engine.server import create_app


@pytest.fixture(scope="module")
def client(fixtures_dir):
    vision = fixtures_dir / "vision"
    if not vision.is_dir():
        pytest.skip("vision fixtures not found")
    rt = Runtime(sample_memory_s=0)
    rt.load(vision / "qwen35-tiny-vl-f16.gguf", devices=["cpu"]).result()
    with TestClient(create_app(rt), base_url="http://127.0.0.1") as c:
        yield c, vision
    rt.close()


def _body(url: str, text: str = "Describe this image.") -> dict:
    return {"model": "qwen35-tiny-vl-f16", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": text}]}]}


def test_data_url_picture(client):
    c, vision = client
    data = (vision / "images" / "native_352x192.png").read_bytes()
    r = c.post("/v1/chat/completions", json=_body("data:image/png;base64," + base64.b64encode(data).decode()))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 82 and usage["completion_tokens"] == 3  # 66 image tokens expanded


def test_broken_picture_is_a_400(client):
    c, vision = client
    data = (vision / "images" / "native_352x192.png").read_bytes()[:200]
    r = c.post("/v1/chat/completions", json=_body("data:image/png;base64," + base64.b64encode(data).decode()))
    assert r.status_code == 400
    assert "truncated" in r.text or "damaged" in r.text or "could not be read" in r.text
    r = c.post("/v1/chat/completions", json=_body("data:image/png;base64,bm90IGEgcGljdHVyZQ=="))
    assert r.status_code == 400 and "not an image format" in r.text
