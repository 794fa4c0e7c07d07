"""Routing replay for mixture-of-experts policies (R3: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers", arXiv:2510.11370).

The sampler records which experts each token was routed to (``recording``); the trainer's forward then routes every
recorded token to those experts (``replaying``), so the importance ratio pi_theta / pi_old compares the same
computation instead of drifting with every routing flip. As R3 does, only the choice of experts is replayed: the gate
weights are recomputed from the trainer's own router logits over the replayed experts (the model's gating function,
restricted to them: softmax over all experts gathered and, where the model normalises, renormalised, i.e. a softmax
over the replayed experts; DeepSeek-V3's sigmoid scores gathered, normalised and scaled), so the router still gets
gradients; with the sampler's own routes this is the model's forward exactly.

Routers are the transformers 5 ``*TopKRouter`` / ``*TopkRouter`` modules (``(logits, weights, indices)`` out):
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, ... A router whose gating this module does not reproduce is
caught on the first replayed call (its recomputed weights for its own routes differ from its own) with a clear error.

Routes are laid out as the decoder sees its tokens: (rows, columns, layers, top_k) int64 aligned with the rows'
``input_ids``, -1 where none was recorded (padding, a response's last token: routed as the model routes them).
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from aitraining_pl.models.lora import base_model


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers of ``model`` (through a ``peft`` wrapper) in layer order; empty for a dense model."""
    names = ("TopKRouter", "TopkRouter")
    return [m for m in base_model(model).modules() if type(m).__name__.endswith(names) and hasattr(m, "top_k")]


class RouteShape(NamedTuple):
    """What an MoE policy's routes look like: the decoder layer of each router (``moe_routers``' order: a model
    whose first layers are dense has fewer routers than layers), experts per token, and experts."""

    layers: tuple[int, ...]
    top_k: int
    experts: int


def route_shape(model: nn.Module) -> RouteShape | None:
    """``model``'s ``RouteShape``; None for a dense model."""
    wanted = set(moe_routers(model))
    routers = [(name, m) for name, m in base_model(model).named_modules() if m in wanted]
    if not routers:
        return None
    found = [re.search(r"layers\.(\d+)\.", name) for name, _ in routers]
    layers = tuple(int(m.group(1)) if m else i for i, m in enumerate(found))
    return RouteShape(layers, int(routers[0][1].top_k), int(routers[0][1].weight.shape[0]))


def router_rows(routes: torch.Tensor, shape: RouteShape) -> torch.Tensor:
    """``routes`` (T, layers, k) of the routers only: given one row per decoder layer (vLLM's ``routed_experts``, the
    dense layers' too) where the model has fewer routers than layers, the routers' layers; else as given."""
    depth = max(shape.layers) + 1
    if routes.ndim == 3 and routes.shape[1] == depth != len(shape.layers):
        return routes[:, list(shape.layers)]
    return routes


_WARNED: set[str] = set()


def warn_unrecorded(model: nn.Module, sampler: str, asked: bool) -> None:
    """Once per ``sampler``: a warning that it records no routes for ``model`` (an MoE policy) although routing replay
    is on (``asked``), so the trainer routes those rollouts itself."""
    if asked and sampler not in _WARNED and moe_routers(model):
        _WARNED.add(sampler)
        warnings.warn(
            f"routing replay: {sampler} records no routes, so the trainer routes these rollouts of an MoE policy "
            "itself (train/routing/flip_rate is not logged for them); set generation.routing_replay: false to "
            "silence this",
            RuntimeWarning,
            stacklevel=3,
        )


def placed_routes(rows: list[torch.Tensor | None], prompt_mask: torch.Tensor, width: int) -> torch.Tensor | None:
    """Each row's routes in the decoder's layout (the module docstring): ``rows`` hold, per response row, the
    routes (T, layers, k) of its prompt's tokens (the ``prompt_mask`` (N, P) positions, in order) then of its fed-back
    response tokens (a server's answer: ``generation.servers.answers``), placed in (N, P + ``width``, layers, k)
    int16, -1 elsewhere. None when a row has none."""
    if not rows or any(r is None for r in rows):
        return None
    n, prompt = prompt_mask.shape
    out = torch.full((n, prompt + width, *rows[0].shape[1:]), -1, dtype=torch.int16)
    for row, (routes, keep) in enumerate(zip(rows, prompt_mask.bool().cpu())):
        length = int(keep.sum())
        out[row, :prompt][keep] = routes[:length].to(torch.int16)
        out[row, prompt : prompt + routes.shape[0] - length] = routes[length:].to(torch.int16)
    return out


def flat_routes(routes: torch.Tensor, prompt_mask: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """The inverse of ``placed_routes``: per row of ``routes`` (N, P + R, layers, k), those of its prompt's tokens
    (``prompt_mask`` (N, P)) then of its first ``lengths - 1`` response tokens (the fed-back ones)."""
    prompt = prompt_mask.shape[1]
    return [torch.cat([row[:prompt][keep.bool()], row[prompt : prompt + max(int(length) - 1, 0)]])
            for row, keep, length in zip(routes, prompt_mask, lengths)]  # fmt: skip


def joined_routes(
    prompt_routes: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int, response_routes: torch.Tensor
) -> torch.Tensor:
    """``SampledTokens.routes`` (N, P + R, layers, k) int16 from the prefill's routes (B * P, layers, k) of the
    left-padded prompts (``prompt_mask`` (B, P); -1 on the padding), repeated for their ``num_samples`` rows, and
    the response tokens' (N, R, layers, k)."""
    prompt_routes = prompt_routes.reshape(*prompt_mask.shape, *prompt_routes.shape[1:]).to(torch.int16)
    prompt_routes = prompt_routes.masked_fill(~prompt_mask.bool()[..., None, None], -1)
    return torch.cat([prompt_routes.repeat_interleave(num_samples, 0), response_routes.to(prompt_routes.device)], 1)


def generated_routes(recorder: RouteRecorder, prompt_mask: torch.Tensor, width: int) -> torch.Tensor:
    """``SampledTokens.routes`` of a ``generate`` call on the rows (N, P) that ``recorder`` watched: its first pass
    is the prefill (N * P tokens), each later one feeds one token per row (its KV cache); a pass of any other size
    is refused (no route can be placed)."""
    calls = recorder.take_calls()
    n, prompt = prompt_mask.shape
    if not calls or calls[0].shape[0] != n * prompt or any(c.shape[0] != n for c in calls[1:]):
        sizes = [c.shape[0] for c in calls]
        raise NotImplementedError(
            f"routing replay: transformers' generate ran passes of {sizes} tokens for {n} rows of {prompt} prompt "
            "tokens (not one token per row per step), so the sampler's routes cannot be recorded; set "
            "generation.routing_replay: false"
        )
    response = torch.full((n, width, *calls[0].shape[1:]), -1, dtype=torch.int16, device=calls[0].device)
    if len(calls) > 1:
        response[:, : len(calls) - 1] = torch.stack(calls[1:], 1)[:, :width].to(torch.int16)
    return joined_routes(calls[0], prompt_mask, 1, response)


def gate_weights(router: nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(T, k) float32 gate weights of experts ``index`` (T, k) from router logits (T, E), by the router's gating
    function (see the module docstring)."""
    logits = logits.float()
    sigmoid = hasattr(router, "e_score_correction_bias")  # DeepSeek-V3's family: sigmoid scores
    weights = (logits.sigmoid() if sigmoid else logits.softmax(-1)).gather(1, index)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
    return weights * getattr(router, "routed_scaling_factor", 1.0)


class RouteRecorder:
    """Forward hooks on ``routers`` keeping the experts each call routed to; ``take`` returns them."""

    def __init__(self, routers: list[nn.Module]):
        self.calls: list[list[torch.Tensor]] = [[] for _ in routers]
        self.hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def hook(module, args, out):
            self.calls[layer].append(out[2].detach())

        return hook

    def take(self) -> torch.Tensor:
        """(T, layers, k) experts of the tokens of the forward passes since the last ``take`` (in their order)."""
        return torch.cat(self.take_calls())

    def take_calls(self) -> list[torch.Tensor]:
        """The (T_i, layers, k) experts of each forward pass since the last ``take``, one tensor per pass."""
        calls = [torch.stack(per_layer, 1) for per_layer in zip(*self.calls)]
        self.calls = [[] for _ in self.calls]
        return calls

    def give(self, routes: torch.Tensor) -> None:
        """Make ``routes`` (T, layers, k) what the next ``take`` returns (a caller that ran a larger pass hands back
        the tokens its caller expects)."""
        self.calls = [[routes[:, layer]] for layer in range(len(self.calls))]

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[RouteRecorder | None]:
    """A ``RouteRecorder`` on ``model``'s routers while inside; None for a dense model."""
    routers = moe_routers(model)
    recorder = RouteRecorder(routers) if routers else None
    try:
        yield recorder
    finally:
        if recorder is not None:
            recorder.close()


class RouteReplay:
    """Forward hooks making ``routers`` route the tokens of the next forward passes to ``routes`` (T, layers, k)
    (-1 rows: the router's own choice), with weights recomputed by ``gate_weights``. Counts how many (token, layer)
    pairs the router would have sent elsewhere (``flipped`` of ``replayed``), and keeps the router logits when
    ``keep_logits`` (the auxiliary loss)."""

    def __init__(self, routers: list[nn.Module], routes: torch.Tensor | None, keep_logits: bool = False):
        self.routes, self.keep_logits = routes, keep_logits
        self.flipped = self.replayed = 0
        self.logits: list[torch.Tensor] = []
        self.hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def hook(module, args, out):
            logits, weights, index = out
            if self.keep_logits:
                self.logits.append(logits)
            if self.routes is None:
                return None
            if self.routes.shape[0] != index.shape[0]:
                raise ValueError(
                    f"routing replay: {self.routes.shape[0]} recorded tokens for a forward of {index.shape[0]}"
                )
            if not torch.allclose(gate_weights(module, logits, index).to(weights.dtype), weights, atol=1e-6):
                raise NotImplementedError(f"routing replay does not reproduce the gating of {type(module).__name__}")
            recorded = self.routes[:, layer].to(index.device, torch.long)
            have = recorded[:, 0] >= 0
            flips = (recorded.sort(-1).values != index.sort(-1).values).any(-1) & have
            self.flipped += int(flips.sum())
            self.replayed += int(have.sum())
            chosen = torch.where(have[:, None], recorded, index)
            return logits, gate_weights(module, logits, chosen).to(weights.dtype), chosen

        return hook

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


@contextlib.contextmanager
def replaying(model: nn.Module, routes: torch.Tensor | None, keep_logits: bool = False) -> Iterator[RouteReplay]:
    """Inside, ``model``'s forward passes over rows (N, L) route as ``routes`` (N, L, layers, k) says
    (``RouteReplay``; None: the model's own routing, only the logits kept)."""
    flat = None if routes is None else routes.reshape(-1, *routes.shape[2:])
    replay = RouteReplay(moe_routers(model), flat, keep_logits)
    try:
        yield replay
    finally:
        replay.close()


def _aux_settings(model: nn.Module) -> tuple[float, int, int, object] | None:
    """(coefficient, experts, top_k, the model's ``load_balancing_loss_func``) where the config asks for the router's
    auxiliary loss (``output_router_logits`` and a coefficient), else None."""
    lm = base_model(model)
    config = lm.config
    coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    loss_fn = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
    if not (getattr(config, "output_router_logits", False) and coef and loss_fn is not None):
        return None
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return coef, int(experts), int(config.num_experts_per_tok), loss_fn


def router_aux_loss(model: nn.Module, logits: list[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor | None:
    """``router_aux_loss_coef`` x the model's own load-balancing loss (Switch Transformer, Fedus et al. 2021, eqs.
    4-6, by the model's ``load_balancing_loss_func``) over the router ``logits`` of a forward on rows with
    ``attention_mask`` (N, L); None unless the config asks for it (``output_router_logits`` and a coefficient)."""
    settings = _aux_settings(model)
    if settings is None or not logits:
        return None
    coef, experts, top_k, loss_fn = settings
    return coef * loss_fn(tuple(logits), experts, top_k, attention_mask)


class RouterLoad:
    r"""The load-balancing loss of a minibatch split into micro-batches (token budgets), exactly: the loss is
    ``experts * sum_e (T_e / N) (S_e / N)`` (transformers' ``load_balancing_loss_func``: ``T_e`` the top-k picks of
    expert ``e`` and ``S_e`` the sum of its router probabilities over the ``N`` real (token, layer) rows), linear in
    ``S`` given the counts ``T`` and ``N``, which carry no gradient. A first, gradient-free pass over the micro-batches
    ``add``\ s their counts; then each micro-batch's ``share`` is ``coef * experts * sum_e T_e S_e^micro / N^2`` with
    the minibatch's ``T`` and ``N``: the shares add up to the one-pass loss, in value and gradient."""

    def __init__(self) -> None:
        self.counting = True
        self.picks: torch.Tensor | float = 0.0
        self.rows: torch.Tensor | float = 0.0

    @staticmethod
    def sums(logits: list[torch.Tensor], attention_mask: torch.Tensor, experts: int, top_k: int):
        """(T (E,), S (E,), N) of ``logits`` (one (rows, E) tensor per layer) over the rows of ``attention_mask``."""
        flat = attention_mask.reshape(-1).float()
        picks = probs = 0.0
        for layer in logits:
            weights = layer.float().softmax(-1)
            chosen = weights.topk(top_k, dim=-1).indices.reshape(-1)
            zeros = torch.zeros(experts, device=layer.device)
            picks = picks + zeros.scatter_add(0, chosen, flat.to(layer.device).repeat_interleave(top_k))
            probs = probs + (weights * flat.to(layer.device)[:, None]).sum(0)
        return picks, probs, flat.sum() * len(logits)

    def add(self, model: nn.Module, logits: list[torch.Tensor], attention_mask: torch.Tensor) -> None:
        settings = _aux_settings(model)
        if settings is None or not logits:
            return
        picks, _, rows = self.sums([x.detach() for x in logits], attention_mask, settings[1], settings[2])
        self.picks, self.rows = self.picks + picks, self.rows + rows

    def share(self, model: nn.Module, logits: list[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor | None:
        settings = _aux_settings(model)
        if settings is None or not logits:
            return None
        coef, experts, top_k, _ = settings
        _, probs, _ = self.sums(logits, attention_mask, experts, top_k)
        return coef * experts * (self.picks * probs).sum() / self.rows**2
