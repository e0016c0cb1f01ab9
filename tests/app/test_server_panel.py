"""The server switch: on, an official openai client talks to the app's Runtime on loopback and the
request count rises, off, the port is closed; a busy port gives a sentence a person can act on; with
"Requests at once" above one, concurrent requests to a real model share its decode steps."""

from __future__ import annotations

import socket
import threading

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


def test_requests_at_once_batch_the_apps_runtime(qtbot, fixtures_dir):
    """The real Qwen3.5 fixture model on the CPU, "Requests at once" 3: four concurrent completions from
    the official client all answer, the runtime batched them (its scheduler saw passes of 2 or more),
    and the GUI thread never stalled while the server started."""
    rt = Runtime(sample_memory_s=0)
    try:
        rt.load(fixtures_dir / "dense" / "qwen35-tiny-dense-f16.gguf", devices=["cpu:0"]).result(60)
        assert rt.batching_metrics() is None  # the app's runtime starts one at a time
        panel = ServerPanel(lambda: rt)
        qtbot.addWidget(panel)
        panel.show()
        port = _free_port()
        panel.port.setValue(port)
        panel.parallel.setValue(3)
        with Heartbeat() as hb:
            panel.toggle.click()
            qtbot.waitUntil(lambda: panel.running and panel.toggle.isEnabled(), timeout=10000)
        assert hb.max_gap_ms <= 50, f"GUI thread stalled {hb.max_gap_ms:.0f} ms while starting"
        assert not panel.parallel.isEnabled()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
        replies: list = []
        errors: list = []

        def ask(i: int) -> None:
            try:
                replies.append(client.completions.create(model="qwen35-tiny-dense-f16", prompt=f"Count {i}:", max_tokens=48,
                                                         temperature=0))
            except Exception as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            qtbot.waitUntil(lambda t=t: not t.is_alive(), timeout=60000)
        assert not errors, errors
        assert len(replies) == 4 and all(r.usage.completion_tokens > 0 for r in replies)
        assert rt.status()["parallel"] == 3
        m = rt.batching_metrics()
        assert m is not None and m["batch_size_max"] >= 2, m
        panel.toggle.click()
        qtbot.waitUntil(lambda: not panel.running and panel.toggle.isEnabled(), timeout=10000)
        assert panel.parallel.isEnabled() and rt.status()["parallel"] == 3  # kept: no reply is cut off
    finally:
        rt.close()
