"""Model download against a stand-in Hub on loopback (HF_ENDPOINT points at it; never the internet):
search, the GGUF file list with sizes and fit, a download cancelled midway and resumed with a Range
request, the sha256 check, readable errors, and a GUI thread that never stalls > 50 ms."""

from __future__ import annotations

import os

import pytest
from minecart.app import download as dl
from minecart.engine.devices import DeviceInfo

from tests.app.heartbeat import Heartbeat
from tests.app.hub_standin import HubStandIn

GiB = 1 << 30
REPO = "acme/Tiny-GGUF"
BIG = os.urandom(3 * 1024 * 1024 + 123)  # not a multiple of the 64 KiB pieces
FILES = {"tiny-Q4_K_M.gguf": BIG, "sub/tiny-Q8_0.gguf": b"GGUF" + b"\0" * 1000,
         "mmproj-tiny-f16.gguf": b"GGUF" + b"\1" * 10, "README.md": b"# tiny"}


@pytest.fixture
def hub(monkeypatch):
    with HubStandIn({REPO: dict(FILES), "acme/other-model": {"x.gguf": b"GGUF"}}) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
        yield h


def _gpu(i, free_gib, name="GPU"):
    return DeviceInfo(id=f"cuda:{i}", kind="cuda", name=f"{name} {i}", total_bytes=int(free_gib * GiB),
                      used_bytes=0, free_bytes=int(free_gib * GiB), source="simulated")


def _cpu(free_gib):
    return DeviceInfo(id="cpu:0", kind="cpu", name="CPU", total_bytes=int(free_gib * GiB), used_bytes=0,
                      free_bytes=int(free_gib * GiB), source="os")


def test_fit_words():
    rig = [_gpu(0, 8), _gpu(1, 6), _cpu(16)]
    assert dl.fit_text(5 * GiB, rig) == "fits on one GPU (GPU 0)"
    assert dl.fit_text(10 * GiB, rig) == "fits across 2 GPUs"
    # 20 GiB * 1.15 = 23 GiB; the GPUs hold 14 GiB less 2 x (256 MiB reserve + 400 MiB context
    # + 28 MiB kernel modules) = 12.66 GiB, so 10.34 GiB go to the CPU; 16 GiB of RAM less the
    # reserve is 15.75 GiB
    assert dl.fit_text(20 * GiB, rig) == "10.3 GiB on the CPU (slow)"
    assert dl.fit_text(40 * GiB, rig) == "too big: needs ~46.0 GiB, 28.4 GiB free"
    assert dl.fit_text(1 * GiB, [_cpu(16)]) == "runs on the CPU only (slow)"


def test_search_and_list(hub):
    assert dl.search_repos("tiny") == [REPO]
    files = dl.list_gguf_files(REPO)
    assert [f.path for f in files] == ["mmproj-tiny-f16.gguf", "sub/tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf"]
    assert files[2].size == len(BIG) and files[0].is_mmproj and files[1].name == "tiny-Q8_0.gguf"
    with pytest.raises(dl.DownloadError, match="no such model repository"):
        dl.list_gguf_files("acme/missing")
    with pytest.raises(dl.DownloadError, match="'owner/name'"):
        dl.list_gguf_files("just-a-name")
    with pytest.raises(dl.DownloadError, match="type part of a model's name"):
        dl.search_repos("  ")


def test_unreachable_hub_is_a_sentence(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    with pytest.raises(dl.DownloadError, match="cannot reach http://127.0.0.1:9"):
        dl.download(dl.RemoteFile(REPO, "tiny-Q4_K_M.gguf", 10), tmp_path)


def test_a_slow_search_can_be_cancelled(qtbot, hub, tmp_path, monkeypatch):
    """huggingface_hub retries an unreachable Hub for ~20 s: Cancel frees the panel at once."""
    import threading

    from minecart.app import download_panel

    gate = threading.Event()

    def stuck_search(text):
        gate.wait(10)
        return ["late/answer"]

    panel = download_panel.DownloadPanel(lambda: [], lambda: tmp_path)
    qtbot.addWidget(panel)
    monkeypatch.setattr(dl, "search_repos", stuck_search)
    panel.query.setText("tiny")
    panel.search()
    assert panel.busy() and panel.cancel_btn.isVisibleTo(panel)
    panel.cancel_btn.click()
    assert not panel.busy() and panel.search_btn.isEnabled() and panel.status.text() == "Cancelled."
    gate.set()
    for job in list(panel._jobs):
        job.wait(5000)
    qtbot.wait(50)
    assert panel.repos.count() == 0  # the late answer is dropped


def test_a_name_leading_outside_the_folder_is_refused(tmp_path):
    for repo, path in (("acme/x", "../../escape.gguf"), ("../x", "a.gguf"), ("acme/x", "/etc/a.gguf")):
        with pytest.raises(dl.DownloadError, match="leads outside"):
            dl.download(dl.RemoteFile(repo, path, 10), tmp_path / "models")
    assert dl.destination(dl.RemoteFile("acme/x", "sub/a.gguf", 1), tmp_path) == \
        tmp_path.resolve() / "acme" / "x" / "sub" / "a.gguf"


def test_damaged_download_is_refused(hub, tmp_path):
    hub.sha_override["sub/tiny-Q8_0.gguf"] = "f" * 64
    (f,) = [f for f in dl.list_gguf_files(REPO) if f.name == "tiny-Q8_0.gguf"]
    with pytest.raises(dl.DownloadError, match="arrived damaged"):
        dl.download(f, tmp_path)
    dest = dl.destination(f, tmp_path)
    assert not dest.exists() and not dl.part_path(dest).exists()


def test_panel_search_cancel_resume(qtbot, hub, tmp_path):
    from minecart.app.download_panel import DownloadPanel

    hub.delay_s = 0.01
    panel = DownloadPanel(lambda: [_gpu(0, 8), _cpu(16)], lambda: tmp_path / "models")
    qtbot.addWidget(panel)
    panel.resize(720, 560)
    panel.show()
    with Heartbeat() as hb:
        panel.query.setText("tiny")
        panel.search_btn.click()
        qtbot.waitUntil(lambda: panel.repos.count() == 1 and not panel.busy(), timeout=10000)
        panel.repos.setCurrentRow(0)
        qtbot.waitUntil(lambda: panel.table.rowCount() == 3 and not panel.busy(), timeout=10000)
        assert [panel.table.item(2, c).text() for c in range(3)] == [
            "tiny-Q4_K_M.gguf", "3.0 MiB", "fits on one GPU (GPU 0)"]
        assert panel.table.item(0, 2).text() == "vision projector"
        panel.table.selectRow(2)
        assert panel.download_btn.isEnabled()
        # picking a file asks the planner, from the file's header; this one is no GGUF at all
        qtbot.waitUntil(lambda: panel.table.item(2, 2).text() == "cannot plan", timeout=10000)
        assert "not a GGUF file" in panel.table.item(2, 2).toolTip()

        panel.download_btn.click()
        qtbot.waitUntil(lambda: panel.progress.value() > 0, timeout=10000)
        panel.cancel_btn.click()
        qtbot.waitUntil(lambda: not panel.busy(), timeout=10000)
        assert "cancelled" in panel.status.text()
        dest = tmp_path / "models" / "acme" / "Tiny-GGUF" / "tiny-Q4_K_M.gguf"
        part = dl.part_path(dest)
        kept = part.stat().st_size
        assert 0 < kept < len(BIG) and not dest.exists()

        hub.delay_s = 0.0
        with qtbot.waitSignal(panel.downloaded, timeout=20000) as got:
            panel.download_btn.click()
        qtbot.waitUntil(lambda: not panel.busy(), timeout=5000)
    assert got.args == [dest]
    assert dest.read_bytes() == BIG and not part.exists()
    assert hub.ranges == [f"bytes=0-{len(BIG) - 1}", None, f"bytes={kept}-"]  # header, try, rest
    assert panel.status.text() == f"Downloaded to {dest}"
    assert hb.ticks > 20 and hb.max_gap_ms <= 50, f"GUI thread stalled {hb.max_gap_ms:.0f} ms"
    panel.grab().save(str(tmp_path / "download.png"))


def test_panel_shows_a_missing_repo_in_words(qtbot, hub, tmp_path):
    from minecart.app.download_panel import DownloadPanel

    panel = DownloadPanel(lambda: [], lambda: tmp_path)
    qtbot.addWidget(panel)
    panel.list_files("acme/missing")
    qtbot.waitUntil(lambda: not panel.busy(), timeout=10000)
    assert "no such model repository" in panel.error.text()


def test_plan_fit_from_the_header_alone(monkeypatch, tiny_model):
    """The planner's verdict on a remote file: its header comes by Range requests (never the whole
    file), and the plan and predicted speed are the ones engine/placement.py makes for it."""
    data = tiny_model.read_bytes()
    with HubStandIn({"acme/tiny": {"tiny-Q8_0.gguf": data, "notes.gguf": b"NOPE" * 100}}) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
        files = {f.name: f for f in dl.list_gguf_files("acme/tiny")}
        f = files["tiny-Q8_0.gguf"]
        fit = dl.plan_fit(f, [_gpu(0, 8, "NVIDIA P104-100"), _cpu(16)])
        # 4 MiB did not hold the ~11 MB header, 16 MiB did; the rest of the file was never asked for
        assert h.ranges == ["bytes=0-4194303", "bytes=0-16777215"]
        assert fit.fits and fit.devices == ("cuda:0",)
        assert fit.decode_tokens_per_s > 0
        assert fit.text == f"fits on cuda:0 · ~{fit.decode_tokens_per_s:.0f} tok/s"

        tight = dl.plan_fit(f, [_gpu(0, 0.01), _cpu(0.01)])  # 10 MiB each: the weights alone are 19 MB
        assert not tight.fits and tight.text == "does not fit at 4096 tokens of context"
        assert tight.detail  # the planner's reason, for the tooltip
        with pytest.raises(dl.DownloadError, match="not a GGUF file"):
            dl.plan_fit(files["notes.gguf"], [_cpu(16)])
