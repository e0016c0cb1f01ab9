"""Card profiles: the size and speed of the common mining and gaming cards, for planning without them.

What this is: the reader of resources/gpu_profiles.json (every number there names its source) and a
lookup by the names people and drivers use ("P104-100", "NVIDIA CMP 100-210", "GeForce RTX 3060").
A profile gives engine/placement.py what its speed prediction needs (`DeviceSpeed`), the card's memory
and its own PCIe link.

What this is not: a measurement. A card that is present is measured by its probe (kernels/probe.py);
these figures are vendor/database specs except where a profile's source says measured.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from .errors import DeviceError
from .placement import DeviceSpeed, GiB

FORMAT = "minecart.gpu_profiles"


@dataclass(frozen=True)
class CardProfile:
    """One card of resources/gpu_profiles.json."""

    name: str
    arch: str
    memory_bytes: int
    bandwidth: float  # bytes/s
    fp32_flops: float
    int8_ops: float
    link: str  # a key of engine/rig.py LINKS
    source: str
    note: str = ""
    aliases: tuple[str, ...] = ()

    @property
    def speed(self) -> DeviceSpeed:
        return DeviceSpeed(self.name, self.bandwidth, self.int8_ops, self.fp32_flops,
                           f"profile {self.name}: {self.source}")


def _key(name: str) -> str:
    """Lookup key: lower case, vendor words and punctuation dropped ("NVIDIA GeForce GTX 1080 Ti" ->
    "gtx1080ti", "cmp 100-210" -> "cmp100210")."""
    k = name.lower()
    for word in ("nvidia", "geforce"):
        k = k.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", k)


@lru_cache(maxsize=1)
def profiles() -> dict[str, CardProfile]:
    """Every profile by lookup key (names and aliases)."""
    text = resources.files("minecart.resources").joinpath("gpu_profiles.json").read_text(encoding="utf-8")
    doc = json.loads(text)
    if doc.get("format") != FORMAT:
        raise DeviceError(f"resources/gpu_profiles.json is not a {FORMAT} file; reinstall minecart")
    out: dict[str, CardProfile] = {}
    for c in doc["cards"]:
        p = CardProfile(name=c["name"], arch=c["arch"], memory_bytes=int(round(float(c["memory_gib"]) * GiB)),
                        bandwidth=float(c["bandwidth_gbs"]) * 1e9, fp32_flops=float(c["fp32_tflops"]) * 1e12,
                        int8_ops=float(c["int8_tops"]) * 1e12, link=c["link"], source=c["source"],
                        note=c.get("note", ""), aliases=tuple(c.get("aliases", ())))
        for n in (p.name, *p.aliases):
            out[_key(n)] = p
    return out


def find(name: str) -> CardProfile | None:
    """The profile of a card name, or None."""
    return profiles().get(_key(name))


def card(name: str) -> CardProfile:
    """The profile of a card name; DeviceError listing the known cards when there is none."""
    p = find(name)
    if p is None:
        known = ", ".join(dict.fromkeys(q.name for q in profiles().values()))
        raise DeviceError(f"no profile for a card called '{name}'; known cards: {known}. Give its memory "
                          f"instead (e.g. cuda:0=8GiB)")
    return p
