"""A heartbeat QTimer that measures the GUI thread's longest stall while a test runs.

The timer ticks every 5 ms; the longest gap between two ticks is how long the event loop was blocked.
Use it around code that waits with qtbot (so the event loop runs): `with Heartbeat() as hb: ...`,
then `assert hb.max_gap_ms <= 50`. `max_busy_ms` is the longest CPU time the GUI thread itself spent
between two ticks (time.thread_time): the window's own work, without the time the thread sat
preempted, which on a loaded 2-core machine no code of the window can remove.
`Heartbeat(freeze=False)` leaves the garbage collector as the window set it (for tests of the window's
own gc.freeze); by default the heap is collected and frozen while the beat runs."""

from __future__ import annotations

import gc
import time

from PySide6.QtCore import QTimer


class Heartbeat:
    def __init__(self, interval_ms: int = 5, freeze: bool = True):
        self.freeze = freeze
        self.timer = QTimer()
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)
        self.max_gap_ms = 0.0
        self.max_busy_ms = 0.0
        self.ticks = 0
        self._last: float | None = None
        self._last_busy = 0.0

    def _tick(self) -> None:
        now, busy = time.perf_counter(), time.thread_time()
        if self._last is not None:
            self.max_gap_ms = max(self.max_gap_ms, (now - self._last) * 1000.0)
            self.max_busy_ms = max(self.max_busy_ms, (busy - self._last_busy) * 1000.0)
        self._last, self._last_busy = now, busy
        self.ticks += 1

    def __enter__(self) -> Heartbeat:
        # after earlier tests loaded real models, one full collection of that heap took 100-460 ms on
        # whichever thread triggered it (gc.callbacks in this suite): frozen, the beat times the code
        # under test, not the heap other tests left
        if self.freeze:
            gc.collect()
            gc.freeze()
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.stop()
        if self.freeze:
            gc.unfreeze()
