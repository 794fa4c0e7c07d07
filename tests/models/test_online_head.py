"""Online RL scoring through the fused LM head: equal to the unfused path (values and gradients), packing only
where it pays, and one GRPO update / one PPO minibatch that save no (tokens x vocabulary) tensor for backward."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_LLAMA, saved_for_backward

import aitraining_pl.models.rollout_scoring as rollout_scoring
from aitraining_pl.models import PPOModel, build_causal_lm
from aitraining_pl.models.packing import pack_rows
from aitraining_pl.models.rollout_scoring import packed_tokens, response_logps, will_pack
from aitraining_pl.models.scoring import PACKING_THRESHOLD, packing_pays
from aitraining_pl.modules.critic_free import GRPOModule
from aitraining_pl.modules.online import RolloutBatch
from aitraining_pl.modules.ppo import PPOModule

P = 4  # prompt length of the rollout rows below
#: left-padded prompts, responses that end early, at once or never: 23 real tokens of 40 (packs)
SPARSE = torch.tensor(
    [
        [0, 0, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 1, 1, 1, 1, 0, 0],
    ]
)
#: every response ran to the end, one prompt token of padding: 38 real tokens of 40 (runs padded)
DENSE = torch.ones(4, 10, dtype=torch.long)
DENSE[0, 0] = DENSE[3, 0] = 0
#: rows 0, 1 answer one prompt and rows 2, 3 another (``_ids`` copies the prompts): packed with each prompt once
SHARED = torch.tensor(
    [
        [0, 1, 1, 1, 1, 1, 0, 0, 0, 0],
        [0, 1, 1, 1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    ]
)
LAYOUTS = {"packed": SPARSE, "padded": DENSE, "shared": SHARED}
TEMPERATURE = 0.7


def _ids(vocab: int = 384) -> torch.Tensor:
    """Random tokens; rows 1 and 3 repeat the prompts of rows 0 and 2 (shared where the masks agree too)."""
    ids = torch.randint(2, vocab, (4, 10), generator=torch.Generator().manual_seed(0))
    ids[1, :P], ids[3, :P] = ids[0, :P], ids[2, :P]
    return ids


def test_rows_with_one_prompt_hold_it_once():
    """``SHARED``: 25 real tokens, of which the repeated prompts' 3 + 4 are held once; every response token is
    predicted from the same token as in its own row."""
    scored = SHARED.clone()
    scored[:, :P] = 0
    packed = pack_rows({"input_ids": _ids(), "attention_mask": SHARED, "completion_mask": scored}, shared_prefix=P)
    assert packed.input_ids.shape[1] == 25 - 3 - 4
    assert [ranges for ranges, _ in packed.plan.blocks] == [
        ((0, 5),),
        ((0, 3), (5, 10)),
        ((10, 15),),
        ((10, 14), (15, 18)),
    ]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 4, 5, 6]
    assert packed.sources.tolist() == [2, 3, 2, 5, 6, 7, 8, 13, 13, 15, 16]
    with pytest.raises(ValueError, match="shared"):  # the second row's prompt is not held
        pack_rows({"input_ids": _ids(), "attention_mask": SHARED, "completion_mask": SHARED}, shared_prefix=P)


def _unfused(model, ids, attention):
    """Log-probs and entropies (N, R) from the model's own forward: full (N, R, V) logits, log-softmax."""
    positions = (attention.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions, output_hidden_states=True)
    logp = torch.log_softmax(out.logits[:, P - 1 : -1].float() / TEMPERATURE, -1)
    mask = attention[:, P:].bool()
    token = logp.gather(-1, ids[:, P:, None]).squeeze(-1) * mask
    return token, -(logp.exp() * logp).sum(-1) * mask, out.hidden_states[-1][:, P - 1 : -1]


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _assert_grads_close(got, want):
    """Gradients summed in another order (packed rows, a prompt held once for its group) differ in fp32 by a
    few ulps of each tensor's largest entry (the embedding's reaches ~100 here), not of each element."""
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 + 1e-6 * b.abs().max().item())


def test_packing_only_where_padding_pays(monkeypatch):
    assert PACKING_THRESHOLD == 0.75
    assert packing_pays(SPARSE) and not packing_pays(DENSE)
    assert packing_pays(torch.tensor([[1, 1, 0, 0]])) and not packing_pays(torch.tensor([[1, 1, 1, 0]]))  # 3 = 0.75 * 4
    model = build_causal_lm(TINY_LLAMA, seed=0)
    assert will_pack(model, SPARSE, P) and not will_pack(model, SPARSE, P, padding_free=False)
    assert not will_pack(model, DENSE, P)
    empty_prompt = SPARSE.clone()
    empty_prompt[2, :P] = 0
    assert not will_pack(model, empty_prompt, P)  # its first response token has nothing to be predicted from
    calls = []
    monkeypatch.setattr(rollout_scoring, "pack_rows", lambda *a, **k: calls.append(1) or pack_rows(*a, **k))
    for attention, packs in ((SPARSE, True), (DENSE, False)):
        calls.clear()
        chosen = response_logps(model, _ids(), attention, P, TEMPERATURE, padding_free=True, with_entropy=True)
        assert bool(calls) == packs
        padded = response_logps(model, _ids(), attention, P, TEMPERATURE, padding_free=False, with_entropy=True)
        torch.testing.assert_close(chosen.logprobs, padded.logprobs, rtol=0, atol=1e-5)
        torch.testing.assert_close(chosen.entropy, padded.entropy, rtol=0, atol=1e-5)


def test_a_group_without_padding_packs_its_prompt_once(monkeypatch):
    """No padding at all, but the four rows answer one prompt (a GRPO group of short responses to a long chat
    prompt): packed, the prompt counted once (4 + 4 x 6 = 28 tokens of 40; two prompts would be 32 of 40, which runs
    padded), and equal to the padded rows in log-probs, entropies and gradients."""
    full = torch.ones(4, 10, dtype=torch.long)
    group = _ids()
    group[:, :P] = group[0, :P]
    assert packed_tokens(group, full, P) == 28 and packed_tokens(_ids(), full, P) == 32
    model = build_causal_lm(TINY_LLAMA, seed=0)
    assert will_pack(model, full, P, input_ids=group) and not will_pack(model, full, P, input_ids=_ids())
    assert not will_pack(model, full, P)  # without the ids: every token counted, no padding to drop
    calls = []
    monkeypatch.setattr(rollout_scoring, "pack_rows", lambda *a, **k: calls.append(1) or pack_rows(*a, **k))
    weights = torch.linspace(-1, 1, 4 * (10 - P)).view(4, -1)
    scores = {}
    for padding_free in (True, False):
        out = response_logps(model, group, full, P, TEMPERATURE, padding_free=padding_free, with_entropy=True)
        grads = _grads(model, (out.logprobs * weights).sum() + out.entropy.sum())
        scores[padding_free] = (out.logprobs.detach(), out.entropy.detach(), grads)
    assert calls == [1]
    torch.testing.assert_close(scores[True][0], scores[False][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(scores[True][1], scores[False][1], rtol=0, atol=1e-5)
    _assert_grads_close(scores[True][2], scores[False][2])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "arch", [{}, {"tie_word_embeddings": True}, {"model_type": "gemma2", "head_dim": 8, "final_logit_softcapping": 0.5}]
)
def test_response_scores_equal_the_unfused_path(layout, arch):
    """Fused head (packed or padded rows) against full logits + log-softmax: log-probs, entropies, gradients."""
    model = build_causal_lm({**TINY_LLAMA, **arch}, seed=0)
    attention, ids = LAYOUTS[layout], _ids()
    out = response_logps(model, ids, attention, P, TEMPERATURE, with_entropy=True)
    token, entropy, _ = _unfused(model, ids, attention)
    torch.testing.assert_close(out.logprobs, token, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy, entropy, rtol=0, atol=1e-5)
    weights = torch.linspace(-1, 1, token.numel()).view_as(token)  # a loss that weighs every token differently
    got = _grads(model, (out.logprobs * weights).sum() + out.entropy.sum())
    token, entropy, _ = _unfused(model, ids, attention)
    want = _grads(model, (token * weights).sum() + entropy.sum())
    assert len(got) == len(want) > 5
    _assert_grads_close(got, want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("critic", [False, True])
def test_ppo_model_score_equals_its_full_forward(layout, critic):
    """``PPOModel.score`` (one decoder pass, fused head, value head on the same hidden states) against
    ``PPOModel.forward`` (full logits and values): log-probs, entropies, values and all gradients."""
    critic_model = build_causal_lm(TINY_LLAMA, seed=1) if critic else None
    model = PPOModel(build_causal_lm(TINY_LLAMA, seed=0), critic=critic_model)
    torch.nn.init.normal_(model.value_head.net[-1].weight, std=0.5)  # non-zero values
    attention, ids = LAYOUTS[layout], _ids()
    mask = attention[:, P:].bool()
    out = model.score(ids, attention, P, TEMPERATURE, with_entropy=True)

    def full():
        full_out = model(ids, attention, (attention.cumsum(-1) - 1).clamp_min(0))
        logp = torch.log_softmax(full_out.logits[:, P - 1 : -1] / TEMPERATURE, -1)
        token = logp.gather(-1, ids[:, P:, None]).squeeze(-1) * mask
        return token, -(logp.exp() * logp).sum(-1) * mask, full_out.values[:, P - 1 : -1] * mask

    for got, want in zip(out, full()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert out.values.abs().sum() > 0

    def loss(lp, ent, v):
        return (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum() + ent.sum() + (v**2).sum()

    got = _grads(model, loss(*model.score(ids, attention, P, TEMPERATURE, with_entropy=True)))
    want = _grads(model, loss(*full()))
    assert len(got) == len(want) and any(g.abs().sum() > 0 for g in got[-4:])  # the value head trains
    _assert_grads_close(got, want)


TOY_REWARD = "aitraining_pl.rewards:char_fraction_reward"  # PPO/GRPO/RLOO need a reward source
VOCAB = 32000


def _saved_shapes(module, step):
    """Non-parameter tensors that ``step()`` saves for backward (``conftest.saved_for_backward``)."""
    saved = saved_for_backward(module, step)
    assert module.policy.get_output_embeddings().weight.grad.abs().sum() > 0
    return saved


def _rollout(attention: torch.Tensor) -> RolloutBatch:
    ids = _ids(VOCAB)
    mask = attention[:, P:]
    return RolloutBatch(
        ids,
        attention,
        P,
        mask,
        mask[:, -1] == 0,
        torch.tensor([0, 0, 1, 1]),
        [""] * 4,
        torch.tensor([1.0, 0.0, 0.5, 2.0]),
        {},
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_update_saves_no_vocabulary_sized_tensor(layout):
    """Structural memory test (times nothing): one GRPO update step (k3 KL in the loss, so the reference pass
    runs too) at a 32,000-token vocabulary saves no vocabulary-sized tensor for backward but parameters."""
    module = GRPOModule(
        model_config={**TINY_LLAMA, "vocab_size": VOCAB},
        tokenizer_name="byte",
        reward=TOY_REWARD,
        num_generations=2,
        mini_batch_size=4,
        num_iterations=2,
    )
    rollout = _rollout(LAYOUTS[layout])
    assert will_pack(module.policy, rollout.attention_mask, P) == (layout != "padded")
    with torch.no_grad():
        experience, _ = module.make_experience(rollout)
    assert experience.old_logprobs is not None and experience.ref_logprobs is not None
    offenders = _saved_shapes(module, lambda: module.minibatch_loss(experience, torch.arange(4))[0])
    assert [shape for shape in offenders if VOCAB in shape] == []


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ppo_minibatch_saves_no_vocabulary_sized_tensor(layout):
    """The same for one PPO minibatch (policy, entropy bonus and value head from one decoder pass)."""
    module = PPOModule(
        model_config={**TINY_LLAMA, "vocab_size": VOCAB}, tokenizer_name="byte", reward=TOY_REWARD, mini_batch_size=4
    )
    rollout = _rollout(LAYOUTS[layout])
    with torch.no_grad():
        experience, _ = module.make_experience(rollout)
    offenders = _saved_shapes(module, lambda: module.minibatch_loss(experience, torch.arange(4))[0])
    assert [shape for shape in offenders if VOCAB in shape] == []
