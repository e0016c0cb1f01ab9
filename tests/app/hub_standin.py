"""A local stand-in for the few Hugging Face Hub endpoints the Download panel uses, on 127.0.0.1:

- GET /api/models?search=...           model search (JSON list of {"id": ...})
- GET /api/models/{owner}/{name}/tree/{revision}[/{path}]?recursive=...   file listing with LFS sha256
- GET /{owner}/{name}/resolve/{revision}/{path}   the file, honouring "Range: bytes=A-" and "bytes=A-B"
  with a 206

Unknown repositories answer 404 with X-Error-Code: RepoNotFound, as the Hub does. `delay_s` sleeps
between 64 KiB pieces so a test can cancel mid-download; `ranges` records every Range header."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

PIECE = 64 * 1024


class HubStandIn:
    def __init__(self, repos: dict[str, dict[str, bytes]], delay_s: float = 0.0):
        self.repos = repos
        self.delay_s = delay_s
        self.ranges: list[str | None] = []
        self.sha_override: dict[str, str] = {}  # path -> the sha256 the listing claims
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, obj, status=200, headers=()):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in headers:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _not_found(self):
                self._json({"error": "Repository not found"}, 404, [("X-Error-Code", "RepoNotFound")])

            def do_GET(self):
                u = urlparse(self.path)
                parts = [unquote(p) for p in u.path.strip("/").split("/")]
                if parts[:2] == ["api", "models"] and len(parts) == 2:
                    q = parse_qs(u.query).get("search", [""])[0].lower()
                    self._json([{"id": r, "modelId": r, "tags": ["gguf"]} for r in hub.repos
                                if q in r.lower()])
                elif parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                    repo = "/".join(parts[2:4])
                    if repo not in hub.repos:
                        return self._not_found()
                    listing = [{"type": "file", "path": p, "size": len(data), "oid": "0" * 40,
                                "lfs": {"oid": hub.sha_override.get(p, hashlib.sha256(data).hexdigest()),
                                        "size": len(data), "pointerSize": 134}}
                               for p, data in hub.repos[repo].items()]
                    self._json(listing)
                elif len(parts) >= 5 and parts[2] == "resolve":
                    repo, path = "/".join(parts[:2]), "/".join(parts[4:])
                    data = hub.repos.get(repo, {}).get(path)
                    if data is None:
                        return self._not_found()
                    self._send_file(data)
                else:
                    self._json({"error": f"not in the stand-in: {u.path}"}, 404)

            def _send_file(self, data: bytes):
                rng = self.headers.get("Range")
                hub.ranges.append(rng)
                start, end = 0, len(data)  # end exclusive
                if rng and rng.startswith("bytes="):
                    first, _, last = rng[6:].partition("-")
                    start = int(first)
                    end = min(len(data), int(last) + 1) if last else len(data)
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(end - start))
                self.end_headers()
                try:
                    for i in range(start, end, PIECE):
                        self.wfile.write(data[i:min(i + PIECE, end)])
                        self.wfile.flush()
                        if hub.delay_s:
                            time.sleep(hub.delay_s)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client cancelled

        return Handler
