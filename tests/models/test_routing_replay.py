"""Routing replay for MoE policies (``models.routing_replay``, R3) on tiny random configs of every MoE architecture
of the matrix (``architectures.names(MOE)``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3)."""

from __future__ import annotations

import copy

import pytest
import torch
from architectures import MOE, build_sharpened, model_config, names

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


def test_the_vision_decoder_records_the_routes_the_trainer_replays():
    """A tiny Qwen3-VL-MoE (the ``tiny-qwen3-vl`` preset with 4 experts, 2 per token): the KV-cache decoder with
    images (``sample_with_images`` with ``record_routes``) records the experts of every prompt token (image tokens
    included) and fed-back response token; they are the ones the trainer's forward with the pixel values routes to
    (``vision_token_scores``), so replaying them flips none."""
    import transformers

    from aitraining_pl.datamodules.io import pad_sequences
    from aitraining_pl.datamodules.vision import encode_with_images, image_placeholder
    from aitraining_pl.generation.hf.vision_decoding import sample_with_images
    from aitraining_pl.models.routing_replay import recording
    from aitraining_pl.models.vision import VisionInputs
    from aitraining_pl.models.vision_presets import vision_preset
    from aitraining_pl.models.vision_scoring import vision_token_scores

    processor, config, _ = vision_preset("tiny-qwen3-vl")
    config = copy.deepcopy(config)
    config["text_config"].update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    torch.manual_seed(0)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model("qwen3_vl_moe", **fields)
    model = transformers.AutoModelForImageTextToText.from_config(hf_config).eval()
    placeholder = image_placeholder(processor)
    images = [torch.randint(0, 255, (32, 32, 3), dtype=torch.uint8).numpy() for _ in range(2)]
    from PIL import Image

    texts = [placeholder + t for t in ["a?", "bc?"]]
    encoded = [encode_with_images(processor, t, [Image.fromarray(i)]) for t, i in zip(texts, images)]
    ids = pad_sequences([e[0] for e in encoded], 0, side="left")
    mask = pad_sequences([[1] * len(e[0]) for e in encoded], 0, side="left")
    vision = VisionInputs([e[1] for e in encoded])
    generation = GenerationConfig(max_new_tokens=5, temperature=1.0)
    drawn = sample_with_images(model, ids, mask, vision, generation, [1], None, 0, 2, seed=3, record_routes=True)
    response = drawn.response_ids
    scored, _ = response_mask(response, [1], None)
    full = torch.cat([ids.repeat_interleave(2, 0), response], 1)
    attention = torch.cat([mask.repeat_interleave(2, 0), scored], 1)
    assert drawn.routes is not None and drawn.routes.shape[:2] == full.shape
    rows = vision.rows(torch.arange(4) // 2)
    with torch.no_grad(), recording(model) as recorder:
        vision_token_scores(model, full, attention, attention, rows)
    own = recorder.take_calls()[-1].reshape(*full.shape, *drawn.routes.shape[2:])
    have = drawn.routes[..., 0] >= 0
    assert int(have[:, ids.shape[1] :].sum()) > 0 and not have[attention == 0].any()
    assert torch.equal(drawn.routes[have].sort(-1).values.long(), own[have].sort(-1).values.long())
    with torch.no_grad(), replaying(model, drawn.routes) as replay:
        vision_token_scores(model, full, attention, attention, rows)
    assert replay.flipped == 0 and replay.replayed == int(have.sum())  # (token, layer) pairs


def test_multi_turn_episodes_record_the_routes_the_trainer_takes(monkeypatch):
    """The KV-cache episode decoder records the experts of the prompt, of every sampled token fed back, and of the
    environment's replies (prefilled with the turn's last token on the parked cache): over two-turn guessing games
    of a Qwen3-MoE they are the experts the trainer's forward routes the whole rows to (its attention: every real
    token), so replaying them flips none. The re-prefilling path (``reprefill``) records none and warns once;
    ``routing_replay: false`` records none, silently."""
    import warnings

    from episode_fixtures import prompt_tensors

    from aitraining_pl.environments.episode_rollout import sample_episodes
    from aitraining_pl.environments.multiturn import GuessingGame
    from aitraining_pl.models import load_tokenizer, routing_replay
    from aitraining_pl.rollout import RolloutEngine

    monkeypatch.setattr(routing_replay, "_WARNED", set())
    tokenizer = load_tokenizer("byte")
    texts = ["Guess 1-7:", "Go"]
    ids, mask = prompt_tensors(tokenizer, texts)
    moe = build_causal_lm({**model_config("qwen3_moe"), "vocab_size": 384, "eos_token_id": 1}, seed=0).eval()

    def episodes(replay: bool, **kw):
        engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=4, routing_replay=replay))
        game = GuessingGame(max_turns=2)
        return sample_episodes(engine, moe, game, texts, [{"secret": 3}, {"secret": 5}], ids, mask, 2, **kw)

    rollout = episodes(True)
    routes, full, attention = rollout.routes, rollout.input_ids, rollout.attention_mask
    assert routes is not None and routes.shape[:2] == full.shape
    with torch.no_grad(), routing_replay.recording(moe) as recorder:
        response_logps(moe, full, attention, ids.shape[1], 1.0, padding_free=False)
    own = recorder.take_calls()[-1].reshape(*full.shape, *routes.shape[2:])
    have = routes[..., 0] >= 0
    replies = rollout.episodes.response_attention.bool() & ~rollout.response_mask.bool()  # the environment's tokens
    assert bool(have[:, ids.shape[1] :][replies].all()) and not have[attention == 0].any()
    assert (attention.sum(1) - have[..., 0].sum(1)).tolist() == [1] * len(full)  # every real token but the last
    assert torch.equal(routes[have].sort(-1).values.long(), own[have].sort(-1).values.long())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert episodes(False).routes is None
    with pytest.warns(RuntimeWarning, match="this multi-turn episode sampler .* records no routes"):
        assert episodes(True, reprefill=True).routes is None


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_generates_fallback_records_the_routes_the_trainer_takes(name):
    """``generate`` (``drop_ended`` off, or a model without a plain cache) records routes too (``generated_routes``:
    the prefill's, then one token per row per step): they are the experts the trainer's forward routes the sampled
    rows to (-1 on the padding and from each response's last token on), so replaying them flips none."""
    model = _moe(name)
    torch.manual_seed(0)
    ids = torch.randint(3, 96, (2, P))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    config = hf_generation_config(GenerationConfig(max_new_tokens=8, temperature=1.0), [END], 0, True)
    sampled = sample_responses(model, ids, mask, config, None, False, SAMPLES, True)  # drop_ended off: generate
    response = sampled.response_ids
    scored, _ = response_mask(response, [END], None)
    full = torch.cat([ids.repeat_interleave(SAMPLES, 0), response], 1)
    attention = torch.cat([mask.repeat_interleave(SAMPLES, 0), scored], 1)
    routes = sampled.routes
    assert routes is not None and routes.shape[:2] == full.shape
    from aitraining_pl.models.routing_replay import recording

    with torch.no_grad(), recording(model) as recorder:
        response_logps(model, full, attention, P, 1.0, padding_free=False)
    own = recorder.take_calls()[-1].reshape(*full.shape, *routes.shape[2:])
    inside = routes[..., 0] >= 0
    inside &= attention.bool()[..., None]  # generate feeds every row until the longest ends: past an end is padding
    assert not (routes[:, :P][..., 0] >= 0)[mask.repeat_interleave(SAMPLES, 0) == 0].any()
    assert int(inside[:, P:].sum()) > 0
    assert torch.equal(routes[inside].sort(-1).values.long(), own[inside].sort(-1).values.long())
