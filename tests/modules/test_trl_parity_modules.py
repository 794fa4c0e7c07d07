"""TRL 1.16 parity options of the modules (issue 34, part 7): ORPO's ``disable_prompt_loss`` and the online modules'
``policy_loss.use_bias_correction_kl``, checked against TRL's formulas written here from its documented semantics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_LLAMA

from aitraining_pl.cli import main
from aitraining_pl.errors import ConfigError, HyperparameterError
from aitraining_pl.losses import clipped_policy_loss
from aitraining_pl.modules.critic_free import GRPOModule, PolicyExperience, RLOOModule
from aitraining_pl.modules.orpo import ORPOModule

# ---------------------------------------------------------------- ORPO: disable_prompt_loss

PROMPTS = [[5, 6, 7], [8, 9]]
CHOSEN = [[20, 21, 22, 1], [23, 24, 1]]
REJECTED = [[30, 1], [31, 32, 33, 34, 1]]


def _pairs() -> dict[str, torch.Tensor]:
    """Two pairs, right padded (chosen rows first): prompts of 3 and 2 tokens, completions of 2 to 5."""
    rows = [p + c for p, c in zip(PROMPTS + PROMPTS, CHOSEN + REJECTED)]
    width = max(map(len, rows))
    ids, real, completion = (torch.zeros(len(rows), width, dtype=torch.long) for _ in range(3))
    for i, (prompt, row) in enumerate(zip(PROMPTS + PROMPTS, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        real[i, : len(row)] = 1
        completion[i, len(prompt) : len(row)] = 1
    return {"input_ids": ids, "attention_mask": real, "completion_mask": completion, "index": torch.arange(2)}


def _orpo_metrics(monkeypatch, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor], ORPOModule]:
    module = ORPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", beta=0.5, **kwargs)
    logged = {}
    monkeypatch.setattr(module, "log_metrics", lambda stage, values, **k: logged.update(values))
    return module.shared_step(_pairs(), "train"), logged, module


def _token_logps(module: ORPOModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(2B, L - 1) log p(token t + 1) from the model's own forward (full logits)."""
    logits = module.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


def test_orpo_default_nll_is_over_the_chosen_completions(monkeypatch):
    """Default (``disable_prompt_loss: true``): NLL = -(sum of the chosen completion tokens' log-probs) / (4 + 3)."""
    loss, logged, module = _orpo_metrics(monkeypatch)
    batch = _pairs()
    token = _token_logps(module, batch).detach()
    completion = batch["completion_mask"][:, 1:].float()
    want = -(token[:2] * completion[:2]).sum() / completion[:2].sum()
    assert completion[:2].sum().item() == 7
    assert logged["nll_loss"].item() == pytest.approx(want.item(), abs=1e-5)
    assert module.hparams.disable_prompt_loss is True


@pytest.mark.parametrize("packing", [dict(padding_free=False, share_prompt=False), dict()])
def test_orpo_prompt_loss_matches_trl_cross_entropy(monkeypatch, packing):
    """``disable_prompt_loss: false`` is TRL 1.16's ORPO NLL: ``CrossEntropyLoss`` of the chosen rows' shifted
    logits against their tokens, padding ignored (prompt and completion: 2 + 4 and 1 + 3 = 10 tokens). By hand:
    the token-weighted mean of the prompt part's and the completion part's NLL. The odds ratio is unchanged."""
    loss, logged, module = _orpo_metrics(monkeypatch, disable_prompt_loss=False, **packing)
    _, default, _ = _orpo_metrics(monkeypatch, **packing)
    batch = _pairs()
    logits = module.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.detach()
    labels = torch.where(batch["attention_mask"] == 1, batch["input_ids"], -100)
    trl = F.cross_entropy(logits[:2, :-1].reshape(-1, logits.shape[-1]), labels[:2, 1:].reshape(-1))
    assert logged["nll_loss"].item() == pytest.approx(trl.item(), abs=1e-5)
    token = _token_logps(module, batch).detach()[:2]
    real, completion = batch["attention_mask"][:2, 1:].float(), batch["completion_mask"][:2, 1:].float()
    prompt = real - completion
    assert (prompt.sum().item(), completion.sum().item()) == (3, 7)
    by_hand = -((token * prompt).sum() + (token * completion).sum()) / (prompt.sum() + completion.sum())
    assert logged["nll_loss"].item() == pytest.approx(by_hand.item(), abs=1e-5)
    assert not math.isclose(logged["nll_loss"].item(), default["nll_loss"].item(), abs_tol=1e-4)
    torch.testing.assert_close(logged["log_odds_ratio"], default["log_odds_ratio"])
    torch.testing.assert_close(logged["logps/chosen"], default["logps/chosen"])
    expected = logged["nll_loss"] - default["nll_loss"] + default["loss"]  # only the NLL term moved
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in module.policy.parameters() if p.requires_grad)


def test_orpo_disable_prompt_loss_is_documented_in_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--model.help", "ORPOModule"])
    out = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0 and "--model.disable_prompt_loss" in out and "TRL 1.16" in out


# ---------------------------------------------------------------- use_bias_correction_kl in the online modules

EOS = 1  # the byte tokenizer's end token
MAKE = dict(model_config=TINY_LLAMA, tokenizer_name="byte", reward=lambda p, r, m: [0.0] * len(p))


def test_bias_correction_kl_is_stored_and_refused_where_no_kl_is_in_the_loss():
    module = GRPOModule(**MAKE, policy_loss={"use_bias_correction_kl": True})
    assert module.hparams.policy_loss["use_bias_correction_kl"] is True
    assert GRPOModule(**MAKE).policy_loss.use_bias_correction_kl is False  # our default: GRPO's plain k3
    why = "use_bias_correction_kl.*needs kl_coef > 0 and kl_in_reward: false"
    with pytest.raises(ConfigError, match=why):
        GRPOModule(**MAKE, kl_coef=0.0, policy_loss={"use_bias_correction_kl": True})
    with pytest.raises(ConfigError, match=why):
        RLOOModule(**MAKE, policy_loss={"use_bias_correction_kl": True})  # RLOO's KL is k1 in the reward
    from aitraining_pl.modules.ppo import PPOModule

    with pytest.raises(ConfigError, match="PPOModule.policy_loss.use_bias_correction_kl.*reward"):
        PPOModule(**MAKE, policy_loss={"use_bias_correction_kl": True})


def test_grpo_minibatch_loss_weights_the_kl_term_by_the_ratio():
    """The module's loss is ``clipped_policy_loss`` with the correction, off-policy (old and reference log-probs
    moved away from the policy's, so the ratio and k3 are not trivial)."""
    ids = torch.tensor([[10, 11, 40, 41, EOS], [10, 11, 42, EOS, 0], [12, 13, 43, 44, 45], [12, 13, 46, EOS, 0]])
    attention = (ids != 0).long()
    mask = attention[:, 2:].float()
    losses = {}
    for corrected in (False, True):
        module = GRPOModule(**MAKE, kl_coef=0.1, num_iterations=2, policy_loss={"use_bias_correction_kl": corrected})
        with torch.no_grad():
            current = module.response_scores(module.policy, ids, attention, 2).logprobs
        advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand_as(mask)
        old, ref = current - 0.3 * mask, current - 0.5 * mask
        experience = PolicyExperience(ids, attention, 2, mask, advantages, old, ref, mask)
        losses[corrected], _ = module.minibatch_loss(experience, torch.arange(4))
    out = module.response_scores(module.policy, ids, attention, 2)
    expected, _ = clipped_policy_loss(
        out.logprobs, old, advantages, mask, 0.2, None, "sequence", module.generation.max_new_tokens,
        ref_logprobs=ref, kl_coef=0.1, use_bias_correction_kl=True,
    )  # fmt: skip
    assert losses[True].item() == pytest.approx(expected.item(), abs=1e-6)
    assert not math.isclose(losses[True].item(), losses[False].item(), abs_tol=1e-4)


@pytest.mark.parametrize("name, aggregation", [("dapo", "token"), ("dr_grpo", "constant"), ("grpo", "sequence")])
def test_trl_grpo_loss_type_names_point_to_loss_aggregation(name, aggregation):
    """TRL's GRPO ``loss_type`` holds the aggregation; ours is the surrogate: TRL's names are refused with the
    ``loss_aggregation`` to use (one registry per concept, each under TRL's name for that trainer)."""
    with pytest.raises(HyperparameterError, match=f"loss_aggregation: {aggregation} here"):
        GRPOModule(**MAKE, policy_loss={"loss_type": name})
