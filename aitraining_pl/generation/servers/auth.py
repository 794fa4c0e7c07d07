"""Nobody but the run gets in: the token every route of a server this project starts requires, where a trainer and a
server find it (``find_token``, ``token_path``, ``server_token``), the loopback check (``is_loopback``,
``check_guarded``), and the watch that ends such a server when its trainer dies.

vLLM's dev-mode routes (``/collective_rpc``, ``/update_weights``, ``/pause``, ...) take no key, and ``--api-key``
guards only ``/v1/*``. ``TokenMiddleware`` is an ASGI middleware (vLLM's ``--middleware
aitraining_pl.generation.servers.auth.TokenMiddleware``; the HF server's app uses the same) that answers 401 to
every HTTP request without ``Authorization: Bearer <token>`` (the header OpenAI clients send for their
``api_key``), whatever the route: the run's token, read when the server starts from the owner-only file named by
``TOKEN_FILE_ENV``, else from ``TOKEN_ENV``. A server given neither refuses to start. The token is compared in
constant time and never printed.

**The parent watch.** A server started by a trainer (``generation.server: launch``) is told its trainer's pid
(``PARENT_ENV``) and its private folder (``FOLDER_ENV``: the config, the tokenizer and the token file). When the
trainer is gone (SIGKILL, the OOM killer: no ``atexit`` runs there), the server deletes that folder and stops itself
(SIGTERM, then ``os._exit`` after ``GRACE`` seconds) within about a second: ``watch_parent`` polls the parent from
the server's first instant (the launcher runs ``vllm serve`` under ``run_watched``; the HF server starts it first),
and Linux also sends the SIGTERM at once (``PR_SET_PDEATHSIG``, ``die_with_parent``), on which the folder is deleted
too (by this module's handler until the server installs its own, then at its exit)."""

from __future__ import annotations

import ctypes
import hmac
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from aitraining_pl.errors import ConfigError

#: the run's token itself (a server on another machine, a user-started ``vllm serve``)
TOKEN_ENV = "AITRAINING_PL_SERVER_TOKEN"
#: a file holding the token (what a launched server is given)
TOKEN_FILE_ENV = "AITRAINING_PL_SERVER_TOKEN_FILE"
#: the pid of the trainer that launched the server (the parent watch)
PARENT_ENV = "AITRAINING_PL_SERVER_PARENT"
#: the launched server's private folder, deleted when it stops
FOLDER_ENV = "AITRAINING_PL_SERVER_FOLDER"
#: seconds between two looks at the parent
POLL = 0.25
#: seconds a server has to stop after its parent died before it is ended without cleanup
GRACE = 10.0


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def write_token(path: str | os.PathLike, token: str) -> Path:
    """Write ``token`` to ``path``, readable by this user only (its folder made 0700 when new, the file 0600
    before a byte is written; a link in its place is refused)."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)  # a file left by an earlier server keeps its mode otherwise
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return path


def server_token() -> str:
    """The token a server requires: the file ``TOKEN_FILE_ENV`` names, else ``TOKEN_ENV``; a ``RuntimeError``
    line (naming the variables, never a token) when neither gives one."""
    source = os.environ.get(TOKEN_FILE_ENV)
    token = Path(source).read_text().strip() if source else os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise RuntimeError(
            f"aitraining_pl TokenMiddleware: no token (set {TOKEN_FILE_ENV} to the run's owner-only token file, or "
            f"{TOKEN_ENV}); the server refuses to start without one"
        )
    return token


def token_path(port: int) -> Path:
    """The owner-only file where ``vllm-serve`` on loopback ``port`` writes the token it generated (and where a
    trainer on this machine looks for it): under ``$XDG_RUNTIME_DIR/aitraining_pl`` (a per-user folder), else
    ``~/.cache/aitraining_pl``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) if runtime else Path.home() / ".cache"
    return folder / "aitraining_pl" / f"vllm-serve-{port}.token"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``, a name resolving there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def find_token(options: Any, setting: str = "generation.vllm.server_token_file") -> str | None:
    """The run's token for a server (``options``: a ``VLLMConfig``): the file ``options.server_token_file`` (a
    ``ConfigError`` naming ``setting`` when it cannot be read or is empty), else ``TOKEN_ENV``, else for a server on
    this machine the file ``aitraining-pl vllm-serve`` wrote (``token_path``), else None (a server without the
    middleware)."""
    if options.server_token_file:
        try:
            token = open(options.server_token_file).read().strip()
        except OSError as err:
            raise ConfigError(setting, f"cannot read the server token {options.server_token_file} "
                                       f"({err.strerror or err})") from None  # fmt: skip
        if not token:
            raise ConfigError(setting, f"the server token file {options.server_token_file} is empty")
        return token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    path = token_path(options.server_port)  # where ``aitraining-pl vllm-serve`` on this machine wrote its own
    return path.read_text().strip() or None if is_loopback(options.server_host) and path.is_file() else None


_warned_open: set[str] = set()


def check_guarded(url: str, allow: bool, setting: str = "generation.vllm") -> None:
    """Refuse a server at ``url`` that other machines can reach and that answers without a token (no
    ``TokenMiddleware``), unless ``allow`` (``allow_unauthenticated``); then warn once per URL."""
    if is_loopback(urlparse(url).hostname or ""):
        return
    import httpx

    try:
        open_door = httpx.get(f"{url}/collective_rpc", timeout=10.0).status_code != 401
    except httpx.TransportError:
        return  # unreachable: the first request says so
    if not open_door:
        return
    if not allow:
        raise ConfigError(
            f"{setting}.server_host",
            f"the server at {url} answers without a token and other machines can reach it: anyone there could push "
            "weights. Start it with --middleware aitraining_pl.generation.servers.auth.TokenMiddleware "
            f"and {TOKEN_ENV} (docs/vllm.md), or set {setting}.allow_unauthenticated: true",
        )
    if url not in _warned_open:
        _warned_open.add(url)
        warnings.warn(f"the generation server {url} takes requests without a token ({setting}.allow_unauthenticated)",
                      UserWarning, stacklevel=3)  # fmt: skip


class TokenMiddleware:
    """ASGI middleware: every HTTP request must carry ``Authorization: Bearer <the run's token>`` (see the module
    docstring); the others get ``401 {"error": "..."}``. Lifespan events pass through. Starting it starts the
    parent watch when ``PARENT_ENV`` is set."""

    def __init__(self, app: Any, token: str | None = None):
        self.app = app
        self.expected = ("Bearer " + (token or server_token())).encode()
        watch_parent()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "unauthorized: this server requires the run's token on every route"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


_watching = threading.Event()


def watch_parent() -> None:
    """Start (once per process) the thread that stops this server when the trainer ``PARENT_ENV`` names is gone
    (its parent changed or the pid no longer exists): the folder ``FOLDER_ENV`` is deleted, then SIGTERM, then
    ``os._exit`` after ``GRACE`` seconds. Also deletes that folder at a normal exit. Nothing without
    ``PARENT_ENV``."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or _watching.is_set():
        return
    _watching.set()
    import atexit

    atexit.register(remove_folder)
    if threading.current_thread() is threading.main_thread():  # until the server installs its own (uvicorn's)
        signal.signal(signal.SIGTERM, _terminated)
    threading.Thread(target=_watch, args=(int(parent),), name="aitraining-pl-parent-watch", daemon=True).start()


def _terminated(signum: int, frame: Any) -> None:
    remove_folder()
    raise SystemExit(128 + signum)


def remove_folder() -> None:
    """Delete the launched server's folder (``FOLDER_ENV``), if any."""
    folder = os.environ.get(FOLDER_ENV)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def parent_alive(parent: int) -> bool:
    """Whether ``parent`` is still this process's parent and alive."""
    if os.getppid() != parent:
        return False
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(parent: int) -> None:
    while parent_alive(parent):
        time.sleep(POLL)
    print(f"aitraining-pl server: the trainer (pid {parent}) is gone; stopping", file=sys.stderr, flush=True)
    remove_folder()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE)
    os._exit(1)


def die_with_parent() -> None:
    """A ``preexec_fn``: on Linux the child gets SIGTERM when the process that started it dies
    (``prctl(PR_SET_PDEATHSIG)``); elsewhere nothing (the parent watch still polls)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        except OSError:
            pass


def run_watched(argv: list[str]) -> None:
    """``python -m aitraining_pl.generation.servers.auth MODULE ARGS...``: run the module ``MODULE`` as
    ``__main__`` with ``ARGS`` after starting the parent watch, so that a launched ``vllm serve`` is watched from its
    first instant (its middleware is imported only once its engine is built)."""
    import runpy

    watch_parent()
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    run_watched(sys.argv[1:])
