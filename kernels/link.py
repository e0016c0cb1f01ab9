"""Holding a stream for a simulated link's time (link.cu), for engine/rig.py's risers.

`hold(stream, seconds)` queues one single-thread kernel on `stream` that returns once `seconds` have
passed on the GPU's global timer: the next work on that stream (a split decode's next stage) starts
after the link's time, without a host wait. What this is not: a copy (the hidden state is copied by
the stages' graphs themselves) or a timer of anything.
"""

from __future__ import annotations

import numpy as np

from .build import get_kernel


def hold(stream, seconds: float) -> None:
    """Queue a wait of `seconds` (>= 0) on `stream` (a cupy Stream of the current device)."""
    ns = max(0, int(round(float(seconds) * 1e9)))
    with stream:
        get_kernel("link", "link_hold")((1,), (1,), (np.uint64(ns),))
