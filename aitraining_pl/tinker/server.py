"""A server speaking the protocol of Thinking Machines' ``tinker`` client (tested with ``tinker`` 0.38), on this
project's model side (``tinker.engine``: LoRA adapters on one base model; ``tinker.sampler``: the HF decoder, or
generation servers through ``tinker.served``).

Routes are the client's (``/api/v1/...``): JSON bodies, except ``forward_backward`` (the client's protobuf) and the
results of forward/backward and sampling, which ``/api/v1/retrieve_future`` returns as protobuf. Work is queued and
answered with a future id; ``retrieve_future`` waits up to ``POLL`` seconds, then tells the client to try again.
``/api/v1/client/config`` turns the hosted JWT exchange off, so the client sends its ``tml-`` API key itself
(``X-API-Key``) on every request.

**Nobody else gets in.** ``KeyMiddleware`` refuses (401) every route without one of the server's API keys, then
``generation.servers.limits.BodyLimit`` (413) every body over ``max_body`` bytes. Sessions, training clients,
checkpoints and sampler weights belong to the key that made them: another key gets "unknown" for them. Requests
are checked before any work is queued (400 with one message naming the field: unknown model or loss, tensor shapes,
NaN, token ids, sizes); a request that fails on the worker gets a failed future with its message; the server stays
up."""

import asyncio
import hashlib
import hmac
import itertools
import json
import logging
import os
import uuid
from typing import Any

from aitraining_pl.generation.servers.limits import BodyLimit, json_reply
from aitraining_pl.tinker.engine import META_FILE, TTL_RANGE, Engine, Lora, TrainedModel
from aitraining_pl.tinker.rest import add_routes as add_rest_routes
from aitraining_pl.tinker.rest import record_run
from aitraining_pl.tinker.sampler import Sampler, check_sample
from aitraining_pl.tinker.wire import PROTO, BadRequest, read_forward_backward, write_forward_backward, write_sample

log = logging.getLogger(__name__)
#: seconds ``retrieve_future`` waits for a result before answering "try again"
POLL = 10.0
#: results kept for retrieval; past this, the oldest finished ones are dropped
MAX_FUTURES = 10000
ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                 "grad_clip_norm": 0.0}  # fmt: skip


def owner_of(key: str) -> str:
    """The folder-safe name of an API key's tenant (a digest; the key itself is never stored)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class KeyMiddleware:
    """ASGI middleware: ``X-API-Key`` must be one of ``keys`` (compared in constant time) on every HTTP route, else
    401. The key's tenant goes into ``scope["state"]["owner"]``."""

    def __init__(self, app: Any, keys: list[str]):
        self.app, self.keys = app, [k.encode() for k in keys]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"x-api-key", b"")
        match = [k for k in self.keys if hmac.compare_digest(given, k)]
        if not match:
            return await json_reply(send, 401, "unauthorized: this server requires one of its API keys (X-API-Key)")
        scope.setdefault("state", {})["owner"] = owner_of(match[0].decode())
        return await self.app(scope, receive, send)


class State:
    """Sessions, training clients, sampling sessions and futures, each with its owner."""

    def __init__(self, engine: Engine, max_tokens: int, max_datums: int, max_samples: int, max_body: int,
                 served: Any = None):  # fmt: skip
        self.engine, self.sampler = engine, Sampler(engine, served)  # served: ``tinker.served.ServedSampling``
        self.max_tokens, self.max_datums, self.max_samples, self.max_body = (
            max_tokens,
            max_datums,
            max_samples,
            max_body,
        )
        self.sessions: dict[str, str] = {}
        self.sampling: dict[str, tuple[str, str | None]] = {}  # id -> (owner, snapshot key or None: base model)
        self.futures: dict[str, tuple[str, Any, str]] = {}  # id -> (owner, concurrent future, kind)
        self.counter = itertools.count()

    def future(self, owner: str, fn, *args, kind: str = "json", **extra) -> dict:
        request_id = uuid.uuid4().hex
        if len(self.futures) >= MAX_FUTURES:
            for old in [k for k, v in self.futures.items() if v[1].done()][: len(self.futures) - MAX_FUTURES + 1]:
                del self.futures[old]
        self.futures[request_id] = (owner, self.engine.submit(fn, *args), kind)
        return {"request_id": request_id, **extra}

    def model(self, owner: str, model_id: Any) -> TrainedModel:
        entry = self.engine.models.get(str(model_id))
        if entry is None or entry.owner != owner:
            raise BadRequest(f"unknown model_id {model_id!r} (no training client of that id for this API key)")
        return entry

    def session(self, owner: str, session_id: Any) -> str:
        if self.sessions.get(str(session_id)) != owner:
            raise BadRequest(f"unknown session_id {session_id!r}")
        return str(session_id)

    def base_model(self, name: Any) -> None:
        if name is not None and name != self.engine.name:
            raise BadRequest(f"unknown base_model {name!r}; this server serves {self.engine.name!r}")


def client_config(state: State) -> dict:
    """The client's feature flags: API keys without the JWT exchange, plain httpx, uncompressed serial chunks no
    bigger than the server takes."""
    return {
        "pjwt_auth_enabled": False,
        "credential_default_source": "api_key",
        "use_pyqwest_transport": False,
        "proto_compress_fwdbwd": False,
        "parallel_fwdbwd_chunks": False,
        "fwdbwd_max_chunk_len": state.max_datums,
        "fwdbwd_max_chunk_bytes_count": state.max_body // 2,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
    }


def build_app(state: State, keys: list[str]):
    """The FastAPI app with every route of the client, wrapped in ``KeyMiddleware`` and ``BodyLimit``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    app = FastAPI(title="aitraining-pl tinker-serve")
    engine, sampler = state.engine, state.sampler

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        return JSONResponse({"error": str(error)}, status_code=400)

    async def body(request: Request) -> dict:
        try:
            data = json.loads(await request.body() or b"{}")
        except ValueError:
            raise BadRequest(f"{request.url.path}: the body is not JSON") from None
        if not isinstance(data, dict):
            raise BadRequest(f"{request.url.path}: the body must be a JSON object")
        return data

    def owner(request: Request) -> str:
        return request.state.owner

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def config():
        return client_config(state)

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": engine.name, "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        await body(request)
        session_id = uuid.uuid4().hex
        state.sessions[session_id] = owner(request)
        return {"type": "create_session", "session_id": session_id}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        state.session(owner(request), (await body(request)).get("session_id"))
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        """The session's training clients are deleted (their adapters and optimizer state); saved checkpoints stay."""
        state.session(owner(request), session_id)
        ids = [m for m in engine.models if m.startswith(f"{session_id}:")]
        await asyncio.wrap_future(engine.submit(engine.run_release, ids))
        state.sessions.pop(session_id, None)
        return {}

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        data, who = await body(request), owner(request)
        session_id = state.session(who, data.get("session_id"))
        state.base_model(data.get("base_model"))
        lora = data.get("lora_config") or {}
        if "rank" not in lora:
            raise BadRequest("create_model: this server trains LoRA adapters only; lora_config.rank is required")
        shape = Lora(int(lora["rank"]), bool(lora.get("train_attn", True)), bool(lora.get("train_mlp", True)),
                     bool(lora.get("train_unembed", True)))  # fmt: skip
        model_id = f"{session_id}:train:{int(data.get('model_seq_id', 0))}"
        if model_id in engine.models:
            raise BadRequest(f"create_model: model_seq_id {data.get('model_seq_id')} was already used in this session")
        entry = TrainedModel(model_id, who, f"client{next(state.counter)}", shape)
        record_run(engine, who, model_id, shape.__dict__, data.get("user_metadata"))  # the REST routes' run
        return state.future(who, engine.run_create, entry, lora.get("seed"), model_id=model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        entry = state.model(owner(request), (await body(request)).get("model_id"))
        data = {"arch": type(engine.model).__name__, "model_name": engine.name, "tokenizer_id": engine.name}
        return {"type": "get_info", "model_data": data, "model_id": entry.model_id, "is_lora": True,
                "lora_rank": entry.lora.rank, "model_name": engine.name}  # fmt: skip

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        raw = await request.body()
        parsed = read_forward_backward(raw, state.max_tokens, state.max_datums, engine.vocab)
        entry = state.model(owner(request), parsed.model_id)
        return state.future(owner(request), engine.run_forward_backward, entry, parsed, kind="fwdbwd")

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        data, who = await body(request), owner(request)
        entry = state.model(who, data.get("model_id"))
        given = data.get("adam_params")
        if not isinstance(given, dict):
            raise BadRequest("optim_step: this server runs AdamW; adam_params are required")
        adam = {**ADAM_DEFAULTS, **{k: given[k] for k in ADAM_DEFAULTS if k in given}}
        bad = [k for k, v in adam.items() if not isinstance(v, (int, float)) or v != v or v < 0]
        if bad or not 0 <= adam["beta1"] < 1 or not 0 <= adam["beta2"] < 1:
            raise BadRequest(f"optim_step: adam_params {', '.join(bad) or 'beta1/beta2'} out of range")
        return state.future(who, engine.run_optim_step, entry, adam)

    def checkpoint_name(data: dict) -> str:
        name = str(data.get("path") or f"step-{uuid.uuid4().hex[:8]}")
        if "/" in name or name.startswith(".") or len(name) > 128:
            raise BadRequest(f"checkpoint name {name!r}: no '/', no leading '.', at most 128 characters")
        return name

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        data, who = await body(request), owner(request)
        entry = state.model(who, data.get("model_id"))
        name, ttl = checkpoint_name(data), ttl_seconds(data)
        return state.future(who, _path, engine.run_save, entry, name, "weights", True, ttl)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        data, who = await body(request), owner(request)
        with_optimizer = bool(data.get("optimizer"))
        folder = engine.resolve(who, str(data.get("path")))
        if data.get("session_id") is not None:  # create-via-load: a new training client from the checkpoint
            session_id = state.session(who, data["session_id"])
            state.base_model(data.get("base_model"))
            entry = TrainedModel(f"{session_id}:train:{int(data.get('model_seq_id', 0))}", who,
                                 f"client{next(state.counter)}", Lora(1))  # fmt: skip
            with open(os.path.join(folder, META_FILE)) as handle:
                record_run(engine, who, entry.model_id, json.load(handle)["lora"], data.get("user_metadata"))
            return state.future(who, engine.run_load, entry, folder, with_optimizer, True, model_id=entry.model_id)
        entry = state.model(who, data.get("model_id"))
        return state.future(who, engine.run_load, entry, folder, with_optimizer, False)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        data, who = await body(request), owner(request)
        entry = state.model(who, data.get("model_id"))
        if data.get("path"):
            name, ttl = checkpoint_name(data), ttl_seconds(data)
            return state.future(who, _path, engine.run_save, entry, name, "sampler_weights", False, ttl)
        session_id = uuid.uuid4().hex
        key = f"tinker://{entry.model_id}/sampler_weights/{session_id}"
        state.sampling[session_id] = (who, key)
        return state.future(who, _sampling_session, sampler.run_snapshot, entry, key, session_id)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        data, who = await body(request), owner(request)
        state.session(who, data.get("session_id"))
        key = None
        if data.get("model_path"):
            key = str(data["model_path"])
            await asyncio.wrap_future(engine.submit(sampler.snapshot_of, who, key))
        else:
            state.base_model(data.get("base_model") or engine.name)
        sampling_id = uuid.uuid4().hex
        state.sampling[sampling_id] = (who, key)
        return {"type": "create_sampling_session", "sampling_session_id": sampling_id}

    @app.get("/api/v1/samplers/{sampling_id}")
    async def get_sampler(sampling_id: str, request: Request):
        who, key = state.sampling.get(sampling_id, (None, None))
        if who != owner(request):
            raise BadRequest(f"unknown sampler {sampling_id!r}")
        return {"sampler_id": sampling_id, "base_model": engine.name, "model_path": key}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        data, who = await body(request), owner(request)
        holder, key = state.sampling.get(str(data.get("sampling_session_id")), (None, None))
        if holder != who:
            if data.get("sampling_session_id") is not None or data.get("model_path"):
                raise BadRequest(f"asample: unknown sampling_session_id {data.get('sampling_session_id')!r}")
            state.base_model(data.get("base_model") or engine.name)
        prompt, params = check_sample(data, engine.vocab, state.max_tokens, state.max_samples)
        n = int(data.get("num_samples", 1))
        ids = [uuid.uuid4().hex for _ in range(n)]
        logprobs = bool(data.get("prompt_logprobs"))
        last_n, topk = data.get("prompt_logprobs_last_n"), int(data.get("topk_prompt_logprobs") or 0)
        return state.future(who, sampler.run_sample, key, prompt, params, n, logprobs, last_n, topk, kind="sample",
                            sample_sequence_ids=ids)  # fmt: skip

    add_rest_routes(app, engine, owner)  # the run and checkpoint listing (tinker.rest)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        request_id = str((await body(request)).get("request_id"))
        found = state.futures.get(request_id)
        if found is None or found[0] != owner(request):
            raise BadRequest(f"retrieve_future: unknown request_id {request_id!r}")
        _, future, kind = found
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), POLL)
        except asyncio.TimeoutError:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        except BadRequest as error:
            state.futures.pop(request_id, None)
            return {"error": str(error), "category": "user"}
        except Exception as error:  # noqa: BLE001 - the worker's failure goes to the client as a failed future
            log.exception("request %s failed", request_id)
            state.futures.pop(request_id, None)
            return {"error": f"{type(error).__name__}: {error}", "category": "server"}
        state.futures.pop(request_id, None)
        if kind == "fwdbwd":
            return Response(write_forward_backward(*result), media_type=PROTO)
        if kind == "sample":
            return Response(write_sample(*result), media_type=PROTO)
        return result

    @app.post("/api/v1/cancel_future")
    async def cancel_future():
        return {}

    # the key first (a stranger's body is never read), then the body's bound (413: generation.servers.limits)
    return KeyMiddleware(BodyLimit(app, state.max_body, option="--max-body-mb"), keys)


def ttl_seconds(data: dict) -> int | None:
    """A save's ``ttl_seconds``: ``None`` (never expires) or whole seconds within ``TTL_RANGE``."""
    ttl, (low, high) = data.get("ttl_seconds"), TTL_RANGE
    if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or not low <= ttl <= high):
        raise BadRequest(f"ttl_seconds {ttl!r}: whole seconds from {low} (1 hour) to {high} (10 years)")
    return ttl


def _path(save, *args) -> dict:
    return {"path": save(*args)}


def _sampling_session(snapshot, entry, key: str, session_id: str) -> dict:
    snapshot(entry, key)
    return {"sampling_session_id": session_id}
