"""minecart's desktop app (PySide6, pyqtgraph). Imports minecart.engine's public API only.

Importing this package applies the Qt-binding work-arounds in qt_compat (a PySide6 refcount bug that
otherwise aborts long sessions).
"""

from . import qt_compat  # noqa: F401  (side effect: binding work-arounds)
