"""The REST routes of the ``tinker`` client's ``RestClient`` that tinker-cookbook uses around its checkpoints
(``checkpoint_utils``: the renderer a run was trained with, read from the run's ``user_metadata``; its rolling
checkpoints, deleted as newer ones are saved), read from the server's checkpoint folder:

- ``GET /api/v1/training_runs/{run}`` (``get_training_run``, ``get_training_run_by_tinker_path``): the run's base
  model, LoRA rank, ``user_metadata`` (given at ``create_lora_training_client``) and its latest checkpoints;
- ``GET /api/v1/training_runs`` (``list_training_runs``, ``limit`` / ``offset``): the key's runs, newest first;
- ``GET /api/v1/training_runs/{run}/checkpoints`` (``list_checkpoints``);
- ``DELETE /api/v1/training_runs/{run}/checkpoints/{kind}/{name}`` (``delete_checkpoint[_from_tinker_path]``).

A run is a training client's ``model_id``; a key sees only its own runs (another key's are "unknown"), including
those of finished sessions, whose checkpoints stay on disk."""

import json
import os
import shutil
from datetime import datetime, timezone
from typing import Any

from aitraining_pl.tinker.engine import META_FILE, Engine
from aitraining_pl.tinker.wire import BadRequest

RUN_FILE = "run.json"  #: a run's base model, LoRA and user metadata, beside its checkpoints
KINDS = {"weights": "training", "sampler_weights": "sampler"}


def run_folder(engine: Engine, owner: str, run: str) -> str:
    return os.path.dirname(os.path.dirname(engine.folder(owner, run, "weights", "x")))


def record_run(engine: Engine, owner: str, run: str, lora: dict, user_metadata: Any) -> None:
    """Write a new run's ``RUN_FILE`` (its ``user_metadata``: strings only, as the client's type has them)."""
    if user_metadata is not None and not isinstance(user_metadata, dict):
        raise BadRequest("create_model: user_metadata must be an object")
    folder = run_folder(engine, owner, run)
    os.makedirs(folder, exist_ok=True)
    meta = {"training_run_id": run, "base_model": engine.name, "lora": lora,
            "user_metadata": {str(k): str(v) for k, v in (user_metadata or {}).items()}}  # fmt: skip
    with open(os.path.join(folder, RUN_FILE), "w") as handle:
        json.dump(meta, handle)


def _read(file: str) -> dict:
    with open(file) as handle:
        return json.load(handle)


def _time(path: str) -> str:
    return datetime.fromtimestamp(os.path.getmtime(path), timezone.utc).isoformat()


def checkpoints(engine: Engine, owner: str, run: str) -> list[dict]:
    """The run's checkpoints (``tinker.types.Checkpoint``), oldest first."""
    out, root = [], run_folder(engine, owner, run)
    for kind, checkpoint_type in KINDS.items():
        folder = os.path.join(root, kind)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            path = os.path.join(folder, name)
            if os.path.isfile(os.path.join(path, META_FILE)):
                size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
                out.append({"checkpoint_id": f"{kind}/{name}", "checkpoint_type": checkpoint_type, "time": _time(path),
                            "tinker_path": f"tinker://{run}/{kind}/{name}", "size_bytes": size})  # fmt: skip
    return sorted(out, key=lambda c: c["time"])


def training_run(engine: Engine, owner: str, run: str) -> dict:
    """The run as a ``tinker.types.TrainingRun``; "unknown" unless ``owner`` made it."""
    file = os.path.join(run_folder(engine, owner, run), RUN_FILE)
    if "/" in run or ".." in run or not os.path.isfile(file):
        raise BadRequest(f"unknown training run {run!r} (no training client of that id for this API key)")
    meta = _read(file)
    saved = checkpoints(engine, owner, run)
    last = {t: next((c for c in reversed(saved) if c["checkpoint_type"] == t), None) for t in KINDS.values()}
    return {"training_run_id": run, "base_model": meta["base_model"], "model_owner": owner, "is_lora": True,
            "lora_rank": meta["lora"]["rank"], "last_request_time": _time(file),
            "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
            "user_metadata": meta["user_metadata"] or None}  # fmt: skip


def add_routes(app: Any, engine: Engine, owner_of: Any) -> None:
    """Add the routes above to the FastAPI ``app``; ``owner_of(request)``: the key's tenant."""
    from fastapi import Request

    @app.get("/api/v1/training_runs")
    async def list_runs(request: Request, limit: int = 20, offset: int = 0):
        owner = owner_of(request)
        root = os.path.join(engine.checkpoint_dir, owner)
        files = [os.path.join(root, d, RUN_FILE) for d in (os.listdir(root) if os.path.isdir(root) else ())]
        runs = [_read(file)["training_run_id"] for file in files if os.path.isfile(file)]
        found = sorted((training_run(engine, owner, r) for r in runs), key=lambda r: r["last_request_time"])[::-1]
        page = found[max(0, offset) : max(0, offset) + max(0, limit)]
        return {"training_runs": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}

    @app.get("/api/v1/training_runs/{run}")
    async def get_run(run: str, request: Request):
        return training_run(engine, owner_of(request), run)

    @app.get("/api/v1/training_runs/{run}/checkpoints")
    async def list_checkpoints(run: str, request: Request):
        training_run(engine, owner_of(request), run)  # the key's own run, else "unknown"
        return {"checkpoints": checkpoints(engine, owner_of(request), run)}

    @app.delete("/api/v1/training_runs/{run}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run: str, kind: str, name: str, request: Request):
        folder = engine.resolve(owner_of(request), f"tinker://{run}/{kind}/{name}")  # the key's own, else 400
        shutil.rmtree(folder)
        return {}
