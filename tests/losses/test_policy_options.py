"""The online policy-loss options (GSPO, CISPO, delta, high-entropy tokens, truncated rows, scale_rewards) against
hand-derived values on small tensors."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from aitraining_pl.losses import LOSS_AGGREGATIONS, clipped_policy_loss, compute_advantages
from aitraining_pl.losses.advantages import SCALE_REWARDS, ScaleRewards
from aitraining_pl.losses.policy_options import (
    IMPORTANCE_SAMPLING_LEVELS,
    POLICY_LOSSES,
    ImportanceSamplingLevel,
    PolicyLossType,
    completed_rows,
    high_entropy_mask,
    sequence_log_ratio_mean,
)


def test_literal_types_match_the_registries():
    assert typing.get_args(PolicyLossType) == tuple(POLICY_LOSSES)
    assert typing.get_args(ImportanceSamplingLevel) == tuple(IMPORTANCE_SAMPLING_LEVELS)
    assert typing.get_args(ScaleRewards) == SCALE_REWARDS


# ---------------------------------------------------------------- GSPO (sequence-level ratio)


@pytest.mark.parametrize("aggregation", sorted(LOSS_AGGREGATIONS))
def test_gspo_on_one_token_sequences_equals_the_token_level_loss(aggregation):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 1, generator=g) * 2
    adv = torch.randn(6, 1, generator=g)
    mask = torch.ones(6, 1)
    results = {}
    for level in ("token", "sequence"):
        logp = (old + 0.5 * torch.randn(6, 1, generator=torch.Generator().manual_seed(1))).requires_grad_()
        loss, stats = clipped_policy_loss(logp, old, adv, mask, 0.2, 0.28, aggregation, importance_sampling_level=level)
        loss.backward()
        results[level] = (loss.detach(), logp.grad, stats["clipfrac"])
    for a, b in zip(results["token"], results["sequence"]):
        torch.testing.assert_close(a, b)
    assert results["token"][2] > 0  # some ratios are clipped: the comparison covers the clip


def test_gspo_ratio_is_invariant_to_response_length():
    c = 0.1  # the same per-token log-ratio on every token
    old = -torch.rand(3, 5)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    log_s = sequence_log_ratio_mean(old + c, old, mask)
    torch.testing.assert_close(log_s * mask, c * mask.float())
    # the loss of each row is then -A * exp(c) (inside the clip range), whatever its length
    adv = torch.tensor([[1.0] * 5, [1.0] * 5, [1.0] * 5])
    loss, _ = clipped_policy_loss(
        old + c, old, adv, mask, 0.2, aggregation="sequence", importance_sampling_level="sequence"
    )
    assert loss.item() == pytest.approx(-math.exp(c), abs=1e-6)


def test_gspo_clips_per_sequence_hand_values():
    # row 0: log-ratios 0.4 and 0.0 -> s = exp(0.2) = 1.2214 > 1.2: clipped for A > 0 (no gradient)
    # row 1: the same ratios, A < 0: max(-A s, -A clip(s)) = -A s, gradient -A s / 2 on each token
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.4, 0.0], [0.4, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, stats = clipped_policy_loss(
        logp, old, adv, torch.ones(2, 2), 0.2, aggregation="sequence", importance_sampling_level="sequence"
    )
    s = math.exp(0.2)
    assert loss.item() == pytest.approx((-1.2 + s) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [s / 4, s / 4]]))
    assert stats["clipfrac/high"].item() == pytest.approx(0.5)  # both tokens of row 0


# ---------------------------------------------------------------- delta (two-sided clip)


def test_delta_bounds_the_ratio_for_negative_advantages_only_where_it_binds():
    logp = torch.tensor([[math.log(3.0), math.log(3.0), math.log(1.5)]], requires_grad=True)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    plain, _ = clipped_policy_loss(logp, old, adv, mask, 0.2, aggregation="token")
    bounded, _ = clipped_policy_loss(logp, old, adv, mask, 0.2, aggregation="token", delta=2.0)
    # per token without delta: max(3, 1.2) = 3; max(-3, -1.2) = -1.2; max(1.5, 1.2) = 1.5
    assert plain.item() == pytest.approx((3.0 - 1.2 + 1.5) / 3, abs=1e-6)
    # with delta = 2: max(2, 1.2) = 2 (bounded, no gradient); -1.2 unchanged; 1.5 < delta unchanged
    assert bounded.item() == pytest.approx((2.0 - 1.2 + 1.5) / 3, abs=1e-6)
    bounded.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 1.5 / 3]]))


# ---------------------------------------------------------------- CISPO


def test_cispo_is_reinforce_weighted_by_the_clipped_detached_ratio():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logp.detach() - torch.tensor([[0.5, -0.7, 0.0]])  # ratios e^0.5 = 1.65 (clipped to 1.28), e^-0.7, 1
    adv = torch.tensor([[2.0, 1.0, -1.0]])
    loss, stats = clipped_policy_loss(logp, old, adv, torch.ones(1, 3), 0.2, 0.28, "token", loss_type="cispo")
    w = [1.28, math.exp(-0.7), 1.0]  # no lower bound on the weight
    expected = -(w[0] * 2.0 * -1.0 + w[1] * 1.0 * -2.0 + w[2] * -1.0 * -0.5) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()  # the weight is detached: d/dlogp = -w A / 3, on every token (none dropped)
    torch.testing.assert_close(logp.grad, torch.tensor([[-w[0] * 2.0 / 3, -w[1] / 3, w[2] / 3]]))
    assert stats["clipfrac/high"].item() == pytest.approx(1 / 3)


def test_unknown_policy_loss_options_are_refused():
    args = (torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="loss_type 'ppo'"):
        clipped_policy_loss(*args, loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level 'row'"):
        clipped_policy_loss(*args, importance_sampling_level="row")


# ---------------------------------------------------------------- high-entropy tokens, truncated rows


def test_high_entropy_mask_hand_values():
    entropy = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # the masked entropies sorted: 0.1 0.3 0.5 0.7 0.9; the 0.6 quantile is 0.5 + 0.4 * 0.2 = 0.58
    kept = high_entropy_mask(entropy, mask, 0.4)
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    torch.testing.assert_close(high_entropy_mask(entropy, mask, 1.0), mask.float())


def test_token_weights_drop_the_policy_term_but_keep_the_kl_and_the_normaliser():
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = logp - 0.5
    adv = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    weights = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    loss, _ = clipped_policy_loss(logp, logp, adv, torch.ones(2, 2), aggregation="token", ref_logprobs=ref,
                                  kl_coef=0.1, token_weights=weights)  # fmt: skip
    k3 = math.exp(-0.5) - (-0.5) - 1  # k3 of ref - logp = -0.5
    assert loss.item() == pytest.approx((-1.0 + 4 * 0.1 * k3) / 4, abs=1e-6)


def test_completed_rows_drops_truncated_responses():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    kept = completed_rows(mask, torch.tensor([True, False, True]))
    torch.testing.assert_close(kept, torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]]))


# ---------------------------------------------------------------- scale_rewards


def test_scale_rewards_hand_values():
    scores = torch.tensor([1.0, 0.0, 3.0, 1.0])
    group = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]])
    rewards = torch.zeros(4, 2)
    rewards[torch.arange(4), mask.sum(1) - 1] = scores
    centred = torch.tensor([0.5, -0.5, 1.0, -1.0])
    batch_std = math.sqrt((0.25**2 + 1.25**2 + 1.75**2 + 0.25**2) / 3)
    group_std = torch.tensor([math.sqrt(0.5)] * 2 + [math.sqrt(2.0)] * 2)
    expected = {
        "group": centred / (group_std + 1e-4),
        "batch": centred / (batch_std + 1e-4),
        "none": centred,
    }
    for scale, values in expected.items():
        got = compute_advantages("grpo", rewards, mask, group, scale_rewards=scale)
        torch.testing.assert_close(got, values.unsqueeze(1) * mask)
    torch.testing.assert_close(
        compute_advantages("grpo", rewards, mask, group, scale_rewards="none"),
        compute_advantages("dr_grpo", rewards, mask, group),
    )
    with pytest.raises(ValueError, match="scale_rewards 'rows'"):
        compute_advantages("grpo", rewards, mask, group, scale_rewards="rows")
