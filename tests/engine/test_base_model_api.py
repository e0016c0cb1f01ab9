"""A pretrained base model through the HTTP API: chat requests get the plain text of their messages
by default, the chat template with `"chat_template_mode": "on"`, and a bad mode is a 400."""

from __future__ import annotations

import httpx
from minecart.engine.runtime import Runtime
from minecart.engine.server import ServerThread, create_app

from tests.engine.fake_chat_model import FakeModel, fake_loader

TIMEOUT = 20.0


def test_base_model_chat_mode_through_the_api():
    model = FakeModel()
    model.is_base_model = True
    rt = Runtime(loader=fake_loader(model), sample_memory_s=0)
    rt.load("/models/base.gguf").result(TIMEOUT)
    server = ServerThread(create_app(rt)).start()
    try:
        body = {"model": "base", "messages": [{"role": "user", "content": "Once upon a time"}],
                "max_tokens": 5, "temperature": 0}
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert model.prompts[-1] == "Once upon a time"  # no roles, no generation prompt
            r = client.post("/v1/chat/completions", json={**body, "chat_template_mode": "on"})
            assert r.status_code == 200, r.text
            assert model.prompts[-1].startswith("<|user|>Once upon a time\n<|assistant|>")
            r = client.post("/v1/chat/completions", json={**body, "chat_template_mode": "yes"})
            assert r.status_code == 400 and "chat_template_mode" in r.text
    finally:
        server.stop()
        rt.close()
