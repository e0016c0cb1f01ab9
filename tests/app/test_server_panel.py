"""The server switch: on, an official openai client talks to the app's Runtime on loopback and the
request count rises, off, the port is closed; a busy port gives a sentence a person can act on."""

from __future__ import annotations

import socket

import openai
import pytest
from minecart.app.server_panel import ServerPanel
from minecart.engine.runtime import Runtime

from tests.app.heartbeat import Heartbeat
from tests.engine.fake_chat_model import FakeModel, fake_loader


@pytest.fixture
def runtime():
    rt = Runtime(loader=fake_loader(FakeModel()), sample_memory_s=0)
    rt.load("/models/fake-model.gguf").result(10)
    yield rt
    rt.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_toggle_serves_the_runtime_and_counts_requests(qtbot, runtime, tmp_path):
    panel = ServerPanel(lambda: runtime)
    qtbot.addWidget(panel)
    panel.show()
    port = _free_port()
    panel.port.setValue(port)
    with Heartbeat() as hb:
        panel.toggle.click()
        qtbot.waitUntil(lambda: panel.running and panel.toggle.isEnabled(), timeout=10000)
    assert hb.max_gap_ms <= 50, f"GUI thread stalled {hb.max_gap_ms:.0f} ms while starting"
    url = f"http://127.0.0.1:{port}"
    assert panel.url.text() == f"Serving at {url}/v1"
    assert panel.toggle.text() == "Stop server" and not panel.port.isEnabled()

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=10, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    reply = client.chat.completions.create(model="fake-model",
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content
    qtbot.waitUntil(lambda: panel.count.text() == "2 API requests served · model fake-model",
                    timeout=3000)
    assert panel.server.request_count == 2
    panel.grab().save(str(tmp_path / "server.png"))

    panel.toggle.click()
    qtbot.waitUntil(lambda: not panel.running and panel.toggle.isEnabled(), timeout=10000)
    assert panel.url.text() == "Stopped" and panel.toggle.text() == "Start server"
    assert not _port_open(port)
    with pytest.raises(openai.APIConnectionError):
        client.models.list()


def test_a_busy_port_says_so(qtbot, runtime):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        panel = ServerPanel(lambda: runtime)
        qtbot.addWidget(panel)
        panel.port.setValue(port)
        panel.toggle.click()
        qtbot.waitUntil(lambda: panel.toggle.isEnabled() and panel.error.text() != "", timeout=10000)
    assert not panel.running
    assert panel.error.text().startswith(f"Port {port} on 127.0.0.1 is already in use")
    assert panel.url.text() == "Stopped" and panel.toggle.text() == "Start server"


def test_no_engine_no_server(qtbot):
    panel = ServerPanel(lambda: None)
    qtbot.addWidget(panel)
    panel.toggle.click()
    assert not panel.running
    assert "engine did not start" in panel.error.text()


def test_an_api_key_is_required_once_set_and_the_open_network_is_warned_of(qtbot, runtime):
    panel = ServerPanel(lambda: runtime)
    qtbot.addWidget(panel)
    panel.show()
    panel.network.setChecked(True)
    assert panel.warning.isVisible()  # the network without a key
    panel.api_key.setText("s3cret")
    assert not panel.warning.isVisible()
    panel.network.setChecked(False)  # the key on loopback only, for the test
    port = _free_port()
    panel.port.setValue(port)
    panel.toggle.click()
    qtbot.waitUntil(lambda: panel.running and panel.toggle.isEnabled(), timeout=10000)
    assert not panel.api_key.isEnabled()
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", timeout=10, max_retries=0).models.list()
    good = openai.OpenAI(base_url=url, api_key="s3cret", timeout=10, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["fake-model"]
    panel.toggle.click()
    qtbot.waitUntil(lambda: not panel.running and panel.toggle.isEnabled(), timeout=10000)
    assert panel.api_key.isEnabled() and not _port_open(port)
