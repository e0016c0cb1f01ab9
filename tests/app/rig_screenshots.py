"""Pictures of the Rig page's four tabs in the main window, offscreen, for docs/screenshots/.

    python -m tests.app.rig_screenshots docs/screenshots --width 1440
    python -m tests.app.rig_screenshots docs/screenshots --width 960 --suffix=-960

A script, not a test (pytest collects test_*.py only). What is real and what stands in: the window, the
panels, the Runtime and the tiny Qwen3.5 fixture model it loads and serves over HTTP are real; the three
GPUs are simulated (main_window.simulated_devices), their telemetry is five synthetic minutes at 1 Hz
(a fake NVML module behind them), and the Hub is the loopback stand-in of tests/app/hub_standin.py,
listing two 9B files by their real sizes (no such bytes are served) beside the fixture file, whose
header the planner reads.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

SIZES = {"Qwen3.5-9B-Q4_K_M.gguf": 5_680_000_000, "Qwen3.5-9B-Q8_0.gguf": 9_530_000_000,
         "mmproj-Qwen3.5-9B-f16.gguf": 920_000_000}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder the pictures go to")
    ap.add_argument("--width", type=int, default=1440, help="window width in pixels")
    ap.add_argument("--height", type=int, default=860, help="window height in pixels")
    ap.add_argument("--suffix", default="", help="added to each file name, e.g. -960")
    ap.add_argument("--model", type=Path, help="GGUF to load and serve (default: the fixture)")
    args = ap.parse_args(argv)
    os.environ["QT_QPA_PLATFORM"] = "offscreen"
    tmp = tempfile.mkdtemp(prefix="minecart-shots-")
    os.environ["MINECART_CONFIG_DIR"] = f"{tmp}/config"
    os.environ["MINECART_DATA_DIR"] = f"{tmp}/data"
    os.environ["HF_HUB_DISABLE_IMPLICIT_TOKEN"] = "1"

    import openai
    from minecart.app import download as dl
    from minecart.app import telemetry as tm
    from minecart.app import theme
    from minecart.app.conversations import Conversation
    from minecart.app.engine_bridge import EngineBridge
    from minecart.app.main_window import MainWindow, simulated_devices
    from minecart.app.settings import Settings
    from minecart.engine.metrics import RequestTiming
    from minecart.engine.runtime import Runtime
    from PySide6.QtWidgets import QApplication

    from tests.app.fake_nvml import FakeNvml, mining_card
    from tests.app.hub_standin import HubStandIn
    from tests.conftest import FIXTURES

    model = args.model or (FIXTURES / "dense" / "qwen35-tiny-dense-q8_0.gguf" if FIXTURES else None)
    if model is None or not model.is_file():
        print("no model to load: give --model FILE.gguf", file=sys.stderr)
        return 2
    app = QApplication.instance() or QApplication([])
    theme.apply(app)

    def pump(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            app.processEvents()
            time.sleep(0.01)

    def wait(cond, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise TimeoutError("the window did not get there in time")
            pump(0.02)

    cards = [mining_card(),
             mining_card(name="NVIDIA CMP 30HX", fan=None, energy_mj=None, gen=1, width=4, throttle=0,
                         power_mw=110_000, limit_mw=125_000, sm=1785, mem=7001),
             mining_card(name="NVIDIA P106-090", gen=1, width=1, gen_max=1, width_max=4, throttle=0x1,
                         util_gpu=0, power_mw=31_000, fan=30)]
    tm._import_pynvml = lambda: FakeNvml(cards)
    bridge = EngineBridge(runtime=Runtime(sample_memory_s=0))
    devices = simulated_devices("NVIDIA P104-100:8,NVIDIA CMP 30HX:6,NVIDIA P106-090:6")
    win = MainWindow(settings=Settings(), bridge=bridge, devices=devices, scan_defaults=False,
                     include_demo=False)
    win.resize(args.width, args.height)
    win.show()
    loaded: list = []
    bridge.loaded.connect(loaded.append)
    win.load(model)
    wait(lambda: loaded)
    cockpit = win.cockpit
    args.out.mkdir(parents=True, exist_ok=True)

    def shot(tab: str) -> None:
        cockpit.show_tab(tab)
        pump(0.2)
        win.grab().save(str(args.out / f"{tab}{args.suffix}.png"))

    # five minutes of telemetry: a long reply from minute 1 to minute 4 on the first two cards
    panel = cockpit.telemetry
    panel.start = lambda: None  # the synthetic history, not live samples of the fake
    now, energy = time.time(), [0.0] * len(cards)

    def sample(i: int) -> list:
        out = []
        for k, c in enumerate(cards):
            busy = 60 < i < 250 and k != 2
            watts = c["power_mw"] / 1000 * (1.0 if busy else 0.35) * (0.92 + 0.08 * math.sin(i / 7 + k))
            energy[k] += watts
            warm = 20 * (1 - math.exp(-max(0, i - 60) / 40)) if busy else 0
            out.append(tm.CardReading(
                k, c["name"], now - 300 + i, power_w=watts, power_limit_w=c["limit_mw"] / 1000,
                temperature_c=int(45 + 5 * k + warm), fan_percent=c["fan"], sm_clock_mhz=c["sm"],
                mem_clock_mhz=c["mem"], sm_clock_max_mhz=c["sm_max"], throttle_bits=c["throttle"],
                pcie_gen=c["gen"], pcie_width=c["width"], pcie_gen_max=c["gen_max"],
                pcie_width_max=c["width_max"], gpu_util=c["util_gpu"] if busy else 2,
                mem_util=c["util_mem"], energy_j=None if c["energy_mj"] is None else energy[k]))
        return out

    for i in range(300):
        panel.on_sample(sample(i))
    start, end = now - 240, now - 50
    bridge.metrics.record_request(RequestTiming(1, "chat", start, 0.0, 0.4, 0.4, end - start - 0.4, 412,
                                                7800, 1030.0, 7800 / (end - start - 0.4), "stop"))
    win.show_page("rig")
    panel.on_sample(sample(300))
    shot("telemetry")

    # the API server, called three times by the openai client
    cockpit.show_tab("server")
    cockpit.server.toggle.click()
    wait(lambda: cockpit.server.toggle.isEnabled())
    if not cockpit.server.running:
        print(cockpit.server.error.text(), file=sys.stderr)
        return 1
    client = openai.OpenAI(base_url=cockpit.server.server.url + "/v1", api_key="none", max_retries=0)
    for _ in range(3):
        client.chat.completions.create(model=model.stem, max_tokens=3,
                                       messages=[{"role": "user", "content": "hi"}])
    pump(0.7)
    shot("server")
    cockpit.server.toggle.click()
    wait(lambda: cockpit.server.toggle.isEnabled())

    # a search, a listing with the planner's verdict for the fixture, a download under way
    files = {name: b"G" * 1000 for name in SIZES} | {model.name: model.read_bytes()}
    with HubStandIn({"acme/Qwen3.5-9B-GGUF": files}) as hub:
        os.environ["HF_ENDPOINT"] = hub.url
        listed = dl.list_gguf_files
        dl.list_gguf_files = lambda repo: [dl.RemoteFile(f.repo, f.path, SIZES.get(f.path, f.size))
                                           for f in listed(repo)]
        d = cockpit.download
        cockpit.show_tab("download")
        d.query.setText("qwen3.5")
        d.search()
        wait(lambda: d.repos.count() == 1 and not d.busy())
        d.repos.setCurrentRow(0)
        wait(lambda: d.table.rowCount() == len(files) and not d.busy())
        row = next(i for i, f in enumerate(d.files) if f.name == model.name)
        d.table.selectRow(row)
        wait(lambda: not d.table.item(row, 2).text().startswith("planning"))
        d.progress.setVisible(True)
        d.cancel_btn.setVisible(True)
        d._progress(int(model.stat().st_size * 0.37), model.stat().st_size)
        d.status.setText(f"Downloading {model.name}…")
        shot("download")
        d.progress.setVisible(False)
        d.cancel_btn.setVisible(False)
        dl.list_gguf_files = listed

    # conversations found by a word
    for i, (title, question, answer) in enumerate((
            ("Riser cables", "Is a PCIe x1 riser too slow for a layer split?",
             "For a layer split the riser is fine: only the hidden state crosses it."),
            ("Fan curve", "Fan curve for a CMP 30HX riser rig", "Keep the core under 70 °C."),
            ("Soup", "A leek soup recipe", "Leeks, potatoes, stock."))):
        win.chat.store.save(Conversation(id=f"c{i}", title=title, messages=[
            {"role": "user", "content": question}, {"role": "assistant", "content": answer}]))
    conversations = cockpit.conversations
    cockpit.show_tab("conversations")
    conversations.query.setText("riser")
    wait(lambda: conversations.results.count() == 2)
    conversations.results.setCurrentRow(0)
    shot("conversations")
    win.close()
    print(f"saved {', '.join(f'{t}{args.suffix}.png' for t in ('telemetry', 'server', 'download', 'conversations'))}"
          f" in {args.out} ({args.width}x{args.height})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
