"""Telemetry: every field read from a fake NVML and formatted, the joules/token arithmetic, NVML read
on the worker thread with the GUI never stalled, and "no NVIDIA driver" where NVML cannot start."""

from __future__ import annotations

import threading

import pytest
from minecart.app import telemetry as tm
from minecart.engine.metrics import Metrics, RequestTiming

from tests.app.fake_nvml import FakeNvml, NVMLError, mining_card
from tests.app.heartbeat import Heartbeat


def test_every_field_is_read_and_formatted():
    nv = FakeNvml([mining_card()])
    (r,) = tm.read_cards(nv, t=100.0)
    assert r.name == "NVIDIA P104-100"
    assert tm.fmt_power(r) == "88 W of 180 W"
    assert tm.fmt_temperature(r) == "64 °C"
    assert tm.fmt_fan(r) == "45 %"
    assert tm.fmt_clocks(r) == "SM 1582 MHz of 1911 · mem 5005 MHz"
    assert tm.throttle_words(r.throttle_bits) == "power cap, thermal (hardware)"
    assert tm.fmt_pcie(r) == "Gen1 x1 of Gen3 x16"
    assert tm.fmt_util(r) == "GPU 97 % · mem 41 %"
    assert r.energy_j == pytest.approx(5000.0)


def test_what_a_card_does_not_report_is_na_not_a_crash():
    nv = FakeNvml([mining_card(fan=None, energy_mj=None, limit_mw=None, throttle=None, gen_max=None,
                               width_max=None, sm_max=None, util_gpu=None)])
    (r,) = tm.read_cards(nv)
    assert tm.fmt_fan(r) == "n/a"
    assert r.energy_j is None
    assert tm.fmt_power(r) == "88 W"
    assert tm.throttle_words(r.throttle_bits) == "n/a"
    assert tm.fmt_pcie(r) == "Gen1 x1"
    assert tm.fmt_clocks(r) == "SM 1582 MHz · mem 5005 MHz"
    assert tm.fmt_util(r) == "GPU n/a · mem n/a"


def test_throttle_words():
    assert tm.throttle_words(0) == "none"
    assert tm.throttle_words(0x1) == "idle"
    assert tm.throttle_words(0x20 | 0x80) == "thermal (driver), power brake"
    assert tm.throttle_words(0x800 | 0x4) == "power cap, other (0x800)"
    assert tm.fmt_joules_per_token(None) == "n/a"
    assert tm.fmt_joules_per_token(2.345) == "2.35 J/token"
    assert tm.fmt_joules_per_token(12.34) == "12.3 J/token"


def _timing(submitted, wait, prefill, decode, tokens):
    return RequestTiming(request_id=1, kind="chat", submitted=submitted, queue_wait_s=wait,
                         prefill_s=prefill, time_to_first_token_s=wait + prefill, decode_s=decode,
                         prompt_tokens=10, generated_tokens=tokens, prefill_tokens_per_s=None,
                         decode_tokens_per_s=tokens / decode, finish_reason="stop")


def test_joules_per_token_from_the_energy_counter_and_from_power():
    # card 0 has an energy counter that rises 150 J/s; card 1 (Pascal) has none: 100 W integrated
    ledger = tm.EnergyLedger()
    for t in range(5):
        ledger.add([tm.CardReading(0, "a", float(t), power_w=999.0, energy_j=1000.0 + 150.0 * t),
                    tm.CardReading(1, "b", float(t), power_w=100.0)])
    assert ledger.complete
    assert ledger.joules_between(0.0, 4.0) == pytest.approx(4 * 250.0)
    assert ledger.energy_at(2.5) == pytest.approx(2.5 * 250.0)
    # picked up at 1.0, prefill 0.5 s, decode 1.5 s: window 1.0-3.0 = 500 J for 40 tokens
    assert ledger.joules_per_token(_timing(0.5, 0.5, 0.5, 1.5, 40)) == pytest.approx(12.5)
    # a window before the first sample, or nothing generated: no figure rather than a wrong one
    assert ledger.joules_per_token(_timing(-3.0, 0.5, 0.5, 1.5, 40)) is None
    assert ledger.joules_per_token(_timing(0.5, 0.5, 0.5, 1.5, 0)) is None


def test_a_counter_reset_falls_back_to_power_and_no_power_marks_partial():
    ledger = tm.EnergyLedger()
    ledger.add([tm.CardReading(0, "a", 0.0, power_w=50.0, energy_j=900.0)])
    ledger.add([tm.CardReading(0, "a", 2.0, power_w=70.0, energy_j=10.0)])  # driver reloaded
    assert ledger.total_j == pytest.approx(120.0)
    ledger.add([tm.CardReading(0, "a", 3.0)])
    assert not ledger.complete


def test_history_series_and_unknown_field():
    h = tm.TelemetryHistory(capacity=3)
    for t in range(5):
        h.add([tm.CardReading(0, "a", float(t), power_w=10.0 * t, temperature_c=None if t == 4 else 60)])
    assert h.series(0, "power_w") == ([2.0, 3.0, 4.0], [20.0, 30.0, 40.0])
    assert h.series(0, "temperature_c") == ([2.0, 3.0], [60.0, 60.0])
    with pytest.raises(ValueError, match="unknown telemetry field"):
        h.series(0, "volts")


def test_panel_polls_off_the_gui_thread_without_stalling(qtbot, tmp_path):
    from minecart.app.telemetry_panel import TelemetryPanel

    # a full mining rig: eight cards, one of them without a fan sensor or an energy counter
    nv = FakeNvml([mining_card(), mining_card(name="CMP 30HX", fan=None, energy_mj=None, gen=1,
                                              width=4, throttle=0)] + [mining_card() for _ in range(6)])
    metrics = Metrics()
    panel = TelemetryPanel(lambda: metrics, nvml=nv, interval_s=0.05)
    qtbot.addWidget(panel)
    panel.resize(560, 760)
    panel.show()
    with Heartbeat() as hb:
        panel.start()
        qtbot.waitUntil(lambda: len(panel.history.series(1, "power_w")[0]) >= 4, timeout=5000)
        # a reply generated inside the recorded window: the energy line shows its joules per token
        t0 = panel.ledger.points[0][0]
        t1 = panel.ledger.points[-1][0]
        metrics.record_request(_timing(t0, 0.0, 0.0, max(t1 - t0, 1e-3), 20))
        qtbot.waitUntil(lambda: panel.last_joules_per_token is not None, timeout=5000)
        qtbot.waitUntil(lambda: len(panel.cards) == 8, timeout=5000)  # built one by one
        qtbot.wait(200)
    panel.stop()
    assert not panel.poller.isRunning() and nv.shut_down
    assert threading.main_thread().name not in nv.calls_from
    assert hb.ticks > 20 and hb.max_gap_ms <= 50, f"GUI thread stalled {hb.max_gap_ms:.0f} ms"
    assert set(panel.cards) == set(range(8))
    card = panel.cards[1]
    assert card.values["PCIe"].text() == "Gen1 x4 of Gen3 x16"
    assert card.values["Fan"].text() == "n/a"
    assert panel.cards[0].values["Throttle"].text() == "power cap, thermal (hardware)"
    assert panel.cards[0].captions["temperature_c"].text() == "temp 64–64 °C"
    assert "J/token" in panel.energy.text() and "20 tokens" in panel.energy.text()
    panel.grab().save(str(tmp_path / "telemetry.png"))


def test_without_a_driver_the_strip_says_so(qtbot):
    from minecart.app.telemetry_panel import TelemetryPanel

    panel = TelemetryPanel(nvml=FakeNvml([], init_error=NVMLError("Driver Not Loaded")))
    qtbot.addWidget(panel)
    panel.start()
    qtbot.waitUntil(lambda: panel.status.text() == "no NVIDIA driver", timeout=5000)
    panel.stop()
    assert panel.cards == {}


def test_sparkline_keeps_its_window_and_breaks_at_gaps(qtbot):
    from minecart.app.telemetry_panel import Sparkline

    line = Sparkline("#ffffff", window_s=10.0, gap_s=2.5)
    qtbot.addWidget(line)
    xs = [0.0, 1.0, 2.0, 3.0, 4.0, 9.0, 10.0, 11.0, 12.0]  # NVML silent from 4 s to 9 s
    line.set_data(xs, [float(x) for x in xs])
    assert [[x for x, _ in run] for run in line.runs()] == [[2.0, 3.0, 4.0], [9.0, 10.0, 11.0, 12.0]]
    assert line.toolTip() == "last 12 s: 0 to 12"
    line.resize(200, 34)
    line.grab()  # paints without error, gaps included
    runs = [[(0.0, 9.0), (1.0, 11.0)]]
    assert Sparkline("#fff", 10.0, 2.5, min_span=40.0).y_range(runs) == (0.0, 40.0)  # noise stays flat
    assert Sparkline("#fff", 10.0, 2.5, min_span=4.0).y_range(runs) == (8.0, 12.0)
    assert Sparkline("#fff", 10.0, 2.5, min_span=4.0).y_range([[(0.0, 30.0), (1.0, 180.0)]]) == (30.0, 180.0)


def test_without_pynvml_installed_the_strip_says_so(qtbot, monkeypatch):
    from minecart.app.telemetry_panel import TelemetryPanel

    def missing():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(tm, "_import_pynvml", missing)
    panel = TelemetryPanel()
    qtbot.addWidget(panel)
    panel.start()
    qtbot.waitUntil(lambda: panel.status.text() == "no NVIDIA driver", timeout=5000)
    panel.stop()
    assert panel.energy.text() == "Energy per token: n/a"


def test_a_gpu_that_stops_answering_ends_polling_with_a_message(qtbot):
    from minecart.app.telemetry_panel import TelemetryPanel

    class LostGpu(FakeNvml):
        calls = 0

        def nvmlDeviceGetCount(self):
            self.calls += 1
            if self.calls > 2:
                raise NVMLError("GPU is lost")
            return 1

    nv = LostGpu([mining_card()])
    panel = TelemetryPanel(nvml=nv, interval_s=0.02)
    qtbot.addWidget(panel)
    panel.start()
    qtbot.waitUntil(lambda: panel.status.text() == "NVML stopped answering: GPU is lost", timeout=5000)
    qtbot.waitUntil(lambda: not panel.poller.isRunning(), timeout=5000)
    assert nv.shut_down and list(panel.cards) == [0]  # the last readings stay on screen
