"""Sampling that takes ended rows out of the batch: the rollout engine's decoder for plain KV-cache decoders.

``generate`` keeps every row in its batch until the last one ends. A response that ended at token 10 of 128
still runs through the model 118 more times, its tokens thrown away as padding, and in a GRPO batch of 64
samples one long response keeps all 64 rows running. ``decode`` samples the same way ``generate`` does:

- the same distribution: transformers' own temperature, top-k and top-p warpers, in ``generate``'s order, then
  a softmax and ``torch.multinomial`` (or the argmax when greedy);
- the same positions for left-padded prompts (``losses.positions_from_mask``, counting on by one per token) and
  the same growing attention mask;
- the same end: an end token or a stop (``StopRule``) ends a row; its later tokens are padding.

But it drops ended rows from the batch and from the KV cache (``Cache.batch_select_indices``), so decoding
costs what the real tokens cost. Until the first row is dropped it draws exactly what ``generate`` draws from
the same seed (tested); afterwards each row still samples from the same distribution, from a different part of
the random stream. Each full-attention layer's keys and values live in a buffer with room for the whole response
(``_PreallocatedLayer``): a step writes one position instead of copying the cache to append it.

The loop itself (``sample_steps``: warp, draw, end or stop, drop ended rows) is the one both decoders run: the
episode decoder (``generation.hf.episode_decoding``) passes a ``park`` hook that keeps the cache of each row that
ended its turn, to resume it after the environment's reply.

It needs a model whose forward builds a ``DynamicCache`` of plain attention layers, which every transformers
decoder of the test matrix does except hybrid state-space ones (falcon_h1). ``decode`` returns None for any
other model, before any sampling, and ``sample_responses`` (the rollout engine's sampler) then calls
``generate`` (``generation.hf.generate.hf_generate``).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers import GenerationConfig as HFGenerationConfig

from aitraining_pl.generation.backend import SampledTokens, StopRule
from aitraining_pl.generation.hf.generate import ResponseStoppingCriteria, hf_generate
from aitraining_pl.losses import positions_from_mask
from aitraining_pl.models.lora import base_model
from aitraining_pl.models.routing_replay import RouteRecorder, generated_routes, joined_routes, recording

try:  # recent transformers keep a cache as a list of layers; earlier ones as key and value lists
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    PLAIN_LAYERS: tuple[type, ...] = (DynamicLayer, DynamicSlidingWindowLayer)
except ImportError:  # pragma: no cover - older transformers (no layer objects: ``_preallocate`` is not reached)
    DynamicLayer = object
    PLAIN_LAYERS = ()

#: models found not to build a plain cache (``decode`` leaves them to ``generate`` without trying again)
_UNSUPPORTED: weakref.WeakSet = weakref.WeakSet()


def warpers(config: HFGenerationConfig) -> LogitsProcessorList:
    """The logits warpers ``generate`` applies for ``config`` (temperature, top-k, top-p; none when greedy)."""
    out = LogitsProcessorList()
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            out.append(TemperatureLogitsWarper(config.temperature))
        out.extend(_filters(config.top_k, config.top_p))
    return out


def _filters(top_k: int | None, top_p: float | None) -> list:
    out = [TopKLogitsWarper(top_k=top_k)] if top_k else []
    return out + ([TopPLogitsWarper(top_p=top_p)] if top_p is not None and top_p < 1.0 else [])


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then nucleus (top-p, Holtzman et al. 2020) filtering as ``generate`` and ``decode`` apply it (the
    same warpers): removed entries become ``-inf``.

    Args:
        logits: (V,) or (B, V) scores (already divided by the temperature).
        top_k: keep the ``top_k`` highest (0 keeps all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1.0 keeps all).
    """
    rows = logits.unsqueeze(0) if logits.dim() == 1 else logits
    ids = torch.zeros(rows.shape[0], 1, dtype=torch.long, device=logits.device)  # the warpers do not read them
    for warp in _filters(top_k, top_p):
        rows = warp(ids, rows)
    return rows.reshape(logits.shape).clone()


class Forward:
    """One forward pass of a transformers causal LM with its KV cache, whatever its version calls the cache
    (``cache`` in transformers 5, ``past_key_values`` before): the last position's logits (float32) and the cache.
    An MoE model's router logits are not asked for (its config's ``output_router_logits`` is for training)."""

    def __init__(self, model: torch.nn.Module):
        params = inspect.signature(base_model(model).forward).parameters
        self.model = model
        self.cache_name = "cache" if "cache" in params else "past_key_values"
        self.keep_last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        if "output_router_logits" in params:  # an MoE config's aux loss is the trainer's, not the decoder's
            self.keep_last["output_router_logits"] = False

    def __call__(self, ids, mask, positions, cache=None):
        kwargs = {self.cache_name: cache} if cache is not None else {}
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs, **self.keep_last
        )
        cache = out.get("cache")
        if cache is None:
            cache = out.get("past_key_values")
        return out.logits[:, -1].to(copy=True, dtype=torch.float32), cache


class _PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views into buffers with room for ``capacity`` positions.

    ``DynamicLayer.update`` concatenates: every step copies the layer's whole cache to append one position, so
    a response of R tokens copies the cache R times (with 64 rows x 128 tokens that was over a third of the
    decoding time on CPU). Here a step writes its position in place; dropping rows copies the filled part once.
    Only what ``decode`` calls after the prefill keeps the buffers right (``update``, ``batch_select_indices``).
    """

    def __init__(self, layer: DynamicLayer, capacity: int):
        super().__init__()
        self.device, self.is_initialized, self.length = layer.keys.device, True, layer.keys.shape[-2]
        rows = torch.arange(layer.keys.shape[0], device=self.device)
        self._keys, self._values = (self._buffer(t, rows, capacity) for t in (layer.keys, layer.values))
        self._view()

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, length: int) -> _PreallocatedLayer:
        """A layer over buffers (rows, heads, capacity, dim) already holding its first ``length`` positions."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer.device, layer.is_initialized, layer.length = keys.device, True, length
        layer._keys, layer._values = keys, values
        layer._view()
        return layer

    def _buffer(self, filled: torch.Tensor, rows: torch.Tensor, capacity: int) -> torch.Tensor:
        """A new buffer holding the first ``length`` positions of ``rows`` of ``filled`` (one copy)."""
        out = filled.new_empty(len(rows), *filled.shape[1:-2], capacity, filled.shape[-1])
        torch.index_select(filled[..., : self.length, :], 0, rows, out=out[..., : self.length, :])
        return out

    def _view(self) -> None:
        self.keys, self.values = self._keys[..., : self.length, :], self._values[..., : self.length, :]

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self._keys[..., self.length : end, :] = key_states
        self._values[..., self.length : end, :] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        capacity = self._keys.shape[-2]
        self._keys, self._values = (self._buffer(t, indices, capacity) for t in (self._keys, self._values))
        self._view()


def _preallocate(cache: DynamicCache, capacity: int) -> None:
    """Give each plain full-attention layer of ``cache`` room for ``capacity`` positions (``_PreallocatedLayer``);
    sliding-window layers, which drop old positions, keep concatenating, as do caches without layer objects
    (older transformers)."""
    for i, layer in enumerate(getattr(cache, "layers", None) or ()):
        if type(layer) is DynamicLayer and layer.is_initialized:
            cache.layers[i] = _PreallocatedLayer(layer, capacity)


def preallocated_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> DynamicCache:
    """A ``DynamicCache`` over per-layer (keys, values) buffers (rows, heads, capacity, dim) whose first ``length``
    positions are filled; later steps write into the rest in place (``_PreallocatedLayer``)."""
    cache = DynamicCache()
    cache.layers = [_PreallocatedLayer.over(keys, values, length) for keys, values in layers]
    return cache


def plain_cache(cache, sliding: bool = True) -> bool:
    """Whether ``cache`` is a ``DynamicCache`` of plain attention layers, whose rows can be selected (``decode``).

    ``sliding=False`` asks for full-attention layers only, held as layer objects: the episode decoder pads parked
    rows inside the cache, which a sliding window would count as positions (the window would shift)."""
    layers = getattr(cache, "layers", None)
    if type(cache) is not DynamicCache:
        return False
    if not sliding:
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
    return layers is None or all(type(layer) in PLAIN_LAYERS for layer in layers)


def next_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """The next token of each row from its warped ``scores`` (N, V): sampled, or the argmax without sampling."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return scores.argmax(dim=-1)


@dataclass
class DecodeBatch:
    """The rows being decoded: each row's next-token logits (N, V), their KV cache, attention mask (N, L) and
    last positions (N, 1)."""

    logits: torch.Tensor
    cache: DynamicCache
    mask: torch.Tensor
    position: torch.Tensor


class SampledSteps(NamedTuple):
    """What ``sample_steps`` drew, per row: the tokens (N, R), padded after each row's end, R the steps until the
    last row ended; how many tokens each row sampled (N,); whether it ended by an end token or stop (N,; False:
    ``max_new_tokens``); with ``output_logits`` the raw logits and warped scores (N, R, V), zeros after the end; with
    ``chosen_logprobs`` the log-probs of the drawn tokens under the warped distribution (N, R), zeros after the
    end: what a sampler reports, without holding (N, R, V)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    ended: torch.Tensor
    logits: torch.Tensor | None
    scores: torch.Tensor | None
    chosen: torch.Tensor | None = None
    #: with a ``recorder``, (N, R, layers, k) int16 the experts each sampled token was routed to when it was fed
    #: back (``models.routing_replay``), -1 for a row's last token (never fed back) and after its end
    routes: torch.Tensor | None = None


#: ``park(rows, index, batch)``: rows ``index`` of ``batch`` (response rows ``rows``) ended; called before they
#: leave the batch, so a caller can keep their cache (the episode decoder resumes them after the environment's reply)
Park = Callable[[torch.Tensor, torch.Tensor, DecodeBatch], None]


def prefill(
    forward: Forward, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int, sliding: bool = True
) -> DecodeBatch | None:
    """Run the left-padded prompts (B, P) through the model once and repeat each prompt's cache, mask, position
    and logits for its ``num_samples`` rows (``repeat_interleave`` order). None when the cache the model built is
    not ``plain_cache(cache, sliding)`` (the caller then leaves the prompts to ``generate``)."""
    positions = positions_from_mask(prompt_mask)
    logits, cache = forward(prompt_ids, prompt_mask, positions)
    if not plain_cache(cache, sliding):
        return None
    mask, position = prompt_mask, positions[:, -1:]
    if num_samples > 1:  # every sample of a prompt starts from the prompt's one cache
        cache.batch_repeat_interleave(num_samples)
        logits, mask, position = (t.repeat_interleave(num_samples, 0) for t in (logits, mask, position))
    return DecodeBatch(logits, cache, mask, position)


def _going(
    tokens: torch.Tensor, ends: torch.Tensor, stop_rule: StopRule | None, prefixes: list[list[int]] | None
) -> torch.Tensor:
    """(N,) bool: the rows whose new token (``tokens``) is neither an end id nor completes a stop. With a stop
    rule, ``prefixes`` (each batch row's response so far, on the host) get the tokens appended: one host read of
    the step's tokens for all rows, not one per row."""
    going = ~torch.isin(tokens, ends)
    if stop_rule and prefixes is not None:
        for prefix, token in zip(prefixes, tokens.tolist()):
            prefix.append(token)
        stops = torch.tensor([stop_rule.stops(prefix) for prefix in prefixes], dtype=torch.bool)
        going &= ~stops.to(going.device, non_blocking=True)
    return going


@torch.no_grad()
def sample_steps(
    forward: Forward,
    batch: DecodeBatch,
    config: HFGenerationConfig,
    stop_rule: StopRule | None = None,
    park: Park | None = None,
    chosen_logprobs: bool = False,
    draw: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    recorder: RouteRecorder | None = None,
) -> SampledSteps:
    """The one sampling loop of both decoders: up to ``config.max_new_tokens`` tokens for each row of ``batch``.

    Each step warps the logits as ``generate`` does (``warpers``), draws (``next_tokens``; ``draw(scores, rows)``
    instead when given, ``rows`` the response row of each batch row: a server drawing each request's rows from its
    own seeded generator), ends the rows whose
    token is an end id or completes a stop, hands them to ``park`` (all rows still going at the last step too),
    and drops them from the batch and its cache before the next forward pass. The cache's full-attention layers
    are preallocated for the whole response (``_PreallocatedLayer``). With a ``recorder`` (an MoE model's
    ``models.routing_replay.RouteRecorder``) the experts of each fed-back token are kept (``SampledSteps.routes``)."""
    steps, logits, cache, mask, position = config.max_new_tokens, batch.logits, batch.cache, batch.mask, batch.position
    n, device, warp = logits.shape[0], logits.device, warpers(config)
    ends = torch.tensor(list(config.eos_token_id or []), dtype=torch.long, device=device)
    _preallocate(cache, mask.shape[1] + steps)
    responses = torch.full((n, steps), int(config.pad_token_id), dtype=torch.long, device=device)
    raw = scored = None
    if config.output_logits:
        raw = torch.zeros(n, steps, logits.shape[-1], device=device)
        scored = torch.zeros_like(raw)
    chosen = torch.zeros(n, steps, device=device) if chosen_logprobs else None
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    ended = torch.zeros(n, dtype=torch.bool, device=device)
    rows = torch.arange(n, device=device)  # the response row of each batch row; every batch row is unfinished
    prefixes = [[] for _ in range(n)] if stop_rule else None  # the batch rows' responses on the host (stop rule)
    routes = None
    for t in range(steps):
        scores = warp(responses[rows, :t], logits)
        tokens = next_tokens(scores, config.do_sample) if draw is None else draw(scores, rows)
        responses[rows, t] = tokens
        if raw is not None:
            raw[rows, t], scored[rows, t] = logits, scores
        if chosen is not None:
            chosen[rows, t] = torch.log_softmax(scores.float(), -1).gather(1, tokens[:, None]).squeeze(1)
        going = _going(tokens, ends, stop_rule, prefixes)
        stopped = ~going
        if t + 1 == steps:
            going = torch.zeros_like(going)
        if not going.all():
            done = (~going).nonzero().flatten()
            lengths[rows[done]], ended[rows[done]] = t + 1, stopped[done]
            if park is not None:
                park(rows[done], done, DecodeBatch(logits, cache, mask, position))
            if not going.any():
                break
            keep = going.nonzero().flatten()  # drop the ended rows (one copy of the cache, as a step's append makes)
            cache.batch_select_indices(keep)
            rows, mask, position, tokens = rows[keep], mask[keep], position[keep], tokens[keep]
            if prefixes is not None:
                prefixes = [prefixes[i] for i in keep.tolist()]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        position = position + 1
        logits, cache = forward(tokens[:, None], mask, position, cache)
        if recorder is not None:
            step = recorder.take()
            if routes is None:
                routes = torch.full((n, steps, *step.shape[1:]), -1, dtype=torch.int16, device=device)
            routes[rows, t] = step.to(torch.int16)
    width = int(lengths.max()) if n else 0
    if routes is not None:
        routes = routes[:, :width]
    if raw is not None:
        raw, scored = raw[:, :width], scored[:, :width]
    return SampledSteps(
        responses[:, :width], lengths, ended, raw, scored, None if chosen is None else chosen[:, :width], routes
    )


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: HFGenerationConfig,
    stop_rule: StopRule | None = None,
    num_samples: int = 1,
    record_routes: bool = False,
) -> SampledTokens | None:
    """Sample ``num_samples`` responses for each left-padded prompt (B, P) as ``generate`` would for the prompts
    repeated (``repeat_interleave``) with ``config`` (``generation.hf.generate.hf_generation_config``:
    ``max_new_tokens``, sampling settings, end ids, pad id, ``output_logits`` / ``output_scores``), dropping
    ended rows as it goes (see the module docstring). Each prompt runs through the model once; its KV cache is
    then repeated for its samples.

    Returns:
        ``SampledTokens``: response ids (N, R), N = B * ``num_samples`` rows in ``repeat_interleave`` order, R
        the steps until every row ended or ``max_new_tokens``, padded after each row's end; with
        ``config.output_logits`` the raw logits and the warped scores (N, R, V) of every step a row was sampled
        at (zeros after it ended). None, with nothing sampled, when the model does not build a plain
        ``DynamicCache`` (``plain_cache``). With ``record_routes`` and an MoE model, the experts every prompt and
        response token was routed to (``SampledTokens.routes``).
    """
    if model in _UNSUPPORTED:
        return None
    forward = Forward(model)
    with recording(model) if record_routes else contextlib.nullcontext() as recorder:
        batch = prefill(forward, prompt_ids, prompt_mask, num_samples)
        if batch is None:
            _UNSUPPORTED.add(model)
            return None
        prompt_routes = recorder.take() if recorder is not None else None
        drawn = sample_steps(forward, batch, config, stop_rule, recorder=recorder)
    routes = None
    if recorder is not None and drawn.routes is not None:
        routes = joined_routes(prompt_routes, prompt_mask, num_samples, drawn.routes)
    return SampledTokens(drawn.tokens, drawn.logits, drawn.scores, routes=routes)


def sample_responses(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: HFGenerationConfig,
    stop_rule: StopRule | None = None,
    drop_ended: bool = True,
    num_samples: int = 1,
    record_routes: bool = False,
) -> SampledTokens:
    """The rollout engine's sampler: ``num_samples`` responses per prompt (rows in ``repeat_interleave``
    order) by ``decode`` where the model allows it and ``drop_ended``, else by ``generate`` (``hf_generate``,
    on the repeated prompts) with the same settings and stop rule. ``record_routes``: an MoE model's routes too
    (``SampledTokens.routes``; ``generate``'s by ``generated_routes``)."""
    sampled = None
    if drop_ended:
        sampled = decode(model, prompt_ids, prompt_mask, config, stop_rule, num_samples, record_routes)
    if sampled is None:
        prompt_ids, prompt_mask = (
            prompt_ids.repeat_interleave(num_samples, 0),
            prompt_mask.repeat_interleave(num_samples, 0),
        )
        end_ids = list(config.eos_token_id or [])
        stops = [ResponseStoppingCriteria(stop_rule, prompt_ids.shape[1], end_ids)] if stop_rule else []
        with recording(model) if record_routes else contextlib.nullcontext() as recorder:
            sampled = hf_generate(model, prompt_ids, prompt_mask, config, StoppingCriteriaList(stops))
            if recorder is not None:
                routes = generated_routes(recorder, prompt_mask, sampled.response_ids.shape[1])
                sampled = sampled._replace(routes=routes)
    return sampled
