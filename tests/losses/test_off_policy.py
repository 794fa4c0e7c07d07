"""Off-policy corrections (``losses.off_policy``): the four importance-sampling modes of TRL 1.16 on hand-derived
values with both bounds, against a loop written from TRL's formula, weights of 1 when there is no gap, the mismatch
statistics, and AReaL's decoupled objective's gradient by hand."""

from __future__ import annotations

import math
import random

import pytest
import torch

from aitraining_pl.losses import IMPORTANCE_SAMPLING_MODES, decoupled_policy_loss, off_policy_weights
from aitraining_pl.losses.policy_options import ImportanceSamplingMode, PolicyLossConfig

LOG = math.log
# token ratios pi_old / pi_b: row 0: 2, 0.5, 4 (sequence ratio 4); row 1: 1.5 then two padding positions
TRAINER = torch.tensor([[LOG(0.5), LOG(0.2), LOG(0.8)], [LOG(0.3), 0.0, 0.0]])
SAMPLER = torch.tensor([[LOG(0.25), LOG(0.4), LOG(0.2)], [LOG(0.2), -5.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, clip_min, clip_max, weights, hit_tokens, hit_rows",
    [
        ("token_truncate", 0.8, 3.0, [[2, 0.8, 3], [1.5, 1, 1]], 2 / 4, 1 / 2),
        ("token_truncate", None, 3.0, [[2, 0.5, 3], [1.5, 1, 1]], 1 / 4, 1 / 2),
        ("token_truncate", 1.0, None, [[2, 1, 4], [1.5, 1, 1]], 1 / 4, 1 / 2),
        ("token_mask", 0.8, 3.0, [[2, 0, 0], [1.5, 1, 1]], 2 / 4, 1 / 2),  # ICEPOP: both bounds
        ("token_mask", None, 1.8, [[0, 0.5, 0], [1.5, 1, 1]], 2 / 4, 1 / 2),  # AReaL: the upper bound only
        ("token_mask", 1.6, None, [[2, 0, 4], [0, 1, 1]], 2 / 4, 2 / 2),
        ("sequence_truncate", 0.8, 3.0, [[3, 3, 3], [1.5, 1, 1]], 3 / 4, 1 / 2),
        ("sequence_truncate", 2.0, 5.0, [[4, 4, 4], [2, 1, 1]], 1 / 4, 1 / 2),
        ("sequence_mask", None, 3.0, [[0, 0, 0], [1.5, 1, 1]], 3 / 4, 1 / 2),  # TRL 1.16's default
        ("sequence_mask", 2.0, 5.0, [[4, 4, 4], [0, 1, 1]], 1 / 4, 1 / 2),
    ],
)
def test_each_mode_and_bound_by_hand(mode, clip_min, clip_max, weights, hit_tokens, hit_rows):
    """The sequence ratio is the product of the token ratios (row 0: 2 x 0.5 x 4 = 4), not their geometric mean;
    truncate modes clip to the bounds, mask modes zero what falls outside; padding keeps weight 1."""
    got, stats = off_policy_weights(TRAINER, SAMPLER, MASK, mode, clip_min, clip_max)
    assert torch.allclose(got, torch.tensor(weights, dtype=torch.float32), atol=1e-5), got
    name = "masked" if mode.endswith("mask") else "truncated"
    assert stats[f"{name}_tokens"].item() == pytest.approx(hit_tokens)
    assert stats[f"{name}_sequences"].item() == pytest.approx(hit_rows)
    inside = torch.tensor(weights, dtype=torch.float32)[MASK.bool()]
    assert stats["is_weight/mean"].item() == pytest.approx(inside.mean().item(), abs=1e-5)
    assert stats["is_weight/min"].item() == pytest.approx(inside.min().item(), abs=1e-5)
    assert stats["is_weight/max"].item() == pytest.approx(inside.max().item(), abs=1e-5)
    assert not got.requires_grad


def test_mismatch_statistics_by_hand():
    """``mismatch_kl``: the mean k3 estimate of KL(pi_b || pi_old) over response tokens, ``rho - 1 - log rho``
    (ratios 2, 0.5, 4, 1.5: sum 4 - log 6); ``logp_gap``: |log pi_b - log pi_old|; padding never counts."""
    none, stats = off_policy_weights(TRAINER, SAMPLER, MASK, "none")
    assert none is None and set(stats) == {"logp_gap/mean", "logp_gap/max", "mismatch_kl"}
    assert stats["mismatch_kl"].item() == pytest.approx((4 - LOG(6)) / 4, abs=1e-6)
    assert stats["logp_gap/mean"].item() == pytest.approx((LOG(2) * 2 + LOG(4) + LOG(1.5)) / 4, abs=1e-6)
    assert stats["logp_gap/max"].item() == pytest.approx(LOG(4), abs=1e-6)  # the padded -5 is not counted


def trl_weights(trainer, sampler, mask, mode, clip_min, clip_max):
    """TRL 1.16's ``_generate_and_score_completions`` formula as a loop: per-token log-ratio (NaN -> 0), summed per
    response for the sequence modes, then clamped or masked."""
    out = torch.ones_like(trainer)
    for b in range(trainer.shape[0]):
        diffs = [0.0 if math.isnan(d) else d for d in ((trainer[b] - sampler[b]) * mask[b]).tolist()]
        total = sum(diffs)
        for t in range(trainer.shape[1]):
            if not mask[b, t]:
                continue
            rho = math.exp(total if mode.startswith("sequence") else diffs[t])
            low, high = clip_min if clip_min is not None else -math.inf, clip_max if clip_max is not None else math.inf
            if mode.endswith("truncate"):
                out[b, t] = min(max(rho, low), high)
            else:
                out[b, t] = rho if low <= rho <= high else 0.0
    return out


@pytest.mark.parametrize("mode", sorted(IMPORTANCE_SAMPLING_MODES))
def test_each_mode_equals_trls_formula_as_a_loop(mode):
    torch.manual_seed(0)
    random.seed(0)
    trainer = -torch.rand(6, 9) * 3
    sampler = trainer + 0.3 * torch.randn(6, 9)
    sampler[2, 4] = math.nan  # a token the sampler could not score: weight 1 in token modes, as TRL
    mask = torch.ones(6, 9)
    for row, length in enumerate([9, 5, 7, 1, 0, 3]):
        mask[row, length:] = 0
    for clip_min, clip_max in ((None, 3.0), (0.5, 2.0), (0.9, None), (0.5, 5.0)):
        got, _ = off_policy_weights(trainer, sampler, mask, mode, clip_min, clip_max)
        expected = trl_weights(trainer, sampler, mask, mode, clip_min, clip_max)
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (mode, clip_min, clip_max)


@pytest.mark.parametrize("mode", sorted(IMPORTANCE_SAMPLING_MODES))
def test_no_gap_gives_weights_of_one(mode):
    """The synchronous fp32 case: the sampler's log-probs are the trainer's, every weight is 1 and nothing is
    masked or truncated, whatever the mode (TRL's defaults and ICEPOP's bounds)."""
    logprobs = -torch.rand(4, 6) * 4
    mask = (torch.arange(6) < torch.tensor([[6], [3], [1], [5]])).long()
    for clip_min, clip_max in ((None, 3.0), (0.5, 5.0)):
        weights, stats = off_policy_weights(logprobs, logprobs.clone(), mask, mode, clip_min, clip_max)
        assert torch.equal(weights, torch.ones_like(weights))
        assert stats["mismatch_kl"].item() == 0 and stats["logp_gap/max"].item() == 0
        assert all(stats[k].item() == 0 for k in stats if k.endswith(("_tokens", "_sequences")))


def test_modes_registry_and_auto_default():
    """The registry's keys are the type's values besides ``none`` and ``auto``; ``auto`` is TRL's ``sequence_mask``
    on a GPU or with stale samples and no correction for a synchronous CPU run; TRL's bounds are the defaults."""
    assert set(ImportanceSamplingMode.__args__) == set(IMPORTANCE_SAMPLING_MODES) | {"none", "auto"}
    options = PolicyLossConfig()
    assert (options.importance_sampling_clip_min, options.importance_sampling_clip_max) == (None, 3.0)
    assert options.off_policy_mode("cuda") == "sequence_mask" and options.off_policy_mode("cpu") == "none"
    assert options.off_policy_mode("cpu", stale=True) == "sequence_mask"
    fixed = PolicyLossConfig(importance_sampling_mode="token_mask")
    assert fixed.off_policy_mode("cpu") == fixed.off_policy_mode("cuda") == "token_mask"
    with pytest.raises(ValueError, match="unknown importance_sampling_mode"):
        off_policy_weights(TRAINER, SAMPLER, MASK, "token_clip")


def test_decoupled_objective_gradient_by_hand():
    """AReaL's decoupled PPO (Fu et al. 2025): ``w_t * max(-A u_t, -A clip(u_t))``, ``u = pi_theta / pi_prox``,
    ``w = pi_prox / pi_behav`` detached (here ``token_mask`` with C_max 3). Token 0: u = e^0.1 inside the clip,
    w = 2, A = 1: d/dlogp = -w A u / 3. Token 1: A = -1, u = e^-0.3 below 1 - 0.2: the clipped term wins, no
    gradient. Token 2: w = 4 above C_max: masked, no gradient. The clip is around pi_prox, not pi_behav: with the
    behaviour log-probs as the ratio's denominator token 0's ratio would be 2e^0.1, clipped."""
    logprobs = torch.tensor([[-1.0, -2.3, -0.5]], requires_grad=True)
    proximal = torch.tensor([[-1.1, -2.0, -0.5]])
    behaviour = proximal - torch.tensor([[LOG(2), 0.0, LOG(4)]])
    advantages, mask = torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3)
    loss, stats = decoupled_policy_loss(
        logprobs, proximal, behaviour, advantages, mask, "token_mask", None, 3.0, epsilon=0.2, aggregation="token"
    )
    loss.backward()
    u0 = math.exp(0.1)
    expected_loss = (-2 * u0 + 0.8 + 0) / 3  # token 1: max(u, 0.8) = 0.8 (constant); token 2 weighed 0
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert torch.allclose(logprobs.grad, torch.tensor([[-2 * u0 / 3, 0.0, 0.0]]), atol=1e-6)
    assert stats["masked_tokens"].item() == pytest.approx(1 / 3) and stats["clipfrac"].item() == pytest.approx(1 / 3)
