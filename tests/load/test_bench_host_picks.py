"""tools/bench_host_picks.py runs and prints a time for each of its picks (small vocabulary)."""

from __future__ import annotations

import re

from tools import bench_host_picks


def test_bench_host_picks_prints_every_time(capsys):
    assert bench_host_picks.main(["--vocab", "6000", "--cases", "3"]) == 0
    out = capsys.readouterr().out
    for name in ("pick_penalized", "pick_penalized, whole row", "draw_from_top", "top_logits, 1 row(s)",
                 "top_logits, 8 row(s)", "a whole row, top-k off"):
        assert re.search(rf"^{re.escape(name)}: \d+(\.\d)? us$", out, re.M), (name, out)
