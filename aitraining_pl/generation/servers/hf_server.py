"""``HFServerEngine``: the generation server's engine that samples with this project's own KV-cache decoder
(``hf_routes``: the HF server), so a server runs, and asynchronous training is tested, without vLLM (this
module never imports it), and CPU users get one.

**The model** is the policy's architecture (``meta_model``: built on the meta device, then materialised on
the GPU when there is one, else the CPU, by transformers' own ``init_weights``, which also computes the buffers no
checkpoint carries, such as rotary frequencies, and ties the tied weights). Its weights come only from the
trainer's pushes (``load``), by the names ``checks.WeightSpecs`` checks (the ``state_dict``'s, tied ones included).

**Sampling** is ``generation.hf.backend.HFBackend``'s: ``generation.hf.decoding``'s prefill and sampling loop with
``hf_generation_config(..., with_logprobs=True)`` (``generate`` where the model has no plain cache or
``drop_ended`` is off), a request's ``seed`` in a forked RNG (the same tokens as ``HFBackend.sample`` with that
seed), an unseeded request a seed drawn from the engine's own generator (``--seed``). The answer's
``sampling_logprobs`` are the log-probs of the sampled tokens under the distribution sampled from (the processed
scores, as ``rollout.RolloutEngine.rollout`` takes them), 0 after each response's end.

**In-flight weights** (AReaL, Fu et al. 2025, "interruptible rollouts"; PipelineRL's in-flight updates): ``stage``
hands the engine a push while it generates; before its next forward the decoder swaps the weights in (under the
engine's lock: a forward never sees half the weights), and the rows still decoding have their KV cache recomputed
under the new weights (AReaL's choice; PipelineRL keeps the stale cache), so every token is sampled from, and its
``sampling_logprobs`` are those of, one set of weights: a response may then span two versions, which
``token_versions`` records per token (the step of ``run:step``, -1 after the end). Each forward samples one token
column: column ``t`` comes from the ``t``-th forward (the prefill is the first). ``generate``'s fallback takes a
staged push only at the batch's end, and leaves where responses end to the rollout's end rule (as vLLM's answers
do: every column carries the step and its log-prob).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.backend import SampledTokens, SampleRequest
from aitraining_pl.generation.hf.decoding import Forward, prefill, sample_responses, sample_steps
from aitraining_pl.generation.hf.generate import hf_generation_config
from aitraining_pl.generation.version import WeightsVersion
from aitraining_pl.losses import positions_from_mask, selective_log_softmax
from aitraining_pl.models.loading import build_causal_lm, from_pretrained, one_line, resolve_dtype
from aitraining_pl.models.presets import MODEL_PRESETS
from aitraining_pl.models.rollout_scoring import response_logps
from aitraining_pl.models.routing_replay import RouteRecorder, flat_routes, joined_routes, placed_routes, recording
from aitraining_pl.models.tokens import padded

log = logging.getLogger(__name__)


def is_inline(model: str) -> bool:
    """Whether ``--model`` is a preset name or an inline JSON config (else a folder or a hub id)."""
    return model in MODEL_PRESETS or model.lstrip().startswith("{")


def meta_model(model: str, dtype: str | None) -> torch.nn.Module:
    """The policy's architecture on the meta device (no memory, no weights): ``model`` is a folder with a
    ``config.json``, a hub id, a preset name (``tiny-llama``) or an inline JSON config (``{"preset": ...}``)."""
    import json

    import transformers

    torch_dtype = resolve_dtype(dtype)
    if is_inline(model):
        try:
            spec = json.loads(model) if model.lstrip().startswith("{") else model
            with torch.device("meta"):
                return build_causal_lm(spec, dtype=torch_dtype)
        except ValueError as err:
            raise ConfigError(f"--model {model}", one_line(err)) from None
    from aitraining_pl.models.vision import is_vision_model_type

    config = from_pretrained(transformers.AutoConfig.from_pretrained, model, "model")
    auto = "AutoModelForImageTextToText" if is_vision_model_type(config.model_type) else "AutoModelForCausalLM"
    with torch.device("meta"):
        return getattr(transformers, auto).from_config(
            config, dtype=torch_dtype or getattr(config, "dtype", None) or torch.float32
        )


def load_teacher(engine: HFServerEngine, model: str) -> None:
    """Load ``model``'s own weights (a folder or hub id) into ``engine`` as a teacher's fixed version."""
    import transformers

    teacher = from_pretrained(transformers.AutoModelForCausalLM.from_pretrained, model, "model")
    engine.load(teacher.state_dict().items(), f"teacher {model}")


def materialise(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` (a transformers causal LM on the meta device) on ``device`` in eval mode, without gradients: its
    tensors allocated and initialised by its own ``init_weights`` (tied weights tied), its non-persistent buffers
    (rotary frequencies, which no push carries) computed again (``fresh_buffers``), the caller's random state
    untouched."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.to_empty(device=device)
        model.init_weights()
        fresh_buffers(model, device)
    return model.eval().requires_grad_(False)


def fresh_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Set the non-persistent buffers that ``to_empty`` left as uninitialised memory: ``init_weights`` of
    transformers 5.25 leaves a Llama's ``rotary_emb.inv_freq`` so (garbage frequencies: every position encoded
    wrongly, now and then NaN logits). Each module holding such buffers that was built from a ``config`` is built
    again on ``device`` and its buffers copied; one that was not is named in a warning."""
    for name, module in model.named_modules():
        buffers = [b for b in module._non_persistent_buffers_set if getattr(module, b, None) is not None]
        if not buffers:
            continue
        try:
            with torch.device(device):
                fresh = type(module)(module.config)
        except Exception as err:  # noqa: BLE001 - a module not built from its config alone
            log.warning("%s (%s): its buffers %s are not initialised (%s)", name, type(module).__name__, buffers, err)
            continue
        with torch.no_grad():
            for buffer in buffers:
                getattr(module, buffer).copy_(getattr(fresh, buffer))


class HFServerEngine:
    """The HF decoder behind a generation server (see the module docstring): ``load``, ``stage``, ``sample_many``,
    ``prompt_logprobs``, ``version``, ``cached_each``, ``close``.

    Args:
        model: the policy's architecture on the meta device (``meta_model``).
        seed: seeds the engine's generator, which gives the unseeded requests their seeds.
        device: where the model runs (default: ``cuda`` when available, else ``cpu``).
    """

    in_flight = True  #: a push may land while a batch generates (``stage``)
    kind = "HF"  #: how the server's ``ready`` names the engine (clients' messages: "HF server")

    def __init__(self, model: torch.nn.Module, seed: int = 0, device: str | torch.device | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = materialise(model, self.device)
        self.targets = self.model.state_dict()  #: views of the model's tensors by the names a push carries
        self.generator = torch.Generator().manual_seed(int(seed))
        self.lock = threading.Lock()  #: held while weights are copied in, and around each swap decision
        self.version: Any = None  #: the weights version held (None: none loaded yet)
        self.staged: tuple[list[tuple[str, torch.Tensor]], Any] | None = None  #: a push waiting for a decode step
        self.generating = False  #: a batch is being sampled (a push is staged, not copied)
        self.cached_each: list[int] = []  #: prompt tokens of each request found in a prefix cache: none here
        #: called with the column about to be computed before each forward (a test pauses the decoder here)
        self.before_forward: Callable[[int], None] | None = None

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: Any) -> None:
        """Copy ``(name, tensor)`` pairs (``state_dict`` names) into the model in place and record ``version``."""
        with self.lock:
            self._copy(weights, version)

    def stage(self, weights: Iterable[tuple[str, torch.Tensor]], version: Any) -> None:
        """Hand over a push without waiting for the running batch: loaded now when none runs, else swapped in
        before the batch's next forward (a later push replaces one not yet swapped in)."""
        weights = list(weights)
        with self.lock:
            if self.generating:
                self.staged = (weights, version)
            else:
                self._copy(weights, version)

    @torch.no_grad()
    def _copy(self, weights: Iterable[tuple[str, torch.Tensor]], version: Any) -> None:
        for name, tensor in weights:
            self.targets[name].copy_(tensor)
        self.version = version

    def swap(self) -> bool:
        """With ``lock`` held: load the staged push, if any; whether one was."""
        staged, self.staged = self.staged, None
        if staged is not None:
            self._copy(*staged)
        return staged is not None

    # ------------------------------------------------------------------ sampling
    def sample_many(self, requests: Sequence[SampleRequest], vision: Any = None) -> list[SampledTokens]:
        """Each request's ``SampledTokens`` (with ``sampling_logprobs`` and ``token_versions``). Requests that ask
        for the same sampling (``batch_key``) decode as one batch, each drawing its rows from a generator of its own
        seed, so its tokens are the ones it gets alone (up to the batch's float rounding); a push staged meanwhile is
        swapped in between two decode steps, else at the end. ``vision``: the ``models.vision.VisionInputs`` of a VL
        model's single request (``sample_images``)."""
        groups: dict[tuple, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(batch_key(request), []).append(index)
        results: list[SampledTokens | None] = [None] * len(requests)
        with self.lock:
            self.generating = True
        try:
            if vision is not None:
                results = [self.sample_images(requests[0], vision)]
            for indices in groups.values() if vision is None else ():
                for index, sampled in zip(indices, self.sample([requests[i] for i in indices])):
                    results[index] = sampled
        finally:
            with self.lock:
                self.generating = False
                self.swap()
        self.cached_each = [0] * len(requests)
        return results  # type: ignore[return-value]

    def seed_of(self, request: SampleRequest) -> int:
        """``request``'s seed, else one from the engine's own stream (``--seed``)."""
        if request.seed is not None:
            return int(request.seed)
        return int(torch.randint(0, 2**62, (1,), generator=self.generator))

    @torch.no_grad()
    def sample(self, requests: Sequence[SampleRequest]) -> list[SampledTokens]:
        """The ``num_samples`` responses per prompt of requests with one ``batch_key``, decoded as one batch; each
        request's rows drawn as ``HFBackend.sample`` draws them with its seed (``SeededDraw``)."""
        first, seeds = requests[0], [self.seed_of(request) for request in requests]
        generation, n = first.generation, int(first.num_samples)
        prompts = [row[keep.bool()] for r in requests for row, keep in zip(r.prompt_ids, r.prompt_mask)]
        ids, mask = padded(prompts, int(first.pad_token_id), "left", width=1, device=self.device)
        record = bool(getattr(generation, "routing_replay", False))
        with recording(self.model) if record else contextlib.nullcontext() as recorder:
            forward = _SwappingForward(self, ids, n, recorder)
            batch = prefill(forward, ids, mask, n) if generation.drop_ended else None
            if batch is not None:
                prompt_routes = recorder.take() if recorder is not None else None
                config = hf_generation_config(generation, first.end_ids, first.pad_token_id)
                sizes = [int(r.prompt_ids.shape[0]) * n for r in requests]
                draw = SeededDraw(seeds, sizes, self.device) if config.do_sample else None
                # the drawn tokens' log-probs only: never (N, R, vocab) on the server
                drawn = sample_steps(forward, batch, config, first.stop_rule, forward.park, chosen_logprobs=True,
                                     draw=draw, recorder=recorder)  # fmt: skip
        if batch is None:  # ``generate`` (no plain cache, or ``drop_ended`` off): one request at a time
            return [self.generated(request, seed) for request, seed in zip(requests, seeds)]
        routes = None
        if recorder is not None and drawn.routes is not None:
            routes = joined_routes(prompt_routes, mask, n, drawn.routes)
            for rows, rerouted in forward.rerouted:  # a swap recomputed these rows' routes with the new weights
                routes[rows, : rerouted.shape[1]] = rerouted
            routes[:, : mask.shape[1]].masked_fill_(~mask.bool().repeat_interleave(n, 0)[..., None, None], -1)
        answers, begin = [], 0
        for request, size in zip(requests, sizes):
            rows = slice(begin, begin + size)
            width = int(drawn.lengths[rows].max()) if size else 0
            answer = answered(drawn.tokens[rows, :width], drawn.chosen[rows, :width], drawn.lengths[rows],
                              forward.steps, request.prompt_ids.device)  # fmt: skip
            if routes is not None:  # in the request's own layout: its prompts' padding, then the response
                flat = flat_routes(routes[rows], mask.repeat_interleave(n, 0)[rows], drawn.lengths[rows])
                mine = placed_routes(flat, request.prompt_mask.repeat_interleave(n, 0), width)
                answer = answer._replace(routes=mine.to(request.prompt_ids.device))
            answers.append(answer)
            begin += size
        return answers

    def generated(self, request: SampleRequest, seed: int) -> SampledTokens:
        """One request by ``generate``: no swap inside it (a staged push waits for the batch's end); its ends are
        left to the rollout's end rule, as vLLM's are: every column counts."""
        generation, n = request.generation, int(request.num_samples)
        ids, mask = request.prompt_ids.to(self.device), request.prompt_mask.to(self.device)
        with self.lock:
            steps = [getattr(WeightsVersion.parse(self.version), "step", 0)] * int(generation.max_new_tokens)
        config = hf_generation_config(generation, request.end_ids, request.pad_token_id, with_logprobs=True)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            record = bool(getattr(generation, "routing_replay", False))
            sampled = sample_responses(self.model, ids, mask, config, request.stop_rule, False, n, record)
        tokens = sampled.response_ids
        lengths = torch.full((tokens.shape[0],), tokens.shape[1])
        answer = answered(
            tokens, selective_log_softmax(sampled.scores, tokens), lengths, steps, request.prompt_ids.device
        )
        return answer._replace(routes=None if sampled.routes is None else sampled.routes.to(answer.response_ids.device))

    @torch.no_grad()
    def sample_images(self, request: SampleRequest, vision: Any) -> SampledTokens:
        """A VL model's samples of prompts with their images (``generation.hf.vision_decoding``; ``vision``: the
        prompts' ``VisionInputs``), by the held weights on every token (a push staged meanwhile waits for the end)."""
        from aitraining_pl.generation.hf.vision_decoding import sample_with_images

        ids, mask = request.prompt_ids.to(self.device), request.prompt_mask.to(self.device)
        sampled = sample_with_images(self.model, ids, mask, vision, request.generation, list(request.end_ids),
                                     request.stop_rule, request.pad_token_id, int(request.num_samples),
                                     self.seed_of(request),
                                     chosen_logprobs=True)  # fmt: skip
        tokens, logprobs = sampled.response_ids, sampled.sampling_logprobs.float()
        with self.lock:
            step = getattr(WeightsVersion.parse(self.version), "step", 0)
        device = request.prompt_ids.device
        versions = torch.full_like(tokens, step).to(device)
        return SampledTokens(tokens.to(device), sampling_logprobs=logprobs.to(device), token_versions=versions)

    # ------------------------------------------------------------------ scoring (a served teacher)
    @torch.no_grad()
    def prompt_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int) -> torch.Tensor:
        """(N, L - ``start``) float32 log-probs of ``input_ids[:, start:]`` (left padded, 0 on the padding) under
        the model's untruncated softmax at temperature 1 (``models.rollout_scoring.response_logps``)."""
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        with self.lock:
            scores = response_logps(self.model, ids, mask, int(start), temperature=1.0).logprobs
        return scores.float().cpu()

    def close(self) -> None:
        """Drop the model."""
        self.model = self.targets = None


def batch_key(request: SampleRequest) -> tuple:
    """What requests must share to decode as one batch: the generation options, end ids, stops, padding and samples
    per prompt."""
    rule = request.stop_rule
    stops = (tuple(rule.stop_strings), tuple(map(tuple, rule.stop_sequences)), rule.skip_special_tokens) if rule else ()
    return (repr(request.generation), tuple(int(t) for t in request.end_ids), stops, int(request.pad_token_id),
            int(request.num_samples))  # fmt: skip


class SeededDraw:
    """``sample_steps``' draw for a batch of requests: request ``r`` owns ``sizes[r]`` consecutive response rows,
    drawn by ``torch.multinomial`` from a generator seeded with ``seeds[r]``: the same tokens as ``torch.manual_seed
    (seeds[r])`` and the request alone, whatever else shares the batch (its rows that are still going depend on its
    own tokens only)."""

    def __init__(self, seeds: Sequence[int], sizes: Sequence[int], device: torch.device):
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]
        self.owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(device)

    def __call__(self, scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)
        if len(self.generators) == 1:
            return torch.multinomial(probs, 1, generator=self.generators[0]).squeeze(1)
        owners = self.owner[rows]
        tokens = torch.empty(rows.shape[0], dtype=torch.long, device=scores.device)
        for r in owners.unique().tolist():
            at = (owners == r).nonzero().flatten()
            tokens[at] = torch.multinomial(probs[at], 1, generator=self.generators[r]).squeeze(1)
        return tokens


def answered(tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor, steps: Sequence[int],
             device: torch.device) -> SampledTokens:  # fmt: skip
    """``SampledTokens`` of rows ``tokens`` (N, R) of ``lengths`` tokens: their log-probs and the weights step of
    each column (``steps[t]``), 0 and -1 after each row's end."""
    columns = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    inside = columns < lengths.to(tokens.device)[:, None]
    versions = torch.tensor(list(steps[: tokens.shape[1]]), dtype=torch.long, device=tokens.device)
    versions = torch.where(inside, versions[None, :].expand_as(tokens), torch.full_like(tokens, -1))
    return SampledTokens(tokens.to(device), sampling_logprobs=(logprobs * inside).float().to(device),
                         token_versions=versions.to(device))  # fmt: skip


class _SwappingForward(Forward):
    """The decoder's forward for one request of ``engine``: before each forward it swaps in a staged push (under
    the engine's lock) and records the step of the weights that compute it (``steps[t]`` samples column ``t``);
    after a swap in a decode step it recomputes the KV cache of the rows still decoding under the new weights.
    It follows which rows those are (their tokens so far) through the sampling loop's ``park`` hook."""

    def __init__(self, engine: HFServerEngine, prompt_ids: torch.Tensor, num_samples: int,
                 recorder: RouteRecorder | None = None):  # fmt: skip
        super().__init__(engine.model)
        self.engine, self.recorder = engine, recorder
        self.steps: list[int] = []  #: the weights step of each forward
        self.ids = prompt_ids.repeat_interleave(num_samples, 0)  #: the decoding rows' tokens so far
        self.rows = torch.arange(self.ids.shape[0], device=self.ids.device)  #: their response rows
        self.kept: torch.Tensor | None = None  #: the rows of the last batch still decoding (after a ``park``)
        #: (response rows, their routes (rows, T, layers, k)) of each recomputed cache (an MoE model's, recorded)
        self.rerouted: list[tuple[torch.Tensor, torch.Tensor]] = []

    def park(self, rows: torch.Tensor, done: torch.Tensor, batch: Any) -> None:
        """``sample_steps``' hook: rows ``done`` of the batch ended and leave it before the next forward."""
        keep = torch.ones(batch.logits.shape[0], dtype=torch.bool, device=done.device)
        keep[done] = False
        self.kept = keep.nonzero().flatten()

    def __call__(self, ids, mask, positions, cache=None):
        engine = self.engine
        if engine.before_forward is not None:
            engine.before_forward(len(self.steps))
        with engine.lock:
            swapped = engine.swap()
            self.steps.append(getattr(WeightsVersion.parse(engine.version), "step", 0))
        if cache is None:  # the prefill
            return super().__call__(ids, mask, positions)
        if self.kept is not None:
            kept, self.kept = self.kept.to(self.ids.device), None
            self.ids, self.rows = self.ids[kept], self.rows[kept]
        self.ids = torch.cat([self.ids, ids], dim=1)
        if not swapped:
            return super().__call__(ids, mask, positions, cache)
        out = super().__call__(self.ids, mask, positions_from_mask(mask))  # the cache was the old weights': again
        if self.recorder is not None:  # every token of these rows now routes by the new weights
            routes = self.recorder.take()
            routes = routes.reshape(*self.ids.shape, *routes.shape[1:])
            self.rerouted.append((self.rows, routes.to(torch.int16)))
            self.recorder.give(routes[:, -1])  # what the sampling loop records for this step
        return out
