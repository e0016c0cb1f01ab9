"""Graphs that tell the truth: the live decode line breaks over idle time, the first running rate of
a reply (measured over a token or two) does not set the y axis, the legends sit outside the plots,
memory is in GiB, and a tile keeps its last value instead of going back to "—"."""

from __future__ import annotations

import math
import time

from minecart.app.graphs import GraphsPanel, with_gaps
from minecart.engine.metrics import Metrics, RequestTiming


def _panel(qtbot, m):
    panel = GraphsPanel(m, window_s=120, refresh_hz=10)
    qtbot.addWidget(panel)
    return panel


def _timing(now, decode, prefill=200.0):
    return RequestTiming(1, "chat", now - 1, 0.0, 0.2, 0.2, 0.8, 40, 20, prefill, decode, "stop")


def test_live_line_breaks_over_idle_time_and_outliers_do_not_set_the_axis(qtbot):
    m = Metrics(capacity=100)
    now = time.time()
    # two replies, 40 s apart; each starts with the rate over its first token
    for start in (now - 60, now - 20):
        for i, rate in enumerate((5500.0, 21.0, 22.0, 21.5, 22.5)):
            m.decode_tps_live.append(rate, start + 0.25 * i)
    m.record_request(_timing(now, 22.0))
    panel = _panel(qtbot, m)
    panel.tick()
    y = list(panel.curve_live.yData)
    assert 5500.0 not in y
    assert sum(1 for v in y if math.isnan(v)) == 1  # one break, between the two replies
    top = panel.speed.getPlotItem().getViewBox().viewRange()[1][1]
    assert 200 < top < 300  # the prefill point (200 tok/s) sets it, the 5,500 does not


def test_with_gaps_inserts_a_break_only_over_long_silences():
    x, y = with_gaps([0.0, 0.25, 0.5, 10.0, 10.25], [1, 2, 3, 4, 5])
    assert [v for v in y if not math.isnan(v)] == [1, 2, 3, 4, 5]
    assert math.isnan(y[3]) and 0.5 < x[3] < 10.0 and len(y) == 6


def test_legends_are_outside_the_plots_and_memory_is_in_gib(qtbot):
    m = Metrics(capacity=100)
    m.record_memory("cuda:0", 2 << 30, 8 << 30)
    panel = _panel(qtbot, m)
    panel.tick()
    for plot in (panel.speed, panel.memory):
        assert plot.getPlotItem().legend is None  # no legend box over the data
    assert panel.speed_legend.names == ["prefill (per reply)", "decode (per reply)", "decode (live)"]
    assert panel.memory_legend.names == ["cuda:0"]
    assert list(panel.memory_curves["cuda:0"].yData) == [2.0]
    assert "GiB" in panel.memory.getPlotItem().getAxis("left").labelText


def test_tiles_keep_the_last_value_once_data_exists(qtbot):
    m = Metrics(capacity=100)
    panel = _panel(qtbot, m)
    panel.tick()
    assert panel.tile_decode.value.text() == "—"  # nothing yet
    now = time.time()
    m.record_request(_timing(now, 25.0))
    m.record_request(RequestTiming(2, "completion", now, 0.0, 0.1, 0.1, 0.0, 40, 0, 300.0, None, "length"))
    panel.tick()
    assert panel.tile_decode.value.text() == "25.0 tok/s"
    assert panel.tile_prefill.value.text() == "300.0 tok/s"
    assert "—" not in panel.tile_ttft.value.text()


def test_decode_tile_shows_the_live_rate_while_a_reply_streams(qtbot):
    m = Metrics(capacity=100)
    now = time.time()
    for i, rate in enumerate((4000.0, 18.0, 19.0)):
        m.decode_tps_live.append(rate, now - 0.5 + 0.25 * i)
    panel = _panel(qtbot, m)
    panel.tick()
    assert panel.tile_decode.value.text() == "19.0 tok/s (live)"
