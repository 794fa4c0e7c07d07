"""Routing replay through the HTTP server and the fleet (``answers.encode_routes`` / ``decoded_routes``, the HF server's
``return_routed_experts``, ``Fleet`` asking for an MoE policy's routes): a rollout sampled by an HF server of a tiny
MoE policy carries the server's routes, equal to the in-process decoder's for the same seed; a push that lands
mid-generation re-records the routes of the rows it recomputes; a GRPO step through the server replays them; an
answer whose routes have the wrong shape or values is one ``BadAnswer`` line naming the server."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from architectures import build_sharpened, model_config
from http_fixtures import http_hf_server
from test_hf_server import decoder_hold, fleet_of_one, prompts

from aitraining_pl.generation.backend import SampleRequest
from aitraining_pl.generation.servers.answers import BadAnswer, decoded_routes, encode_routes
from aitraining_pl.models.rollout_scoring import response_logps
from aitraining_pl.models.routing_replay import RouteShape, flat_routes, recording, route_shape
from aitraining_pl.rollout import GenerationConfig, HFBackend, StopRule

SAMPLING = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=1.0)
SAMPLES = 3


def served_and_own(name: str, generation: GenerationConfig = SAMPLING):
    """The fleet's sample of ``prompts()`` (3 samples each, seed 11) from an HF server holding a sharpened tiny
    ``name`` policy, and each prompt's own sample by ``HFBackend`` at its seed (vLLM's rule: ``11 + 3 i``)."""
    policy = build_sharpened(name, seed=3).eval()
    ids, mask = prompts()
    with http_hf_server(model_config(name)) as port:
        fleet = fleet_of_one(port)
        try:
            fleet.sync(policy, 1)
            served = fleet.sample(SampleRequest(ids, mask, generation, [2], StopRule(), 0, SAMPLES, seed=11))
        finally:
            fleet.close()
    own = []
    for i in range(ids.shape[0]):
        alone = ids[i : i + 1, mask[i].bool()]
        request = SampleRequest(alone, torch.ones_like(alone), generation, [2], StopRule(), 0, SAMPLES, seed=11 + 3 * i)
        own.append(HFBackend(policy).sample(request))
    return policy, ids, mask, served, own


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_a_servers_routes_are_the_in_process_decoders(name):
    """Through the fleet (``Fleet.sample`` with ``routing_replay``) each row's routes (N, P + R, layers, k) equal
    those the in-process decoder records for the same prompt, seed and tokens: the prompt's real tokens and every
    fed-back response token, -1 on the left padding and from the response's last token on."""
    policy, ids, mask, served, own = served_and_own(name)
    layers, k = len(route_shape(policy).layers), route_shape(policy).top_k
    assert served.routes is not None and served.routes.dtype == torch.int16
    assert served.routes.shape == (6, ids.shape[1] + served.response_ids.shape[1], layers, k)
    lengths = (served.token_versions >= 0).sum(1)
    rows = mask.repeat_interleave(SAMPLES, 0)
    assert (served.routes[:, : ids.shape[1]][rows == 0] == -1).all()
    flat = flat_routes(served.routes, rows, lengths)
    for i, sampled in enumerate(own):
        mine = slice(SAMPLES * i, SAMPLES * i + SAMPLES)
        width = sampled.response_ids.shape[1]
        assert torch.equal(served.response_ids[mine, :width], sampled.response_ids)
        alone = flat_routes(sampled.routes, torch.ones(SAMPLES, int(mask[i].sum())), lengths[mine])
        for row, (there, here) in enumerate(zip(flat[mine], alone)):
            assert torch.equal(there, here), (i, row)
            after = served.routes[SAMPLES * i + row, ids.shape[1] + int(lengths[mine][row]) - 1 :]
            assert (after == -1).all()  # the last token (never fed back) and the padding


def test_without_routing_replay_no_routes_are_asked_for():
    """``generation.routing_replay: false``: the fleet asks for none and the sample carries none."""
    *_, served, own = served_and_own("qwen3_moe", dataclasses.replace(SAMPLING, routing_replay=False))
    assert served.routes is None and all(o.routes is None for o in own)


def test_a_push_in_flight_re_records_the_routes_of_the_recomputed_rows():
    """A push that lands after 4 decode steps (``in_flight``) recomputes the KV cache of the rows still decoding
    under the new weights; their recorded routes are then the new weights' for every token (the trainer's forward
    of the new weights over the whole row gives them), while the rows' tokens were drawn by both."""
    name = "qwen3_moe"
    old, new = build_sharpened(name, seed=0).eval(), build_sharpened(name, seed=1).eval()
    paused, resume = threading.Event(), threading.Event()
    hold = decoder_hold(4, paused, resume)

    ids, mask = prompts()
    generation = dataclasses.replace(SAMPLING, max_new_tokens=12)
    answer = {}
    with http_hf_server(model_config(name), on_engine=hold) as port:
        fleet = fleet_of_one(port)
        try:
            fleet.sync(old, 1)
            request = SampleRequest(ids, mask, generation, [], StopRule(), 0, 2, seed=5)
            thread = threading.Thread(target=lambda: answer.update(out=fleet.sample(request)))
            thread.start()
            assert paused.wait(60)
            fleet.push(list(new.state_dict().items()), 2, in_flight=True)
            resume.set()
            thread.join(60)
        finally:
            fleet.close()
    out = answer["out"]
    assert set(out.token_versions[:, 0].tolist()) == {1} and set(out.token_versions[:, -1].tolist()) == {2}
    full = torch.cat([ids.repeat_interleave(2, 0), out.response_ids], 1)
    attention = torch.cat([mask.repeat_interleave(2, 0), (out.token_versions >= 0).long()], 1)
    with torch.no_grad(), recording(new) as recorder:
        response_logps(new, full, attention, ids.shape[1], 1.0, padding_free=False)
    routes = recorder.take_calls()[-1].reshape(*full.shape, *out.routes.shape[2:])  # (after the path probes)
    have = out.routes[..., 0] >= 0
    assert int(have[:, ids.shape[1] :].sum()) > 0
    assert torch.equal(out.routes[have].sort(-1).values, routes[have].sort(-1).values.to(torch.int16))


@pytest.mark.slow
def test_grpo_through_an_hf_server_replays_the_servers_routes(tmp_path):
    """One GRPO step of a tiny Qwen3-MoE whose rollouts an HF server samples (``generation.server: connect``): the
    policy pass gets the rollout's routes (not None) and they are the experts the pushed (initial) weights route the
    rollout's tokens to in the trainer's own forward (the server's routes, carried over HTTP, in the trainer's
    layout); ``routing/flip_rate`` is logged, 0."""
    from async_fixtures import served
    from conftest import quiet_trainer

    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.modules.critic_free import GRPOModule

    config = {**model_config("qwen3_moe"), "vocab_size": 384, "eos_token_id": 1, "pad_token_id": 0}
    with http_hf_server(config) as port:
        module = GRPOModule(reward="aitraining_pl.rewards:char_length_reward", model_config=config,
                            tokenizer_name="byte", learning_rate=1e-3, num_generations=2, mini_batch_size=4,
                            generation=GenerationConfig(max_new_tokens=6, temperature=1.0, top_p=1.0,
                                                        **served(port)))  # fmt: skip
        initial = copy.deepcopy(module.policy).eval()
        seen = []
        scores = module.policy_scores
        module.policy_scores = lambda ids, attention, P, *a, **kw: (
            seen.append((ids, attention, P, kw.get("routes"))) or scores(ids, attention, P, *a, **kw)
        )  # noqa: E501
        data = PromptDataModule(prompts=["ab", "cd"], tokenizer=module.tokenizer, batch_size=2)
        quiet_trainer(tmp_path, max_steps=1).fit(module, data)
    ids, attention, P, routes = seen[0]
    assert routes is not None and routes.shape[:2] == ids.shape
    with torch.no_grad(), recording(initial) as recorder:
        response_logps(initial, ids, attention, P, 1.0, padding_free=False)
    own = recorder.take_calls()[-1].reshape(*ids.shape, *routes.shape[2:])  # (after the path probes)
    have = routes[..., 0] >= 0
    assert int(have[:, P:].sum()) > 0 and not have[attention == 0].any()
    assert torch.equal(routes[have].sort(-1).values.long(), own[have].sort(-1).values.long())
    assert module.update_history[-1]["routing/flip_rate"] == 0


def test_routes_of_the_wrong_shape_or_values_are_refused_naming_the_server():
    """``decoded_routes``: the right shape comes back as int16; a wrong token count, layer count, an expert outside
    the policy's, a negative one, text that is no base64 ``.npy`` and text longer than the shape needs are each one
    ``BadAnswer`` naming the server and the choice; an array of every decoder layer (vLLM's, dense layers
    included) keeps the routers' layers."""
    where, shape = "http://127.0.0.1:1: choice 0 of its answer", RouteShape((0, 1), 2, 4)
    routes = torch.randint(0, 4, (5, 2, 2))
    assert torch.equal(decoded_routes(encode_routes(routes), 5, shape, where), routes.to(torch.int16))
    deep = RouteShape((1, 3), 2, 4)  # dense layers 0 and 2: an array of every layer (vLLM's) keeps layers 1 and 3
    every = torch.randint(0, 4, (5, 4, 2))
    assert torch.equal(decoded_routes(encode_routes(every), 5, deep, where), every[:, [1, 3]].to(torch.int16))
    import base64
    import io

    import numpy as np

    def npy(array) -> str:
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode()

    cases = {
        "shape": (encode_routes(routes), 6),
        "shape ": (encode_routes(routes[:, :1]), 5),
        "outside the 4 experts": (encode_routes(routes + 4), 5),
        "outside the 4": (npy(routes.numpy().astype(np.int16) - 5), 5),
        "not a base64": ("bm90IGFuIG5weQ==", 5),
        "characters": ("A" * 100_000, 5),
        "float": (npy(routes.numpy().astype(np.float32)), 5),
    }
    for why, (text, tokens) in cases.items():
        with pytest.raises(BadAnswer, match=r"^http://127\.0\.0\.1:1: choice 0") as err:
            decoded_routes(text, tokens, shape, where)
        assert why.strip() in str(err.value) and "\n" not in str(err.value), (why, str(err.value))
