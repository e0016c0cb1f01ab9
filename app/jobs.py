"""`Job`: one long piece of work on its own QThread, with throttled progress, cancel and the outcome as
signals, so the GUI thread only starts it and reacts.

The work is a plain function `work(progress, cancel)`: it calls `progress(done, total)` as often as it
likes (the GUI hears at most ten times a second, and always the last call), checks `cancel` (a
threading.Event) and returns a result or raises. An exception of one of `cancel_types` becomes
`cancelled`; one of `error_types` becomes `failed` with its message as written (they are meant for a
person); anything else becomes `failed` with its type named.

Not here: what the work is (downloads, conversation search: their own modules).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from PySide6.QtCore import QThread, Signal

PROGRESS_INTERVAL_S = 0.1


class Job(QThread):
    progress = Signal(object, object)  # done, total: byte counts pass 2 GiB, so not int
    finished_ok = Signal(object)
    failed = Signal(str)
    cancelled = Signal()

    def __init__(self, work: Callable, *, cancel_types: tuple = (), error_types: tuple = (),
                 parent=None):
        super().__init__(parent)
        self.work = work
        self.cancel = threading.Event()
        self.cancel_types = tuple(cancel_types)
        self.error_types = tuple(error_types)
        self._last_emit = 0.0

    def _progress(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last_emit >= PROGRESS_INTERVAL_S or done >= total:
            self._last_emit = now
            self.progress.emit(done, total)

    def run(self) -> None:
        try:
            result = self.work(self._progress, self.cancel)
        except Exception as exc:  # noqa: BLE001 - every outcome becomes a signal, never a crash
            if self.cancel_types and isinstance(exc, self.cancel_types):
                self.cancelled.emit()
            elif self.error_types and isinstance(exc, self.error_types):
                self.failed.emit(str(exc))
            else:
                self.failed.emit(f"{type(exc).__name__}: {exc}")
            return
        self.finished_ok.emit(result)


__all__ = ["Job"]
