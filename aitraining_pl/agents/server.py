"""The endpoint's FastAPI application: ``GET /v1/models`` and ``POST /v1/chat/completions``, every refusal an
OpenAI error body. Imported only when an endpoint starts (FastAPI is the ``agents`` extra). No ``from __future__
import annotations`` here: FastAPI reads the handlers' annotations at run time."""

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from aitraining_pl.agents.protocol import RequestError, models_body


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
            try:
                body = json.loads(await request.body())
            except ValueError as err:
                raise RequestError(400, f"the request body is not JSON: {err}") from None
            return await endpoint.complete(key, body)
        except RequestError as err:
            return _error(err)
        except Exception as err:  # noqa: BLE001 - the sampler failed: an OpenAI-style 500
            return _error(RequestError(500, f"{type(err).__name__}: {err}", kind="server_error"))

    return app
