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
import sys
from collections.abc import Iterator

import torch
from torch import nn

from aitraining_pl.models.lora import base_model


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers of ``model`` (through a ``peft`` wrapper) in layer order; empty for a dense model."""
    names = ("TopKRouter", "TopkRouter")
    return [m for m in base_model(model).modules() if type(m).__name__.endswith(names) and hasattr(m, "top_k")]


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
        routes = torch.stack([torch.cat(calls) for calls in self.calls], 1)
        self.calls = [[] for _ in self.calls]
        return routes

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


def router_aux_loss(model: nn.Module, logits: list[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor | None:
    """``router_aux_loss_coef`` x the model's own load-balancing loss (Switch Transformer, Fedus et al. 2021, eqs.
    4-6, by the model's ``load_balancing_loss_func``) over the router ``logits`` of a forward on rows with
    ``attention_mask`` (N, L); None unless the config asks for it (``output_router_logits`` and a coefficient)."""
    lm = base_model(model)
    config = lm.config
    coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    loss_fn = getattr(sys.modules[type(lm).__module__], "load_balancing_loss_func", None)
    if not (getattr(config, "output_router_logits", False) and coef and logits and loss_fn is not None):
        return None
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return coef * loss_fn(tuple(logits), experts, config.num_experts_per_tok, attention_mask)
