"""Rig descriptions with named cards (engine/rig.py Rig.parse) and the card profiles behind them
(resources/gpu_profiles.json through engine/gpu_profiles.py)."""

from __future__ import annotations

import json
import time
from importlib import resources

import pytest
from minecart.engine import gpu_profiles
from minecart.engine.errors import DeviceError
from minecart.engine.placement import GiB, MiB
from minecart.engine.rig import LINKS, Rig

# the cards issue 14 names; every one needs a profile
ISSUE_CARDS = ["P104-100", "P106-100", "CMP 30HX", "CMP 40HX", "CMP 50HX", "CMP 70HX", "CMP 90HX", "CMP 100-210",
               "CMP 170HX", "GTX 1060", "GTX 1070", "GTX 1080 Ti", "RTX 2060", "RTX 2070", "RTX 2080",
               "RTX 2080 Ti", "RTX 3060", "RTX 3070", "RTX 3080", "RTX 3090", "RTX 4060", "RTX 4070", "RTX 4080",
               "RTX 4090"]


@pytest.mark.parametrize("name", ISSUE_CARDS)
def test_every_card_has_a_sourced_profile(name):
    p = gpu_profiles.card(name)
    assert p.memory_bytes >= 4 * GiB and p.bandwidth > 100e9 and p.fp32_flops > 1e12 and p.int8_ops > 1e12
    assert p.source and p.link in LINKS


def test_profile_numbers_follow_the_stated_rules():
    """The file says int8 = 4 x fp32 on sm_61/70/75/80 and 2 x on sm_86/89, unless measured."""
    doc = json.loads(resources.files("minecart.resources").joinpath("gpu_profiles.json").read_text())
    for c in doc["cards"]:
        if "measured" in c["source"]:
            continue
        factor = 2.0 if c["arch"] in ("sm_86", "sm_89") else 4.0
        assert c["int8_tops"] == pytest.approx(factor * c["fp32_tflops"], abs=0.06), c["name"]


def test_driver_names_find_their_profile():
    assert gpu_profiles.card("NVIDIA GeForce RTX 3090").name == "RTX 3090"
    assert gpu_profiles.card("NVIDIA CMP 100-210").name == "CMP 100-210"
    assert gpu_profiles.find("cmp100-210").name == "CMP 100-210"
    assert gpu_profiles.find("Tesla K80") is None
    with pytest.raises(DeviceError, match="known cards: P104-100"):
        gpu_profiles.card("Tesla K80")


def test_parse_cards_caps_and_links():
    rig = Rig.parse("cuda:0=P104-100@gen1x1,cuda:1=8GiB,cuda:2=P104-100/4GiB,cuda:3=CMP 100-210,cpu:0=64GiB")
    d0, d1, d2, d3, c0 = rig.devices
    assert (d0.card, d0.memory_cap, d0.link.name) == ("P104-100", 8 * GiB, "PCIe Gen1 x1")
    assert (d1.card, d1.memory_cap, d1.link, d1.speed) == ("", 8 * GiB, None, None)
    assert (d2.memory_cap, d2.link.name) == (4 * GiB, "PCIe Gen1 x4")  # the card's own link
    assert d3.link.name == "PCIe Gen1 x1" and d3.memory_cap == 16 * GiB  # the CMP 100-210 is locked to x1
    assert c0.memory_cap == 64 * GiB and c0.physical == "cpu:0"
    specs = rig.device_specs()
    assert specs[0].speed.bandwidth == pytest.approx(320.3e9) and specs[0].link is d0.link
    assert specs[0].label == "P104-100 on cuda:0" and specs[1].speed is None
    assert [d.physical for d in rig.devices[:4]] == ["cuda:0"] * 4  # all logical on one GPU by default


@pytest.mark.parametrize("text,words", [
    ("cuda:0=GTX 9999", "no profile for a card called"),
    ("cpu:0=P104-100", "CPU device"),
    ("cuda:0=8GiB@gen9x1", "link 'gen9x1' is not understood"),
    ("gpu0=8GiB", "rig device 'gpu0=8GiB' is not understood"),
    ("cuda:0=P104-100/lots", "memory size 'lots' is not understood"),
])
def test_parse_errors_say_what_to_write(text, words):
    with pytest.raises(DeviceError, match=words):
        Rig.parse(text)


def test_rates_and_sizes():
    from minecart.engine.rig import parse_bytes, parse_link

    assert parse_bytes("3500MiB") == 3500 * MiB
    assert parse_link("250MB/s+30us").seconds(250_000) == pytest.approx(1e-3 + 30e-6)
    assert LINKS["gen1x1"].seconds(0) == pytest.approx(20e-6)


# ---- a simulated link in a split decode step: charged on the streams, not on the host ----------------


class _StreamFake:
    """Stands in for a CUDA backend: graph_step launches (returns an event, never waits when told not
    to) with the link holds its graph would hold around its copies. Records the calls."""

    name = "fake"  # Backend.name

    def __init__(self):
        self.calls: list = []

    def graph_step(self, key, run, ids, positions, *, owner, watch=None, host_in=None, host_out=None,
                   after=None, wait=True, link_seconds=(0.0, 0.0), chained=False, pick=None):
        self.calls.append(("graph", after, tuple(round(x, 9) for x in link_seconds)))
        return ("graph done", key) if host_out is not None and not wait else "logits"


def test_graph_step_charges_the_link_inside_the_graphs_without_a_host_wait():
    import numpy as np

    rig = Rig.logical("cuda:0", [None, None], link="1MB/s+100us", backend_factory=lambda phys: _StreamFake())
    a, b = rig.backend("cuda:0"), rig.backend("cuda:1")
    buf = np.zeros((1, 1024), np.float32)  # 4 KiB: 4.196 ms at 1 MB/s + 100 us
    link_s = 100e-6 + 4096 / 1e6
    t0 = time.perf_counter()
    ev = a.graph_step("s0", None, [1], [0], owner=[], host_out=buf, wait=False)
    out = b.graph_step("s1", None, [1], [0], owner=[], host_in=buf, after=ev)
    assert time.perf_counter() - t0 < link_s  # two link times charged, none waited for on the host
    # the sender's graph holds its link after its copy out; its event is what the receiver follows
    assert a.inner.calls == [("graph", None, (0.0, round(link_s, 9)))]
    assert ev == ("graph done", "s0")
    # the receiver's graph holds its link before its copy in
    assert b.inner.calls == [("graph", ("graph done", "s0"), (round(link_s, 9), 0.0))]
    assert out == "logits"
    assert a.transferred_bytes == b.transferred_bytes == 4096
    assert a.transfer_seconds == pytest.approx(link_s) and b.transfer_seconds == pytest.approx(link_s)


def test_graph_step_without_a_link_or_hidden_state_is_the_real_backends():
    rig = Rig.logical("cuda:0", [None], backend_factory=lambda phys: _StreamFake())
    be = rig.backend("cuda:0")
    assert be.graph_step("s", None, [1], [0], owner=[], after="e") == "logits"
    assert be.inner.calls == [("graph", "e", (0.0, 0.0))] and be.transferred_bytes == 0
