"""Routing replay for MoE policies (``models.routing_replay``, R3) on tiny random configs of every MoE architecture
of the matrix (``architectures.names(MOE)``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3)."""

from __future__ import annotations

import copy

import pytest
import torch
from architectures import MOE, build_sharpened, names

from aitraining_pl.generation.config import GenerationConfig
from aitraining_pl.generation.hf.decoding import sample_responses
from aitraining_pl.generation.hf.generate import hf_generation_config
from aitraining_pl.models import build_causal_lm
from aitraining_pl.models.rollout_scoring import response_logps
from aitraining_pl.models.routing_replay import moe_routers, replaying, router_aux_loss
from aitraining_pl.rollout.engine import response_mask

P, SAMPLES, END = 6, 2, 2
#: relative size of the noise added to the trainer's router weights: small, yet it flips some routes
PERTURBATION = 0.1


def _moe(name: str) -> torch.nn.Module:
    """A sharpened tiny model (``build_sharpened``) whose experts are scaled by 4, so a flipped route shows."""
    model = build_sharpened(name).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if ".experts." in key:
                param.mul_(4.0)
    return model


def _rollout(model: torch.nn.Module):
    """Sampled rows (the prompts left-padded) with the sampler's log-probs and routes: (ids, attention, sampler
    log-probs (N, R), routes)."""
    torch.manual_seed(0)
    ids = torch.randint(3, 96, (3, P))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    config = hf_generation_config(GenerationConfig(max_new_tokens=12, temperature=1.0), [END], 0, True)
    sampled = sample_responses(model, ids, mask, config, None, True, SAMPLES, True)
    response = sampled.response_ids
    scored, _ = response_mask(response, [END], None)
    full = torch.cat([ids.repeat_interleave(SAMPLES, 0), response], 1)
    attention = torch.cat([mask.repeat_interleave(SAMPLES, 0), scored], 1)
    sampler = torch.log_softmax(sampled.logits, -1).gather(-1, response[..., None]).squeeze(-1) * scored
    return full, attention, sampler, sampled.routes


def _logprobs(model, full, attention, routes=None) -> tuple[torch.Tensor, tuple[int, int]]:
    with torch.no_grad(), replaying(model, routes) as replay:
        out = response_logps(model, full, attention, P, 1.0, padding_free=False).logprobs
    return out, (replay.flipped, replay.replayed)


def test_dense_models_have_no_routers():
    assert moe_routers(build_sharpened("llama")) == []


@pytest.mark.parametrize("name", names(MOE))
def test_replayed_routes_are_the_models_own_forward_and_survive_a_perturbation(name):
    """The sampler (KV-cache decoder) records the experts of every prompt and fed-back response token; the trainer's
    log-probs of the rollout, with and without replaying them, equal the sampler's (the recorded routes are the
    model's own: no flips). After noise of ``PERTURBATION`` on the trainer's router weights some routes flip:
    without replay the log-probs move by the flipped experts' outputs, with replay only by the gate weights'
    change; the mismatch without is at least 4x the one with (printed with ``-s``: the table of the report)."""
    model = _moe(name)
    full, attention, sampler, routes = _rollout(model)
    assert routes.shape[:2] == full.shape and routes.shape[2] == len(moe_routers(model))
    assert (routes[:, :P][attention[:, :P] == 0] == -1).all()  # padding: no route
    own, _ = _logprobs(model, full, attention)
    replayed, (flipped, counted) = _logprobs(model, full, attention, routes)
    torch.testing.assert_close(own, sampler, atol=1e-5, rtol=0)
    assert torch.equal(replayed, own) and flipped == 0 and counted > 0

    trainer = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in moe_routers(trainer):
            noise = torch.randn(router.weight.shape, generator=generator)
            router.weight.add_(noise * PERTURBATION * router.weight.abs().mean())
    without, _ = _logprobs(trainer, full, attention)
    with_replay, (flipped, counted) = _logprobs(trainer, full, attention, routes)
    gap_without, gap_with = ((x - sampler).abs().max().item() for x in (without, with_replay))
    print(
        f"\n{name}: flips {flipped}/{counted}, max |logp - sampler| without replay {gap_without:.2e}, "
        f"with replay {gap_with:.2e}"
    )
    assert flipped > 0
    assert gap_with * 4 < gap_without


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_router_aux_loss_is_the_models_own(name):
    """With ``output_router_logits`` the auxiliary loss from the replayed forward's router logits is
    ``router_aux_loss_coef`` x the model's own ``aux_loss`` (its ``forward`` on the same padded rows); None when
    the config does not ask for it."""
    from architectures import model_config

    config = {**model_config(name), "output_router_logits": True, "router_aux_loss_coef": 0.3}
    model = build_causal_lm(config, seed=0)
    ids = torch.randint(3, 96, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with replaying(model, None, keep_logits=True) as replay:
        model(input_ids=ids, attention_mask=mask)
    want = model(input_ids=ids, attention_mask=mask).aux_loss
    torch.testing.assert_close(router_aux_loss(model, replay.logits, mask), 0.3 * want)
    model.config.output_router_logits = False
    assert router_aux_loss(model, replay.logits, mask) is None
