"""Work-arounds for bugs in the Qt binding, applied once when minecart.app is imported.

PySide6 6.12.0 on CPython < 3.12: `Signal.emit()` returns `True` without taking a reference, so every
emit made from Python (ours, and pyqtgraph's `sigPlotChanged` on each `setData`) drops one reference to
`True`; some pyqtgraph paths lose references to `None` the same way. After a few thousand live-graph
updates CPython aborts with "Fatal Python error: bool_dealloc" (or "none_dealloc"). We measure the leak
with a throw-away signal and, only if it is there, give `True`, `False` and `None` a very large
reference count, which makes them immortal as they already are on CPython 3.12+. Nothing else changes.
"""

from __future__ import annotations

import ctypes
import sys

# Enough references for ~10^15 leaked emits; far from overflowing a Py_ssize_t.
_BOOST = 1 << 50


def emit_leaks_bool() -> bool:
    """True when emitting a Python-side signal loses a reference to True (the PySide6 6.12 bug)."""
    from PySide6.QtCore import QObject, Signal

    class _Probe(QObject):
        ping = Signal()

    probe = _Probe()
    before = sys.getrefcount(True)
    for _ in range(8):
        probe.ping.emit()
    return sys.getrefcount(True) < before


def protect_bool_refcounts() -> bool:
    """Apply the work-around if the running binding needs it; returns whether it was applied."""
    if sys.implementation.name != "cpython" or sys.version_info >= (3, 12):
        return False  # bools are immortal there; a lost decref is harmless
    try:
        if not emit_leaks_bool():
            return False
    except Exception:
        return False
    for obj in (True, False, None):
        # ob_refcnt is the first field of every CPython object, at the object's address
        ctypes.c_ssize_t.from_address(id(obj)).value += _BOOST
    return True


APPLIED = protect_bool_refcounts()
