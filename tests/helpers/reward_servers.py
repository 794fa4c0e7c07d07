"""Shared by the remote-reward tests (``remote_rewards/test_reward_server.py``, ``test_judge_reward.py``): an
HTTP server on a free loopback port, served from a thread, whose paths answer with test functions and which counts
and records every request (headers and JSON body) it gets."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Hit:
    """One request as the server saw it: its path, its attempt number on that path (0 first), headers and body."""

    path: str
    attempt: int
    headers: dict[str, str]
    body: Any


#: a route: the request -> (HTTP status, JSON-able answer or bytes sent as they are[, extra response headers])
Route = Callable[[Hit], tuple]


class LoopbackServer:
    """A ``ThreadingHTTPServer`` on ``127.0.0.1:0`` answering POSTs with ``routes[path]``; ``release`` is set when the
    server closes, so a route that waits on it (a server that does not answer) ends then."""

    def __init__(self, routes: dict[str, Route]):
        self.routes, self.hits = routes, []
        self.release, self._changed = threading.Event(), threading.Condition()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with owner._changed:
                    attempt = sum(hit.path == self.path for hit in owner.hits)
                    hit = Hit(self.path, attempt, dict(self.headers.items()), json.loads(raw or b"null"))
                    owner.hits.append(hit)
                    owner._changed.notify_all()
                status, answer, *extra = owner.routes[self.path](hit)
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for name, value in (extra[0] if extra else {}).items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (a timeout test)
                    pass

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def count(self, path: str) -> int:
        """Requests received on ``path`` so far."""
        with self._changed:
            return sum(hit.path == path for hit in self.hits)

    def wait_for(self, path: str, count: int, timeout: float = 30.0) -> int:
        """The number of requests on ``path`` once it reaches ``count`` (or after ``timeout`` seconds)."""
        with self._changed:
            self._changed.wait_for(lambda: sum(hit.path == path for hit in self.hits) >= count, timeout)
        return self.count(path)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
