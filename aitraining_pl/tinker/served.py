"""``tinker-serve``'s sampling on generation servers (``--sampler-server``): a ``vllm serve`` or this project's HF
server, one or a fleet (``generation.servers.fleet.Fleet``), launched on this machine (``launcher.LaunchedFleet``)
or running at given URLs (``Fleet.connect``, the run's token as ``generation.vllm.server_token_file`` or
``AITRAINING_PL_SERVER_TOKEN``); the same options and code as a training run's ``generation.server``.

The servers start with no weights: the base model's go with the first push to each (``Fleet.push``'s ``base``, again
to a server that rejoins). Sampler weights are pushed as LoRA adapters (``servers.adapters.AdapterWeights``) when a
request for them comes:

- a ``vllm serve`` keeps each under its own name (one per sampler path: two tenants' sampling clients sample their
  own weights), loaded once and named by each request (``SampleRequest.adapter``); the oldest are unloaded past
  ``sampler.MAX_SNAPSHOTS``; the base model is the served model itself;
- the HF server merges one adapter at a time over the base weights: a request for other weights than the last
  pushes them first (the base model: the base weights again).

Everything here runs on the engine's worker thread (one call at a time), so a push never races a sample."""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections import OrderedDict
from typing import Any

import torch

from aitraining_pl.generation.backend import BackendContext, SampledTokens, SampleRequest
from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.servers.adapters import AdapterWeights, config_json
from aitraining_pl.generation.servers.fleet import Fleet
from aitraining_pl.generation.servers.launcher import LaunchedFleet
from aitraining_pl.generation.servers.replica import ReplicaDown
from aitraining_pl.models.lora import is_peft_model, plain_weights

BASE = object()  #: the HF servers hold the base weights (no adapter merged)


def sampler_generation(sampler: str, server: str, token_file: str | None = None, threads: int = 1,
                       timeout: float = 240.0) -> GenerationConfig | None:  # fmt: skip
    """The ``GenerationConfig`` of ``tinker-serve``'s ``--sampler`` / ``--sampler-server`` options (None: sampling
    in process), or a ``SystemExit`` line naming the option. ``server``: ``none``, ``launch``, ``launch:N`` or
    comma-separated URLs."""
    if server == "none":
        if sampler != "hf":
            raise SystemExit(
                f"tinker-serve --sampler {sampler}: it samples as a server here; give --sampler-server "
                "launch (started on this machine) or the URL of a running one (aitraining-pl vllm-serve)"
            )
        return None
    if server == "launch" or server.startswith("launch:"):
        count = server.partition(":")[2] or "1"
        if not count.isdigit() or int(count) < 1:
            raise SystemExit(f"tinker-serve --sampler-server {server}: launch:N needs a positive count N")
        where: Any = {"launch": {"count": int(count), "engine": sampler}}
    else:
        where = {"urls": [url.strip() for url in server.split(",") if url.strip()]}
    where.update(connect_timeout=timeout)
    vllm = {"server_token_file": token_file, "server_timeout": timeout}
    generation = GenerationConfig(backend=sampler, server=where, server_threads=threads, vllm=vllm)
    try:
        generation.validate("tinker-serve --sampler-server")
    except ValueError as error:
        raise SystemExit(f"tinker-serve: {error}") from None
    return generation


class WithAdapter:
    """The fleet as a ``GenerationBackend`` that samples with one named adapter (None: the weights last pushed)."""

    location = "server"

    def __init__(self, fleet: Fleet, adapter: str | None):
        self.fleet, self.adapter = fleet, adapter

    def sample(self, request: SampleRequest) -> SampledTokens:
        return self.fleet.sample(dataclasses.replace(request, adapter=self.adapter))


class ServedSampling:
    """The servers ``generation.server`` names (``GenerationConfig.fleet``), with the pushes above.

    Args:
        model: the engine's model (a plain causal LM or the ``PeftModel`` of its training clients): the servers'
            architecture, tokenizer and base weights.
        tokenizer: its tokenizer.
        generation: ``backend`` (``vllm`` / ``hf``), ``server`` (``launch``, a URL, ``{urls: [...]}`` or
            ``{launch: {count: N}}``), ``server_threads``, ``vllm`` (engine options, the token file).
        max_lora_rank: the largest adapter rank pushed (a launched ``vllm serve``'s ``--max-lora-rank``).
        on_gpu: the engine runs on a GPU (a launched server then takes the GPUs after the first).
        max_adapters: named adapters a ``vllm serve`` keeps.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, generation: GenerationConfig, max_lora_rank: int,
                 on_gpu: bool = False, max_adapters: int = 64):  # fmt: skip
        servers = generation.fleet()
        if servers is None:
            raise ValueError("ServedSampling needs generation servers (generation.server: launch or URLs)")
        self.launched: LaunchedFleet | None = None
        if servers.launch is not None:
            self.launched = LaunchedFleet(servers.launch, generation, model, tokenizer, 0, int(on_gpu), max_lora_rank)
            endpoints = self.launched.endpoints()
        else:
            endpoints = [(url, None) for url in servers.urls or ()]
        try:
            context = BackendContext(model, tokenizer, 0, uuid.uuid4().hex)
            self.fleet = Fleet.connect(servers, endpoints, generation, context)
            engines = {m.replica.engine() for m in self.fleet.members}
        except BaseException:
            self.close()
            raise
        if len(engines) != 1:
            self.close()
            raise ValueError(f"tinker-serve --sampler-server: the servers run different engines ({sorted(engines)})")
        self.engine = engines.pop()
        self.max_adapters = max_adapters
        self.named: OrderedDict[str, None] = OrderedDict()  #: adapters the vLLM servers hold, oldest first
        self.holds: Any = None  #: the HF servers' weights: None (none yet), ``BASE`` or the snapshot key merged

    def backend(self, model: torch.nn.Module, key: str | None, snapshot: Any, config: Any) -> WithAdapter:
        """The backend that samples ``key``'s weights (``snapshot``: its ``Snapshot``; ``config``: the ``peft`` config
        of its LoRA shape; ``key`` None: the base model), pushing what the servers lack first."""
        if key is None:  # the base weights themselves (the HF server; the vLLM sampler names an all-zero adapter)
            if self.holds is not BASE:
                self.fleet.push(_base_weights(model))
                self.holds = BASE
            return WithAdapter(self.fleet, None)
        name = "tinker-" + hashlib.sha256(key.encode()).hexdigest()[:24]
        if self.engine == "vllm" and name in self.named:
            self.named.move_to_end(name)
            return WithAdapter(self.fleet, name)
        if self.engine == "hf" and self.holds == key:
            return WithAdapter(self.fleet, None)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in snapshot.state.items()}
        adapter = AdapterWeights(tensors, config_json(config), name if self.engine == "vllm" else None)
        up = self.fleet.up()
        self.fleet.push(adapter, base=lambda: _base_weights(model))  # the base first to a server without it
        if self.fleet.up() > up:  # a server rejoined: it holds none of the named adapters, which go again when asked
            self.named.clear()
        if self.engine == "hf":
            self.holds = key
            return WithAdapter(self.fleet, None)
        self.named[name] = None
        while len(self.named) > self.max_adapters:
            old, _ = self.named.popitem(last=False)
            for member in self.fleet.members:
                try:
                    member.replica.unload_adapter(old)
                except ReplicaDown:  # a server down holds nothing: it gets the adapters it needs when it rejoins
                    pass
        return WithAdapter(self.fleet, name)

    def close(self) -> None:
        fleet = getattr(self, "fleet", None)
        if fleet is not None:
            fleet.close()
        if self.launched is not None:
            self.launched.stop()


def _base_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The base model's weights under their plain names (a ``PeftModel``'s without any adapter)."""
    if is_peft_model(model):
        return list(plain_weights(model, merged=False))
    return list(model.state_dict().items())
