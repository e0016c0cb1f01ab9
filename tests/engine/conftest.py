"""Fixtures the engine's server tests share."""

from __future__ import annotations

import pytest
from minecart.engine.runtime import Runtime
from minecart.engine.server import ServerThread, create_app

from tests.engine.fake_chat_model import FakeModel, fake_loader


@pytest.fixture(scope="module")
def fake_server():
    """A real server on 127.0.0.1 over a Runtime with the fake model: (server, runtime, model)."""
    model = FakeModel()
    rt = Runtime(loader=fake_loader(model), sample_memory_s=0)
    rt.load("/models/fake-model.gguf").result(20.0)
    server = ServerThread(create_app(rt)).start()
    yield server, rt, model
    server.stop()
    rt.close()
