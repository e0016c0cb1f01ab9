"""The server switch: start and stop the OpenAI-compatible HTTP API (engine/server.py) from the window, over
the app's own Runtime, so other programs can use the model the window has loaded. "Requests at once" is
the runtime's parallelism while it serves (Runtime.set_parallel: that many generations batched together,
this window's chat among them, instead of one after another); it stays when the server stops, so a reply
being written is never cut off by the switch.

`ApiServer` is the plain part: it builds `create_app(runtime)`, wraps it in a counter of API requests and
runs it on a `ServerThread`. `ServerPanel` is the widget: port, this computer or the network, an optional
API key (a warning while the network may use it without one), a Start/Stop toggle, the URL and a live
request count. Starting and stopping run on a Python thread (uvicorn's start-up and shutdown wait
for sockets), so the GUI thread never waits on them; a busy port comes back as a sentence, not a trace.

Not here: the routes, the runtime or any model logic (engine/server.py, engine/runtime.py).
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from pathlib import Path

from minecart.engine.runtime import Runtime
from minecart.engine.server import ServerThread, create_app
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

DEFAULT_PORT = 8080
DEFAULT_PARALLEL = 1  # generations batched at once while serving (engine/scheduler.py): each holds its own KV cache
MAX_PARALLEL = 32  # the largest batch the GPU's batched decode graphs are measured at


class RequestCounter:
    """Plain ASGI wrapper that counts HTTP requests to the API routes (/v1/...)."""

    def __init__(self, app):
        self.app = app
        self.count = 0
        self._lock = threading.Lock()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            with self._lock:
                self.count += 1
        await self.app(scope, receive, send)


def port_error_text(host: str, port: int, exc: OSError) -> str:
    if exc.errno in (errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", -1)):
        return (f"Port {port} on {host} is already in use (another server, or a second minecart). "
                "Pick another port or stop the other program.")
    if exc.errno in (errno.EACCES, getattr(errno, "WSAEACCES", -1)):
        return f"Not allowed to listen on port {port}: ports below 1024 need administrator rights."
    return f"Cannot listen on {host}:{port}: {exc.strerror or exc}"


class ApiServer:
    """One HTTP API over `runtime`; `start()` raises OSError with a readable message on a busy port.
    parallel: the generations the runtime runs at once while serving (set when the server starts)."""

    def __init__(self, runtime: Runtime, host: str = "127.0.0.1", port: int = DEFAULT_PORT, api_key: str = "",
                 parallel: int = 1):
        self.runtime = runtime
        self.host = host
        self.port = int(port)
        self.api_key = api_key
        self.parallel = int(parallel)  # Runtime.set_parallel refuses less than 1
        self.counter: RequestCounter | None = None
        self._thread: ServerThread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def url(self) -> str:
        return self._thread.url if self._thread is not None else ""

    @property
    def request_count(self) -> int:
        return self.counter.count if self.counter is not None else 0

    def start(self) -> str:
        if self._thread is not None:
            return self.url
        # queued in order with the runtime's requests (after a reply being written, before the API's
        # first), not waited for here
        self.runtime.set_parallel(self.parallel)
        self.counter = RequestCounter(create_app(self.runtime, listen_host=self.host,
                                                 api_key=self.api_key or None))
        try:
            thread = ServerThread(self.counter, host=self.host, port=self.port)
        except OSError as exc:
            raise OSError(exc.errno, port_error_text(self.host, self.port, exc)) from exc
        thread.start()
        self._thread = thread
        return thread.url

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()


class ServerPanel(QWidget):
    """Start/stop the API from the window. `runtime()` returns the app's Runtime (None: engine failed)."""

    state_changed = Signal(bool, str)  # running, url or error text
    _done = Signal(bool, str)  # from the start/stop thread to the GUI thread

    def __init__(self, runtime: Callable[[], Runtime | None], parent=None):
        super().__init__(parent)
        self._runtime = runtime
        self.server: ApiServer | None = None
        self._busy = False
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 12, 16, 12)
        lay.setSpacing(10)
        card = QFrame()
        card.setObjectName("Card")
        cl = QVBoxLayout(card)
        cl.setContentsMargins(14, 12, 14, 12)
        cl.setSpacing(8)
        title = QLabel("OpenAI-compatible API")
        title.setObjectName("SectionTitle")
        cl.addWidget(title)
        hint = QLabel("Serves the model loaded in this window to other programs: any OpenAI client, "
                      "with the base URL below and the API key set here (any key when none is set).")
        hint.setObjectName("Subtle")
        hint.setWordWrap(True)
        cl.addWidget(hint)
        row = QHBoxLayout()
        row.addWidget(QLabel("Port"))
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setValue(DEFAULT_PORT)
        row.addWidget(self.port)
        self.network = QCheckBox("Reachable from other computers")
        self.network.setToolTip("Listen on all network interfaces (0.0.0.0) instead of this computer only")
        self.network.toggled.connect(self._warn_open)
        row.addWidget(self.network)
        self.api_key = QLineEdit()
        self.api_key.setPlaceholderText("API key (optional)")
        self.api_key.setToolTip("When set, clients must send it ('Authorization: Bearer KEY', the "
                                "openai client's api_key)")
        self.api_key.textChanged.connect(self._warn_open)
        row.addWidget(self.api_key, 1)
        row.addStretch(1)
        self.toggle = QPushButton("Start server")
        self.toggle.setObjectName("Primary")
        self.toggle.clicked.connect(self.toggle_server)
        row.addWidget(self.toggle)
        cl.addLayout(row)
        row = QHBoxLayout()
        row.addWidget(QLabel("Requests at once"))
        self.parallel = QSpinBox()
        self.parallel.setRange(1, MAX_PARALLEL)
        self.parallel.setValue(DEFAULT_PARALLEL)
        self.parallel.setToolTip("Generations run together while the server is on (this window's chat "
                                 "included): they share each decode step instead of waiting for one "
                                 "another; more requests wait in a queue. Each one holds a KV cache for "
                                 "the whole context, and the layer map's plan is made for one: raise this "
                                 "where the cards have memory left, or lower the context.")
        row.addWidget(self.parallel)
        note = QLabel("more than one: requests share each decode step; each holds its own KV cache")
        note.setObjectName("Subtle")
        row.addWidget(note)
        row.addStretch(1)
        cl.addLayout(row)
        self.url = QLabel("Stopped")
        self.url.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        cl.addWidget(self.url)
        self.count = QLabel("")
        self.count.setObjectName("Subtle")
        cl.addWidget(self.count)
        self.warning = QLabel("Anyone on your network could use the model: set an API key.")
        self.warning.setObjectName("WarnText")
        self.warning.setVisible(False)
        cl.addWidget(self.warning)
        self.error = QLabel("")
        self.error.setObjectName("ErrorText")
        self.error.setWordWrap(True)
        cl.addWidget(self.error)
        lay.addWidget(card)
        lay.addStretch(1)
        self._timer = QTimer(self)
        self._timer.setInterval(500)
        self._timer.timeout.connect(self._show_count)
        self._done.connect(self._finished)

    @property
    def running(self) -> bool:
        return self.server is not None and self.server.running

    def toggle_server(self) -> None:
        if self._busy:
            return
        if self.running:
            self.stop_server()
        else:
            self.start_server()

    def start_server(self) -> None:
        runtime = self._runtime()
        if runtime is None:
            self._show_error("The engine did not start, so there is nothing to serve.")
            return
        host = "0.0.0.0" if self.network.isChecked() else "127.0.0.1"
        self.server = ApiServer(runtime, host, self.port.value(), self.api_key.text().strip(),
                                parallel=self.parallel.value())
        self._run_off_thread(self.server.start, "Starting…")

    def stop_server(self) -> None:
        if self.server is not None:
            self._run_off_thread(self.server.stop, "Stopping…")

    def _warn_open(self, *_) -> None:
        self.warning.setVisible(self.network.isChecked() and not self.api_key.text().strip())

    def _run_off_thread(self, job: Callable, label: str) -> None:
        self._busy = True
        self.toggle.setEnabled(False)
        for w in (self.port, self.network, self.api_key, self.parallel):
            w.setEnabled(False)
        self.error.setText("")
        self.url.setText(label)

        def work():
            try:
                job()
                self._done.emit(True, "")
            except OSError as exc:  # ApiServer.start words a busy port in strerror
                self._done.emit(False, exc.strerror or str(exc))
            except Exception as exc:  # noqa: BLE001 - shown to the person, the window keeps running
                self._done.emit(False, f"The server failed: {exc}")

        threading.Thread(target=work, name="minecart-serve-switch", daemon=True).start()

    def _finished(self, ok: bool, error: str) -> None:
        self._busy = False
        self.toggle.setEnabled(True)
        running = self.running
        for w in (self.port, self.network, self.api_key, self.parallel):
            w.setEnabled(not running)
        self.toggle.setText("Stop server" if running else "Start server")
        self.toggle.setObjectName("Danger" if running else "Primary")
        self.toggle.style().polish(self.toggle)
        if running:
            self.url.setText(f"Serving at {self.server.url}/v1")
            self._timer.start()
            self._show_count()
        else:
            self._timer.stop()
            self.url.setText("Stopped")
        if not ok:
            self._show_error(error)
        self.state_changed.emit(running, self.server.url if running else error)

    def _show_error(self, text: str) -> None:
        self.error.setText(text)

    def _show_count(self) -> None:
        n = self.server.request_count if self.server is not None else 0
        info = self.server.runtime.model_info if self.server is not None else None
        model = f"model {Path(info.path).stem}" if info is not None else "no model loaded yet"
        self.count.setText(f"{n} API request{'s' if n != 1 else ''} served · {model}")

    def shutdown(self) -> None:
        """Stop the server (window closing); waits for uvicorn to let go of the port."""
        self._timer.stop()
        if self.server is not None:
            self.server.stop()


__all__ = ["ApiServer", "RequestCounter", "ServerPanel", "port_error_text"]
