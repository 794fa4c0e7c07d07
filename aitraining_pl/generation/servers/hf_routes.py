"""The HF server over HTTP: this project's KV-cache decoder (``HFServerEngine``) behind the subset of ``vllm serve``'s
routes that ``HTTPReplica`` uses, so CPU users, tests and vLLM all go through one client (``python -m
aitraining_pl.generation.servers.hf_routes --model DIR``; the launcher starts it for ``generation.server: launch``
with ``backend: hf``).

- ``/v1/completions``: one prompt of token ids, or a list of them decoded as one batch (prompt ``i`` seeded
  ``seed + i * n``, as one request each would be; ``HTTPReplica`` sends a rollout's prompts so; ``Batcher``), ``n``,
  ``max_tokens``, ``temperature`` (0: greedy), ``top_p``, ``top_k`` (-1 or 0: off), ``seed``,
  ``stop_token_ids``, ``stop``, ``skip_special_tokens``; each choice's ``logprobs.tokens`` are ``token_id:<id>`` with
  the sampled tokens' log-probs under the distribution sampled from (the fields vLLM accepts and this engine has no
  use for, such as ``min_p: 0``, are accepted). A prompt that does not fit the model's positions with ``max_tokens``
  gets 400. ``prompt_logprobs: 0`` adds vLLM's ``prompt_logprobs`` to each choice (None, then ``{"<id>": {"logprob":
  ...}}`` of each given prompt token under the untruncated softmax at temperature 1: a served teacher's scores,
  ``teacher.HTTPTeacher``); top-k prompt log-probs (above 0) are not served. ``return_routed_experts: true`` (an MoE
  model: routing replay) adds each choice's ``routed_experts`` as vLLM writes them (``answers.encode_routes``: the
  experts of the prompt's tokens and of every response token but the last).
- ``/inference/v1/generate`` (vLLM's tokens-in route, a VL policy's prompts with images): ``token_ids`` with each
  image placeholder unexpanded, ``content_parts`` of ``image_url`` data URLs and ``sampling_params`` (the fields
  above); the placeholders are expanded with ``--model``'s image processor (``prompt_images``) and the answer holds
  ``prompt_token_ids`` (expanded) and each choice's ``token_ids`` and ``logprobs.content``. At most
  ``datamodules.vision.MAX_IMAGES`` images of at most ``MAX_IMAGE_PIXELS`` pixels each (read from the header, before
  decoding); a bad, truncated, SVG or bomb image is a 400 naming its content part.
- ``/pause`` (any ``mode``: the decoder waits before its next forward, keeping its cache), ``/resume``,
  ``/is_paused``; ``/health``, ``/v1/models``.
- ``/collective_rpc`` with the worker extension's methods (``aitraining_pl_load``, ``aitraining_pl_release``;
  ``vllm_worker``) and ``aitraining_pl_load_adapter`` (a LoRA adapter folder applied over the last full push,
  ``adapters.merged``): a push checked before anything loads (``checks``), handed to the engine's ``stage``, so that
  it lands between two decode steps of a running batch; ``/reset_prefix_cache`` (nothing cached here),
  ``/update_weight_version``, ``/weight_info``.

Every route requires the run's token (``auth.TokenMiddleware``, the same middleware vLLM is given); a server
started by a trainer stops when that trainer dies (``auth.watch_parent``). The server binds 127.0.0.1 unless
``--host`` says otherwise. With ``--teacher`` it serves ``--model``'s own weights, read at start, and refuses every
push (a distillation teacher); else it holds no weights until the first push."""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

if __name__ == "__main__":  # a launched server: its trainer's death stops it from here on, before the heavy imports
    from aitraining_pl.generation.servers.auth import watch_parent

    watch_parent()

import torch  # noqa: E402
from pydantic import BaseModel, Field, ValidationError  # noqa: E402

from aitraining_pl.generation.backend import SampleRequest, StopRule  # noqa: E402
from aitraining_pl.generation.config import GenerationConfig  # noqa: E402
from aitraining_pl.generation.servers import limits  # noqa: E402
from aitraining_pl.generation.servers.adapters import merged  # noqa: E402
from aitraining_pl.generation.servers.answers import encode_routes  # noqa: E402
from aitraining_pl.generation.servers.auth import TokenMiddleware  # noqa: E402
from aitraining_pl.generation.servers.checks import PushGuard, PushRefused, WeightSpecs  # noqa: E402
from aitraining_pl.generation.servers.vllm_worker import load_checked, push_file  # noqa: E402
from aitraining_pl.models.routing_replay import flat_routes  # noqa: E402

TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class Completion(BaseModel):
    """The ``/v1/completions`` fields this server reads (others are accepted and ignored)."""

    model_config = {"extra": "allow", "allow_inf_nan": False}
    prompt: list[int] | list[list[int]] = Field(min_length=1)  #: one prompt, or several decoded as one batch
    n: int = Field(1, ge=1, le=256)
    max_tokens: int = Field(16, ge=1, lt=2**31)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, lt=2**31)
    seed: int | None = None
    stop_token_ids: list[TokenId] = []
    stop: list[str] | str | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=0)  #: 0: each prompt token's log-prob (a served teacher)
    return_routed_experts: bool = False  #: an MoE model's routes in each choice (``answers.encode_routes``)


class Generate(BaseModel):
    """The ``/inference/v1/generate`` fields this server reads (vLLM's tokens-in route: a prompt with images)."""

    model_config = {"extra": "allow"}
    token_ids: list[int] = Field(min_length=1)
    content_parts: list[dict[str, Any]] = []
    sampling_params: dict[str, Any] = {}


def prompt_images(image_processor: Any, placeholder: int, ids: list[int], urls: list[str],
                  max_image_pixels: int | None = None) -> tuple[list[int], Any]:  # fmt: skip
    """A prompt's token ids with each image placeholder expanded (one token per image feature: ``grid_t * grid_h *
    grid_w / merge_size**2``, the Qwen VL family's processors) and its ``VisionInputs``, from its images' data URLs;
    a ``ValueError`` naming what is wrong (more than ``datamodules.vision.MAX_IMAGES`` images, a bad image, one of
    more than ``max_image_pixels`` pixels: ``images.image_from_url``)."""
    from aitraining_pl.datamodules.vision import MAX_IMAGES
    from aitraining_pl.generation.images import expand, image_from_url
    from aitraining_pl.models.vision import VisionInputs

    if len(urls) > MAX_IMAGES:
        raise ValueError(f"content_parts: {len(urls)} images, more than the {MAX_IMAGES} one prompt may carry")
    images = [image_from_url(url, f"content_parts[{i}]", max_image_pixels) for i, url in enumerate(urls)]
    out = image_processor(images=images, return_tensors="pt")
    merge = getattr(image_processor, "merge_size", None)
    if "image_grid_thw" not in out or not merge:
        raise ValueError("this server expands image placeholders for the Qwen VL family's processors only")
    counts = [int(grid.prod()) // int(merge) ** 2 for grid in out["image_grid_thw"]]
    return expand(ids, placeholder, counts), VisionInputs.from_processor([out])


class Rpc(BaseModel):
    method: str
    kwargs: dict[str, Any] = {}


class NewVersion(BaseModel):
    new_version: str


def prompt_entries(scores: torch.Tensor, prompt: list[int], tokenizer: Any) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of ``prompt`` with ``prompt_logprobs: 0``: None for the first token, then
    ``{"<id>": {"logprob", "rank", "decoded_token"}}`` of each given token (``scores``: the log-probs of
    ``prompt[1:]``; no rank: the full distribution is not ranked here)."""
    entries: list[dict | None] = [None]
    for tok, value in zip(prompt[1:], scores.tolist()):
        text = tokenizer.decode([tok]) if tokenizer is not None else None
        entries.append({str(tok): {"logprob": value, "rank": None, "decoded_token": text}})
    return entries


class Batcher:
    """The completion requests waiting for the engine, served one HTTP request at a time (its prompts decode as one
    batch: ``HFServerEngine.sample_many``, each prompt drawn from its own seed), in arrival order. With ``wait_s``
    above 0 the first request to find the engine free waits that long, then every queued request decodes in the same
    batch (faster for many independent clients; float rounding then depends on what shared a batch, so runs are no
    longer bit-reproducible).

    Args:
        serve: ``sample_many``: a list of ``SampleRequest`` (and a VL request's ``VisionInputs``) to their
            ``SampledTokens``.
        wait_s: how long a batch waits for other requests (0: none; each request is its own batch).
    """

    def __init__(self, serve: Any, wait_s: float = 0.0):
        self.serve, self.wait_s = serve, float(wait_s)
        self.changed = threading.Condition()
        self.queue: list[dict[str, Any]] = []
        self.busy = False

    def submit(self, requests: list[SampleRequest], vision: Any = None) -> list[Any]:
        """The ``SampledTokens`` of one HTTP request's ``requests`` (an error of its batch raised here too);
        ``vision``: a VL prompt's ``VisionInputs`` (one request), never batched with others."""
        job = {"requests": list(requests), "vision": vision}
        with self.changed:
            self.queue.append(job)
        while True:
            with self.changed:
                while self.busy and "answer" not in job:
                    self.changed.wait()
                if "answer" in job:
                    break
                self.busy = True  # the engine is free: this thread serves the next batch
            self.lead()
        if isinstance(job["answer"], BaseException):
            raise job["answer"]
        return job["answer"]

    def lead(self) -> None:
        if self.wait_s > 0:
            time.sleep(self.wait_s)
        with self.changed:
            take = len(self.queue) if self.wait_s > 0 else 1
            batch, self.queue = self.queue[:take], self.queue[take:]
        plain = [job for job in batch if job["vision"] is None]
        groups = [(plain, None)] * bool(plain) + [([job], job["vision"]) for job in batch if job["vision"] is not None]
        for jobs, vision in groups:
            try:
                answers: list[Any] = list(self.serve([r for job in jobs for r in job["requests"]], vision))
            except BaseException as err:  # every request of the batch gets the error
                answers = [err] * sum(len(job["requests"]) for job in jobs)
            for job in jobs:
                mine, answers = answers[: len(job["requests"])], answers[len(job["requests"]) :]
                errors = [a for a in mine if isinstance(a, BaseException)]
                job["answer"] = errors[0] if errors else mine
        with self.changed:
            self.busy = False
            self.changed.notify_all()


def build_app(engine: Any, tokenizer: Any, specs: WeightSpecs, name: str, positions: int | None, token: str,
              fixed: bool = False, image_processor: Any = None, placeholder: int | None = None,
              wait_s: float = 0.0, max_body_mb: float = limits.MAX_BODY_MB, max_prompts: int = limits.MAX_PROMPTS,
              max_samples: int = limits.MAX_SAMPLES) -> Any:  # fmt: skip
    """The FastAPI app of the routes above around ``engine`` (an ``HFServerEngine``); ``name``: the model id
    ``/v1/models`` answers; ``positions``: the model's longest sequence; ``fixed``: the engine holds a teacher's
    weights (``--teacher``), and every push is refused; ``image_processor``: a VL model's, whose ``placeholder``
    token ids ``/inference/v1/generate`` expands; ``wait_s``: ``Batcher``'s; ``max_body_mb``, ``max_prompts``,
    ``max_samples``: a request's bounds (``limits``)."""
    from fastapi import FastAPI, HTTPException
    from fastapi.exceptions import RequestValidationError

    app = FastAPI(title="aitraining-pl HF server")
    app.add_exception_handler(RequestValidationError, limits.invalid_request)
    app.add_middleware(limits.BodyLimit, max_bytes=int(max_body_mb * (1 << 20)))
    app.add_middleware(TokenMiddleware, token=token)  # the outermost: a stranger's body is never read
    guard, resumed, label = PushGuard(), threading.Event(), {"version": "default"}
    base: dict[str, torch.Tensor] = {}  #: the last full push (unmerged): what an adapter push applies to
    batcher = Batcher(engine.sample_many, wait_s)
    resumed.set()
    engine.before_forward = lambda column: resumed.wait()  # /pause holds the decoder before its next forward
    vocab = len(tokenizer) if tokenizer is not None else None
    pad = getattr(tokenizer, "pad_token_id", None) or 0

    @app.get("/health")
    def health() -> dict:
        return {}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "aitraining-pl"}]}

    @app.post("/inference/v1/generate")
    def generate(body: Generate) -> dict:
        if image_processor is None:
            raise HTTPException(400, "this server's model takes no images (no image processor in --model's folder)")
        urls = [part.get("url", "") for part in body.content_parts if part.get("type") == "image_url"]
        try:
            ids, vision = prompt_images(image_processor, placeholder, body.token_ids, urls)
        except ValueError as err:
            raise HTTPException(400, str(err)) from None
        fields = {k: v for k, v in body.sampling_params.items() if k in Completion.model_fields}
        try:
            asked = Completion(prompt=ids, **fields)
        except ValidationError as err:  # checked here, not by FastAPI: the same 422 as /v1/completions
            return limits.invalid_body(err.errors(), "sampling_params")
        answer = complete(asked, vision)
        choices = [{"index": c["index"], "finish_reason": c["finish_reason"], "token_ids": c["token_ids"],
                    "logprobs": {"content": [{"token_id": t, "logprob": v} for t, v in
                                             zip(c["token_ids"], c["logprobs"]["token_logprobs"])]}}
                   for c in answer["choices"]]  # fmt: skip
        return {"model": name, "choices": choices, "prompt_token_ids": ids}

    @app.post("/v1/completions")
    def completions(body: Completion) -> dict:
        return complete(body)

    def complete(body: Completion, vision: Any = None) -> dict:
        """A completion of ``body``'s prompt or prompts (with its images' ``VisionInputs``: ``generate``)."""
        prompts = body.prompt if isinstance(body.prompt[0], list) else [body.prompt]
        too_many = limits.check_batch(len(prompts), body.n, max_prompts, max_samples)
        if too_many:
            raise HTTPException(400, too_many)
        for prompt in prompts:
            if positions is not None and len(prompt) + body.max_tokens > positions:
                raise HTTPException(400, f"the prompt ({len(prompt)} tokens) and max_tokens ({body.max_tokens}) "
                                         f"exceed the model's {positions} positions")  # fmt: skip
            if not prompt or (vocab is not None and not all(0 <= t < vocab for t in prompt)):
                raise HTTPException(400, f"prompt token ids must be in [0, {vocab}), at least one per prompt")
        greedy = body.temperature == 0
        generation = GenerationConfig(
            max_new_tokens=body.max_tokens, temperature=body.temperature or 1.0, top_p=body.top_p,
            top_k=max(0, body.top_k), do_sample=not greedy, routing_replay=body.return_routed_experts and not vision,
        )  # fmt: skip
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        rule = StopRule(tokenizer if stops else None, stops, skip_special_tokens=body.skip_special_tokens)
        requests = []
        for i, prompt in enumerate(prompts):  # prompt i seeded as its own request would be: seed + i * n
            ids, seed = torch.tensor([prompt]), None if body.seed is None else (body.seed + i * body.n) % 2**31
            requests.append(SampleRequest(ids, torch.ones_like(ids), generation, body.stop_token_ids, rule, pad,
                                          body.n, seed))  # fmt: skip
        scored = None
        if body.prompt_logprobs is not None:
            if len(prompts) > 1 or engine.version is None:
                raise HTTPException(400, "prompt_logprobs score one prompt with a teacher's weights (start it with "
                                         "--teacher) or pushed ones")  # fmt: skip
            ids = requests[0].prompt_ids
            scored = prompt_entries(engine.prompt_logprobs(ids, torch.ones_like(ids), 1)[0], prompts[0], tokenizer)
        choices = []
        for request, sampled in zip(requests, batcher.submit(requests, vision)):
            lengths = (sampled.token_versions >= 0).sum(1)
            routes = [None] * len(lengths)
            if sampled.routes is not None:  # the prompt's tokens, then the fed-back response tokens
                routes = flat_routes(sampled.routes, request.prompt_mask.repeat_interleave(body.n, 0), lengths)
            for tokens, logps, versions, route in zip(sampled.response_ids, sampled.sampling_logprobs,
                                                      sampled.token_versions, routes):  # fmt: skip
                length = int((versions >= 0).sum())
                kept = tokens[:length].tolist()
                ended = bool(kept) and kept[-1] in body.stop_token_ids
                choices.append({
                    "index": len(choices), "text": tokenizer.decode(kept) if tokenizer is not None else "",
                    "token_ids": kept, "finish_reason": "stop" if ended else "length",
                    "logprobs": {"tokens": [f"token_id:{t}" for t in kept], "token_logprobs": logps[:length].tolist()},
                    "token_versions": versions[:length].tolist(),  # the weights step of each token (in-flight pushes)
                    "prompt_logprobs": scored,
                    "routed_experts": None if route is None else encode_routes(route),
                })  # fmt: skip
        return {"object": "text_completion", "model": name, "choices": choices}

    @app.post("/pause")
    def pause(mode: str = "abort") -> dict:
        resumed.clear()
        return {"status": "paused"}

    @app.post("/resume")
    def resume() -> dict:
        resumed.set()
        return {"status": "resumed"}

    @app.get("/is_paused")
    def is_paused() -> dict:
        return {"is_paused": not resumed.is_set()}

    @app.post("/collective_rpc")
    def collective_rpc(body: Rpc) -> dict:
        kwargs = body.kwargs
        if body.method == "aitraining_pl_release":
            return {"results": [{"ok": True, "released": guard.release(str(kwargs.get("owner", "")))}]}
        if body.method not in ("aitraining_pl_load", "aitraining_pl_load_adapter"):
            raise HTTPException(400, f"this server has no method {body.method!r}")
        owner, version, path = str(kwargs.get("owner", "")), str(kwargs.get("version", "")), str(kwargs.get("path"))
        adapter = body.method == "aitraining_pl_load_adapter"
        try:
            if fixed:
                raise PushRefused("this server serves a teacher's fixed weights (--teacher): no pushes")
            parsed = guard.admit(owner, version, same=adapter)
            if adapter:
                if not base:
                    raise PushRefused("an adapter needs the base weights pushed first")
                staged = merged(push_file(path, folder=True), base, specs)
            else:
                staged = load_checked(path, specs)
                base.clear()
                base.update(staged)
            engine.stage(staged, str(parsed))
            guard.accept(owner, parsed)
        except PushRefused as err:  # a corrupt file or adapter config too (``load_checked``, ``lora_scale``)
            return {"results": [{"ok": False, "error": str(err)}]}
        return {"results": [{"ok": True}]}

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache() -> dict:
        return {}

    @app.post("/update_weight_version")
    def update_weight_version(body: NewVersion) -> dict:
        label["version"] = body.new_version
        return {"success": True, "new_version": body.new_version}

    @app.get("/weight_info")
    def weight_info() -> dict:
        return {"weight_version": engine.version if engine.version is not None else label["version"]}

    return app


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aitraining_pl.generation.servers.hf_routes",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--model", required=True, help="a folder with the policy's config.json and tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=0, help="TCP port (0: a free one, printed)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (the config's)")
    p.add_argument("--seed", type=int, default=0, help="seeds the unseeded requests")
    p.add_argument("--threads", type=int, default=None, help="torch's CPU threads")
    wait = "above 0: how long a batch waits for other completion requests, which then decode with it (faster for "
    p.add_argument(
        "--batch_wait_ms",
        type=float,
        default=0.0,
        help=wait + "many clients, not bit-reproducible); 0 (default): each request is its own batch",
    )
    teacher = "serve --model's own weights, read at start, as a distillation teacher (teacher_server: {url: ...}); "
    p.add_argument("--teacher", action="store_true", help=teacher + "pushes are refused")
    bound = "(default %(default)s; larger gets "
    p.add_argument("--max_body_mb", type=float, default=limits.MAX_BODY_MB, help=f"largest body {bound}413)")
    p.add_argument("--max_prompts", type=int, default=limits.MAX_PROMPTS, help=f"most prompts {bound}400)")
    p.add_argument("--max_samples", type=int, default=limits.MAX_SAMPLES, help=f"most prompts x n {bound}400)")
    return p


def main(argv: list[str] | None = None) -> None:
    """Build the engine for ``--model``'s architecture (no weights until the first push) and serve."""
    import uvicorn

    from aitraining_pl.generation.servers.auth import server_token, watch_parent
    from aitraining_pl.generation.servers.hf_server import HFServerEngine, load_teacher, meta_model
    from aitraining_pl.models.loading import context_length_of, load_tokenizer

    watch_parent()  # a launched server stops with its trainer, even while it is still being built
    args = parser().parse_args(argv)
    token = server_token()  # before anything is built: a server without a token never starts
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = meta_model(args.model, None if args.dtype == "auto" else args.dtype)
    specs = WeightSpecs(policy)
    tokenizer = load_tokenizer(args.model)
    engine = HFServerEngine(policy, seed=args.seed)
    if args.teacher:
        load_teacher(engine, args.model)
    positions = context_length_of(policy)  # a VL config's in its text_config
    image_processor = placeholder = None
    if (Path(args.model) / "preprocessor_config.json").is_file():  # a VL policy (``images.save_model_files``)
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(args.model)
        placeholder = getattr(policy.config, "image_token_id", None)
    app = build_app(engine, tokenizer, specs, args.model, positions, token, fixed=args.teacher,
                    image_processor=image_processor, placeholder=placeholder,
                    wait_s=args.batch_wait_ms / 1e3, max_body_mb=args.max_body_mb, max_prompts=args.max_prompts,
                    max_samples=args.max_samples)  # fmt: skip
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    print(f"hf-server: listening on {host}:{port}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30))
    server.run(sockets=[sock])
    engine.close()


if __name__ == "__main__":
    main()
