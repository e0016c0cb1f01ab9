"""Fixtures for the desktop app tests: offscreen Qt, private settings/data folders, and a scripted fake
model behind the real engine Runtime (so the bridge, threads and signals are the production ones; only
the maths is fake). The real engine is exercised in test_end_to_end.py on the fixture GGUF."""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"  # before any Qt import

import threading
import time

import pytest
from minecart.engine.devices import DeviceInfo
from minecart.engine.errors import GenerationCancelled

from tests.engine.fake_chat_model import FakeEvent, FakeModelBase


@pytest.fixture(autouse=True)
def private_dirs(tmp_path, monkeypatch):
    """Settings, conversations and pasted images go to a temporary folder, never the user's."""
    monkeypatch.setenv("MINECART_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("MINECART_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("MINECART_SIMULATE_DEVICES", raising=False)
    return tmp_path


@pytest.fixture(scope="session", autouse=True)
def _theme(qapp):
    from minecart.app import theme

    theme.apply(qapp)
    return qapp


class ScriptedModel(FakeModelBase):
    """Replies with `reply` (chunks of 3 characters), thinking first when asked. `fail_on` makes
    generate raise on a prompt containing that text; `token_delay` slows the stream (for Stop).
    Without a chat template, so chats reach `generate` as messages."""

    def __init__(self, reply="Hello **there**.\n\n```python\nprint(1)\n```", thinking="Let me think.",
                 fail_on=None, token_delay=0.0, has_vision=False):
        super().__init__(name="Scripted")
        self.chat_template = None
        self.reply = reply
        self.thinking = thinking
        self.fail_on = fail_on
        self.token_delay = token_delay
        self.vision = "scripted vision tower" if has_vision else None
        self.prompts = []

    def generate(self, prompt, params=None, session=None, cancel=None, enable_thinking=True,
                 **prompt_extras):
        self.prompts.append(prompt)
        text = repr(prompt[-1] if isinstance(prompt, list) and prompt else prompt)  # the newest message
        if self.fail_on and self.fail_on in text:
            raise RuntimeError(f"simulated engine crash on {self.fail_on!r}")
        out = (f"<think>{self.thinking}</think>" if enable_thinking else "") + self.reply
        chunks = [out[i:i + 3] for i in range(0, len(out), 3)]
        for n, chunk in enumerate(chunks, 1):
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("stopped")
            if self.token_delay:
                time.sleep(self.token_delay)
            yield FakeEvent(n, chunk, "stop" if n == len(chunks) else None, 12, n, 500.0, 50.0)


def make_loader(model_factory, steps=4, step_delay=0.0, block: threading.Event | None = None):
    """A Runtime loader reporting progress; with `block`, it waits there (so a test can cancel midway)."""

    def loader(path, devices=None, placement=None, progress=None, cancel=None, **options):
        for i in range(steps):
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("load cancelled")
            if progress:
                progress((i + 1) / steps, f"loading part {i + 1}/{steps}")
            if block is not None and i == 1:
                while not (cancel is not None and cancel.is_set()):
                    time.sleep(0.01)
                raise GenerationCancelled("load cancelled")
            if step_delay:
                time.sleep(step_delay)
        return model_factory()

    return loader


@pytest.fixture
def make_bridge(qapp):
    """make_bridge(model=..., loader=...) -> EngineBridge over a real Runtime with a fake loader."""
    from minecart.app.engine_bridge import EngineBridge
    from minecart.engine.runtime import Runtime

    made = []

    def factory(model=None, loader=None):
        model = model or ScriptedModel()
        rt = Runtime(loader=loader or make_loader(lambda: model), sample_memory_s=0)
        bridge = EngineBridge(runtime=rt)
        bridge.fake_model = model
        made.append(bridge)
        return bridge

    yield factory
    for b in made:
        b.shutdown()
    # the watchers' last queued signals and their deleteLater run now, while the bridges that receive
    # them still exist, not in the next test's event processing (one CI run crashed there, in
    # pytest-qt's processEvents before test_gc_pauses, right after this fixture's test)
    from PySide6.QtCore import QCoreApplication, QEvent

    QCoreApplication.sendPostedEvents(None, 0)
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)


@pytest.fixture
def two_gpus():
    gib = 1 << 30
    return [
        DeviceInfo(id="cuda:0", kind="cuda", name="Test GPU A", total_bytes=8 * gib, used_bytes=gib // 4,
                   free_bytes=8 * gib - gib // 4, compute_capability=(6, 1), source="nvml", pcie=(1, 1)),
        DeviceInfo(id="cuda:1", kind="cuda", name="Test GPU B", total_bytes=6 * gib, used_bytes=gib // 4,
                   free_bytes=6 * gib - gib // 4, compute_capability=(7, 5), source="nvml"),
        DeviceInfo(id="cpu:0", kind="cpu", name="Test CPU", total_bytes=32 * gib, used_bytes=4 * gib,
                   free_bytes=28 * gib, extra={"threads": 8}, source="os"),
    ]


@pytest.fixture
def tiny_model(fixtures_dir):
    path = fixtures_dir / "dense" / "qwen35-tiny-dense-q8_0.gguf"
    if not path.is_file():
        pytest.skip("fixture model missing")
    return path


@pytest.fixture
def scripted():
    """The ScriptedModel class, for tests that build one with other replies."""
    return ScriptedModel


@pytest.fixture
def loader_factory():
    """make_loader, for tests that need a slow or blocking load."""
    return make_loader
