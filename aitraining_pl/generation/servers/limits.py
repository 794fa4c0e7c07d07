"""The HF server's bounds on what one request may cost (issue 52), with their defaults (``hf_routes``' flags): a body
of at most ``MAX_BODY_MB`` MiB, refused with 413 while it is read (``BodyLimit``: the agent endpoint's bound, as
ASGI middleware); at most ``MAX_PROMPTS`` prompts in one ``/v1/completions`` request and ``MAX_SAMPLES`` sampled
responses (prompts x ``n``), refused with 400 (``check_batch``); and a validation error (422) whose body is JSON
even when the request held NaN (``invalid_request``: FastAPI's own handler cannot serialise NaN and answers 500)."""

from __future__ import annotations

import json
from typing import Any

#: the largest request body, in MiB (the agent endpoint's ``MAX_BODY_BYTES``)
MAX_BODY_MB = 32
#: the most prompts one completion request may list
MAX_PROMPTS = 1024
#: the most responses one completion request may ask for (prompts x n)
MAX_SAMPLES = 4096


async def json_reply(send: Any, status: int, message: str) -> None:
    """Answer an ASGI request with ``status`` and ``{"error": message}`` (a middleware's refusal)."""
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: a request body longer than ``max_bytes`` gets 413 (from its ``Content-Length`` at once, else
    once that many bytes have come), before the app parses any of it; a shorter one is handed on whole."""

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_MB << 20, option: str = "--max_body_mb"):
        self.app, self.max_bytes, self.option = app, int(max_bytes), option

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_long = f"the request body is more than {self.max_bytes} bytes (this server's {self.option})"
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await json_reply(send, 413, too_long)
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                return await json_reply(send, 413, too_long)
            more = message.get("more_body", False)
        body, given = b"".join(parts), False

        async def replay() -> dict:
            nonlocal given
            if given:
                return await receive()
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def check_batch(prompts: int, n: int, max_prompts: int = MAX_PROMPTS, max_samples: int = MAX_SAMPLES) -> str | None:
    """Why a request of ``prompts`` prompts x ``n`` samples is over the bounds, or None."""
    if prompts > max_prompts:
        return f"{prompts} prompts in one request, more than this server's --max_prompts {max_prompts}"
    if prompts * n > max_samples:
        return f"{prompts} prompts x n={n} responses, more than this server's --max_samples {max_samples}"
    return None


async def invalid_request(request: Any, exc: Any) -> Any:
    """FastAPI's ``RequestValidationError`` as a 422 whose body is JSON whatever the request held (each error's
    location, message and type, without the offending value, which may be NaN)."""
    return invalid_body(exc.errors())


def invalid_body(errors: list[dict], prefix: str | None = None) -> Any:
    """pydantic's ``errors`` as that 422 (each location under ``prefix`` when given)."""
    from fastapi.responses import JSONResponse

    detail = [{"loc": [prefix] * bool(prefix) + [str(part) for part in error.get("loc", ())],
               "msg": str(error.get("msg", "")), "type": str(error.get("type", ""))} for error in errors]  # fmt: skip
    return JSONResponse({"error": "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in detail)[:500],
                         "detail": detail}, status_code=422)  # fmt: skip
