"""Sampling for the Tinker-compatible server on the rollout engine (``aitraining_pl.rollout.RolloutEngine``, the
project's HF KV-cache decoder): sampler weights are snapshots of a training client's adapter, loaded into one
sampling adapter per LoRA shape when a request for them comes; the base model samples with every adapter off.

``sample`` follows ``tinker.types.SamplingParams``: ``max_tokens``, ``temperature`` (0: greedy), ``top_k`` (-1: no
limit), ``top_p``, ``seed`` (the same seed gives the same samples) and ``stop`` (``None``: the model's end tokens;
``[]``: none; token ids; strings, matched in the decoded text). Each sequence's ``logprobs`` are the model's own
(temperature 1, no filtering), what a training client's ``forward`` computes for the same tokens; prompt
log-probs come from a forward pass over the prompt."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import astuple, dataclass

import torch

from aitraining_pl.rollout import GenerationConfig, RolloutEngine
from aitraining_pl.tinker.engine import Engine, Lora
from aitraining_pl.tinker.wire import BadRequest, Datum

#: temperatures at or below this sample greedily
GREEDY = 1e-4
#: sampler snapshots kept in memory (the oldest go first; named ones can be read back from disk)
MAX_SNAPSHOTS = 64


@dataclass
class Snapshot:
    owner: str
    lora: Lora
    state: dict[str, torch.Tensor]


class Sampler:
    """Snapshots and sampling sessions on an ``Engine``."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.snapshots: OrderedDict[str, Snapshot] = OrderedDict()
        self.loaded: dict[Lora, str | None] = {}  # sampling adapter of each LoRA shape -> the snapshot in it

    def keep(self, key: str, snapshot: Snapshot) -> None:
        self.snapshots[key] = snapshot
        while len(self.snapshots) > MAX_SNAPSHOTS:
            self.snapshots.popitem(last=False)

    def run_snapshot(self, entry, key: str) -> str:
        self.keep(key, Snapshot(entry.owner, entry.lora, self.engine.adapter_state(entry.adapter)))
        return key

    def snapshot_of(self, owner: str, path: str) -> Snapshot:
        if path in self.snapshots and self.snapshots[path].owner == owner:
            return self.snapshots[path]
        meta, state = self.engine.read_checkpoint(self.engine.resolve(owner, path))
        snapshot = Snapshot(owner, Lora(**meta["lora"]), state)
        self.keep(path, snapshot)
        return snapshot

    def activate(self, key: str | None) -> None:
        """Put snapshot ``key`` into the sampling adapter of its LoRA shape (``None``: adapters off)."""
        if key is None:
            return
        snapshot = self.snapshots.get(key)
        if snapshot is None:
            raise BadRequest("these sampler weights are no longer held by the server; save them again")
        name = "sampler_" + "_".join(str(int(v)) for v in astuple(snapshot.lora))
        if snapshot.lora not in self.loaded:
            self.engine.add_adapter(name, snapshot.lora, 0)
            self.loaded[snapshot.lora] = None
        if self.loaded[snapshot.lora] != key:
            self.engine.load_adapter_state(name, snapshot.state)
            self.loaded[snapshot.lora] = key
        self.engine.use(name)

    def run_sample(self, key: str | None, prompt: list[int], params: dict, num_samples: int, prompt_logprobs: bool,
                   last_n: int | None = None):  # fmt: skip
        engine = self.engine
        model = engine.model
        off = key is None and hasattr(model, "disable_adapter")
        context = model.disable_adapter() if off else contextlib.nullcontext()
        self.activate(key)  # before gathering a sharded base: loading the snapshot puts FSDP's shards back
        with context, torch.no_grad(), engine.whole_base():
            sequences = self._generate(prompt, params, num_samples)
            scored = None
            if prompt_logprobs:
                datum = Datum(prompt[:-1], {"target_tokens": torch.tensor(prompt[1:])})
                scored = [float("nan")] + (engine.logprobs([datum], grad=False)[0].tolist() if len(prompt) > 1 else [])
                if last_n:  # only the last N are asked for (prompt_logprobs_last_n)
                    scored[: len(scored) - last_n] = [float("nan")] * (len(scored) - last_n)
        return sequences, scored

    def _generate(self, prompt: list[int], params: dict, num_samples: int) -> list[dict]:
        engine = self.engine
        stop = params.get("stop")
        end_ids, strings, sequences = None, None, []
        if isinstance(stop, str):
            strings = [stop]
        elif stop is not None:
            ints = [s for s in stop if isinstance(s, int)]
            strings = [s for s in stop if isinstance(s, str)] or None
            end_ids = ints
        temperature = float(params.get("temperature", 1.0))
        greedy = temperature <= GREEDY
        config = GenerationConfig(
            max_new_tokens=int(params.get("max_tokens") or 16),
            temperature=1.0 if greedy else temperature,
            top_k=max(int(params.get("top_k", -1)), 0),
            top_p=float(params.get("top_p", 1.0)),
            stop_strings=strings,
            do_sample=not greedy,
        )
        rollouts = RolloutEngine(engine.tokenizer, config, end_token_ids=end_ids, warn_truncation=False)
        ids = torch.tensor([prompt], dtype=torch.long, device=engine.device)
        seed = params.get("seed")
        rollout = rollouts.sample(engine.model, ids, torch.ones_like(ids), num_samples, with_logprobs=True, seed=seed)
        for i in range(num_samples):
            n = int(rollout.response_mask[i].sum())
            sequences.append({
                "tokens": rollout.response_ids[i, :n].tolist(),
                "logprobs": rollout.logprobs[i, :n].float().tolist(),
                "stop_reason": "stop" if bool(rollout.ended[i]) else "length",
            })  # fmt: skip
        return sequences


def check_sample(request: dict, vocab: int, max_tokens: int, max_samples: int) -> tuple[list[int], dict]:
    """The prompt's token ids and sampling params of a ``/api/v1/asample`` body, checked."""
    tokens = []
    for chunk in (request.get("prompt") or {}).get("chunks") or []:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise BadRequest("asample: only text prompts are served (no images or audio)")
        tokens.extend(int(t) for t in chunk.get("tokens") or [])
    if not tokens:
        raise BadRequest("asample: the prompt is empty")
    if min(tokens) < 0 or max(tokens) >= vocab:
        raise BadRequest(f"asample: prompt token ids outside [0, {vocab})")
    params = request.get("sampling_params") or {}
    limit = params.get("max_tokens") or 16
    if len(tokens) + int(limit) > max_tokens:
        raise BadRequest(f"asample: prompt ({len(tokens)}) plus max_tokens ({limit}) exceeds {max_tokens} tokens")
    last_n = request.get("prompt_logprobs_last_n")
    if last_n is not None and not 1 <= int(last_n) <= len(tokens) - 1:
        raise BadRequest(f"asample: prompt_logprobs_last_n must be 1 to {len(tokens) - 1}")
    if not 1 <= int(request.get("num_samples", 1)) <= max_samples:
        raise BadRequest(f"asample: num_samples must be 1 to {max_samples}")
    return tokens, params
