"""The per-card probe's choice among DP4A, fp32 FMA and fp16 HFMA2 (kernels/probe.py `choose_fastest`),
with made-up timings, and the probe cache's record format (engine/probe_cache.py). No GPU needed."""

from __future__ import annotations

import json

import pytest
from minecart.engine import probe_cache
from minecart.kernels import probe

US = 1e-6


def test_fastest_wins():
    times = {"dp4a": 30 * US, "fma": 45 * US, "hfma2": 25 * US}
    errs = {"dp4a": 4e-3, "fma": 0.0, "hfma2": 1e-3}
    assert probe.choose_fastest(times, errs) == "hfma2"
    times["hfma2"] = 31 * US
    assert probe.choose_fastest(times, errs) == "dp4a"


@pytest.mark.parametrize("card,times,want", [
    # Pascal consumer: fp16 at 1/64 rate, DP4A full rate
    ("GTX 1080 Ti", {"dp4a": 300, "dp4a2": 280, "fma": 900, "hfma2": 30000}, "dp4a2"),
    # a CMP with DP4A and FMA throttled but full-rate fp16
    ("CMP 50HX", {"dp4a": 5000, "dp4a2": 5200, "fma": 4000, "hfma2": 900}, "hfma2"),
    # DP4A throttled, fp16 not faster than fp32
    ("CMP 30HX", {"dp4a": 5000, "dp4a2": 5200, "fma": 1500, "hfma2": 1600}, "fma"),
])
def test_cards(card, times, want):
    errs = {p: (0.0 if p == "fma" else 2e-3) for p in times}
    assert probe.choose_fastest({p: t * US for p, t in times.items()}, errs) == want, card


def test_failed_or_wrong_variants_are_excluded():
    times = {"dp4a": 30 * US, "fma": 45 * US, "hfma2": 10 * US}
    # hfma2 numerically wrong on this card (rel err above 5e-2): not used however fast
    assert probe.choose_fastest(times, {"dp4a": 4e-3, "fma": 0.0, "hfma2": 0.2}) == "dp4a"
    # NaN error, or a variant that raised (time None, error unknown)
    assert probe.choose_fastest(times, {"dp4a": 4e-3, "fma": 0.0, "hfma2": float("nan")}) == "dp4a"
    assert probe.choose_fastest({"dp4a": None, "fma": 45 * US, "hfma2": None}, {"fma": 0.0}) == "fma"
    # nonsense timings
    assert probe.choose_fastest({"dp4a": 0.0, "fma": float("inf"), "hfma2": 50 * US},
                                {"dp4a": 0.0, "fma": 0.0, "hfma2": 1e-3}) == "hfma2"
    # nothing usable: the fp32 reference kernel
    assert probe.choose_fastest({"dp4a": None, "hfma2": None}, {}) == "fma"
    assert probe.SANITY_REL_ERR == pytest.approx(5e-2)


def test_candidates():
    assert set(probe.GEMV_PATHS) == {"dp4a", "fma", "hfma2"}
    assert set(probe.GEMM_PATHS) == {"dp4a", "dp4a2", "fma", "hfma2"}


def test_record_summary_shows_all_timings(tmp_path, monkeypatch):
    monkeypatch.setenv("MINECART_CACHE_DIR", str(tmp_path))
    rec = {"name": "CMP 50HX", "gemv": "hfma2", "gemm": "hfma2",
           "gemv_us": {"dp4a": 120.0, "fma": 95.0, "hfma2": 40.0},
           "gemm_us": {"dp4a": 5000.0, "dp4a2": 5200.0, "fma": 4000.0, "hfma2": 900.0},
           "gemv_err": {"dp4a": 4e-3, "fma": 0.0, "hfma2": 1e-3}, "dp4a_throttled": True}
    probe_cache.save("GPU-50hx", rec)
    line = probe_cache.summary_for("GPU-50hx")
    assert "decode path hfma2 (dp4a 120 us, fma 95 us, hfma2 40 us)" in line
    assert "prefill path hfma2 (dp4a 5000 us, dp4a2 5200 us, fma 4000 us, hfma2 900 us)" in line
    assert "DP4A throttled" in line


def test_version_1_records_are_probed_again(tmp_path, monkeypatch):
    """Records written before the HFMA2 path (version 1: DP4A / FMA only) read as absent, so the
    backend probes the card again, three-way."""
    monkeypatch.setenv("MINECART_CACHE_DIR", str(tmp_path))
    old = {"GPU-old": {"name": "GTX 1080", "gemv": "dp4a", "gemm": "dp4a", "version": 1,
                       "gemv_us": {"dp4a": 30.0, "fma": 60.0}}}
    (tmp_path / probe_cache.FILE_NAME).write_text(json.dumps(old))
    assert probe_cache.get("GPU-old") is None
    assert probe_cache.summary_for("GPU-old") == ""
    probe_cache.save("GPU-new", {"name": "x", "gemv": "fma", "gemm": "fma"})
    assert probe_cache.get("GPU-new")["version"] == probe_cache.VERSION >= 2


def test_kquant_stage_in_summary_and_version_2_reprobed(tmp_path, monkeypatch):
    """A record with the K-quants' own prefill stage depth shows it; records from before it (version
    2) read as absent, so a card that runs DP4A prefills is probed again and gets the pick."""
    monkeypatch.setenv("MINECART_CACHE_DIR", str(tmp_path))
    v2 = {"GPU-h100": {"name": "H100", "gemv": "dp4a", "gemm": "dp4a2", "version": 2}}
    (tmp_path / probe_cache.FILE_NAME).write_text(json.dumps(v2))
    assert probe_cache.get("GPU-h100") is None
    probe_cache.save("GPU-h100", {"name": "H100", "gemv": "dp4a", "gemm": "dp4a2", "gemm_kquant": "dp4a",
                                  "gemm_kquant_us": {"dp4a": 480.0, "dp4a2": 496.0}})
    line = probe_cache.summary_for("GPU-h100")
    assert "prefill path dp4a2;" in line and "K-quant prefill path dp4a (dp4a 480 us, dp4a2 496 us)" in line

