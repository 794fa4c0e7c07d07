"""The endpoint's FastAPI application: ``GET /v1/models`` and ``POST /v1/chat/completions``, every refusal an
OpenAI error body, a streamed answer as server-sent events. Imported only when an endpoint starts (FastAPI is the
``agents`` extra). No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations at run
time.

Limits: a body longer than ``MAX_BODY_BYTES`` is refused (413) while it is read, a body nested too deeply for the
JSON decoder gets a 400; the server (``server_config``) closes a connection that sends nothing for ``IDLE_TIMEOUT``
seconds, fresh ones included (uvicorn's keep-alive timeout only starts after a first response). ``raise_open_files``
lifts the process's soft limit of open files to its hard limit (as vLLM does), and the server holds at most
``connection_cap()`` connections at once: ``MAX_CONNECTIONS``, or fewer where the process may open fewer files (half
of what is left after ``RESERVED_FILES``: an episode's connection costs this process two descriptors, its agent's
end and the server's). A connection beyond the cap closes the oldest one that has not shown an episode's key (a
stranger's, or an idle fresh one), and itself when every other one has: a stranger's idle connections cannot take the
descriptors an episode's call needs."""

import itertools
import json

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from aitraining_pl.agents.protocol import RequestError, models_body, sse_lines

MAX_BODY_BYTES = 32 << 20
MAX_CONNECTIONS = 2048
IDLE_TIMEOUT = 10
#: descriptors left to everything else the process opens (model files, logs, pipes) when the cap is set from its limit
RESERVED_FILES = 256
_opened = itertools.count()


class IdleClosingProtocol(H11Protocol):
    """uvicorn's h11 protocol with the keep-alive timer armed as soon as a connection opens: a client that connects
    and sends nothing is dropped after ``timeout_keep_alive`` seconds; beyond ``max_connections`` open connections,
    the oldest one whose client never showed an episode's key (``keyed``: the peer addresses that did) is closed."""

    max_connections: int | None = None
    keyed: set = set()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self.opened, self.evicted = next(_opened), False
        if self.max_connections is not None:
            self._make_room()

    def _make_room(self) -> None:
        """Close connections, strangers' first and the oldest first, until at most ``max_connections`` are open."""
        live = [c for c in self.connections if not getattr(c, "evicted", False)]
        strangers = sorted((c for c in live if c.client not in self.keyed), key=lambda c: getattr(c, "opened", 0))
        for victim in (strangers or [self])[: max(0, len(live) - self.max_connections)]:
            victim.evicted = True
            victim.transport.close()

    def connection_lost(self, exc) -> None:
        self.keyed.discard(self.client)
        super().connection_lost(exc)


def raise_open_files(wanted: int = 65536) -> None:
    """Lift the soft ``RLIMIT_NOFILE`` towards ``wanted`` (at most the hard limit); nothing where it cannot."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed
        pass


def connection_cap(wanted: int | None = None) -> int:
    """The most connections the endpoint holds at once: ``wanted`` (default ``MAX_CONNECTIONS``), at most half of
    the process's soft ``RLIMIT_NOFILE`` left after ``RESERVED_FILES`` (a quarter of the limit where that is less),
    at least 16."""
    wanted = MAX_CONNECTIONS if wanted is None else wanted
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        return wanted
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(16, min(wanted, (soft - min(RESERVED_FILES, soft // 4)) // 2))


def server_config(app) -> uvicorn.Config:
    """The uvicorn configuration of the endpoint (see the module docstring): the open-files limit raised first, the
    connection cap below it; ``app.state.keyed_clients`` collects the peers that showed an episode's key."""
    raise_open_files()
    cap = connection_cap()
    app.state.keyed_clients = set()
    protocol = type("EndpointProtocol", (IdleClosingProtocol,), {"max_connections": cap,
                                                                  "keyed": app.state.keyed_clients})  # fmt: skip
    return uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", http=protocol,
        limit_concurrency=cap + 1, timeout_keep_alive=IDLE_TIMEOUT,  # uvicorn's 503 at cap + 1: never reached
        backlog=max(64, cap // 4),  # asyncio accepts up to this many at once, before any is closed: a small overshoot
    )  # fmt: skip


async def _body(request: Request) -> bytes:
    """The request body, read at most ``MAX_BODY_BYTES`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdecimal() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(413, f"the request body is more than {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise RequestError(413, f"the request body is more than {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
        parts.append(part)
    return b"".join(parts)


def _error(err: RequestError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _key(request: Request):
    """The episode key: the bearer token (``Authorization: Bearer <key>``, the OpenAI clients' API key)."""
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def build_app(endpoint) -> FastAPI:
    """The application of ``endpoint`` (an ``AgentEndpoint``)."""
    app = FastAPI(title="aitraining-pl agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return _error(RequestError(400, f"invalid request: {exc.errors()[:1]}"))

    @app.get("/v1/models")
    async def models():
        return models_body(endpoint.model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        key = _key(request)
        try:
            endpoint.check_key(key)  # refused before the body is read
            if request.client is not None:  # an episode's connection: closed last when connections run short
                getattr(app.state, "keyed_clients", set()).add((request.client.host, request.client.port))
            try:
                body = json.loads(await _body(request))
            except ValueError as err:
                raise RequestError(400, f"the request body is not JSON: {err}") from None
            except RecursionError:
                raise RequestError(400, "the request body is nested too deeply to decode") from None
            answer = await endpoint.complete(key, body)
            if isinstance(answer, list):  # stream: true
                return StreamingResponse(sse_lines(answer), media_type="text/event-stream")
            return answer
        except RequestError as err:
            return _error(err)
        except Exception as err:  # noqa: BLE001 - the sampler failed: an OpenAI-style 500
            return _error(RequestError(500, f"{type(err).__name__}: {err}", kind="server_error"))

    return app
