"""Advantage estimators and the clipped policy-gradient loss against plain Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from aitraining_pl.losses import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, clipped_policy_loss, compute_advantages

# groups: 0 has ties, 1 is a group of one, 2 has all-equal rewards, 3 is ordinary; rows of a group interleaved
SCORES = [1.0, 0.0, 1.0, 0.5, 2.0, 2.0, 2.0, 3.0, -1.0, 0.25, 1.0]
GROUP = [0, 0, 0, 1, 2, 2, 2, 3, 3, 3, 0]
LENGTHS = [3, 1, 4, 2, 4, 3, 1, 2, 4, 3, 2]
R = 4


def _token_rewards(scores, lengths, kl=0.0):
    rewards = torch.zeros(len(scores), R)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        for t in range(n):
            rewards[i, t] = -kl * (t + 1)
        rewards[i, n - 1] += s
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(R)] for n in lengths])
    return rewards, mask


def _loop_sequence(kind, totals):
    out = []
    for i, s in enumerate(totals):
        members = [totals[j] for j in range(len(totals)) if GROUP[j] == GROUP[i]]
        n = len(members)
        if n == 1:
            out.append(0.0)
            continue
        mean = sum(members) / n
        if kind == "grpo":
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1))
            out.append((s - mean) / (std + 1e-4))
        elif kind == "dr_grpo":
            out.append(s - mean)
        else:  # rloo
            out.append(s - (sum(members) - s) / (n - 1))
    return out


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_group_estimators_match_a_loop(kind, kl):
    rewards, mask = _token_rewards(SCORES, LENGTHS, kl)
    got = compute_advantages(kind, rewards, mask, torch.tensor(GROUP))
    totals = [SCORES[i] - kl * sum(t + 1 for t in range(LENGTHS[i])) for i in range(len(SCORES))]
    expected = _loop_sequence(kind, totals)
    for i, n in enumerate(LENGTHS):
        for t in range(R):
            assert got[i, t].item() == pytest.approx(expected[i] if t < n else 0.0, abs=1e-5), (kind, i, t)
    # the group of one and (without a length-dependent KL term) the all-equal group carry no signal
    assert torch.all(got[3] == 0) and (kl or torch.all(got[4:7] == 0))


def test_grpo_hand_values():
    rewards, mask = _token_rewards([1.0, 0.0], [1, 1])
    got = compute_advantages("grpo", rewards, mask, torch.tensor([0, 0]))[:, 0]
    # mean 0.5, Bessel std sqrt(0.5)
    assert got.tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4)])
    assert compute_advantages("rloo", rewards, mask, torch.tensor([0, 0]))[:, 0].tolist() == [1.0, -1.0]


def test_reinforce_pp_matches_a_loop():
    kl = 0.1
    rewards, mask = _token_rewards(SCORES, LENGTHS, kl)
    got = compute_advantages("reinforce_pp", rewards, mask, torch.tensor(GROUP))
    returns = []
    for i, n in enumerate(LENGTHS):
        row = [float(rewards[i, t]) for t in range(n)]
        returns.append([sum(row[t:]) for t in range(n)])
    flat = [g for row in returns for g in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((g - mean) ** 2 for g in flat) / (len(flat) - 1))
    for i, n in enumerate(LENGTHS):
        for t in range(R):
            expected = (returns[i][t] - mean) / math.sqrt(std**2 + 1e-8) if t < n else 0.0
            assert got[i, t].item() == pytest.approx(expected, abs=1e-5)
    # all-equal returns: zero advantages, no NaN
    flat_rewards, flat_mask = _token_rewards([1.0, 1.0], [1, 1])
    assert torch.all(compute_advantages("reinforce_pp", flat_rewards, flat_mask, torch.tensor([0, 1])) == 0)


def test_gae_estimator_is_whitened_gae_and_needs_values():
    rewards, mask = _token_rewards(SCORES, LENGTHS)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", rewards, mask, torch.tensor(GROUP))
    got = compute_advantages(
        "gae", rewards, mask, torch.tensor(GROUP), values=torch.zeros_like(rewards), gamma=1.0, lam=1.0
    )
    # zero values, gamma = lam = 1: advantages are the returns-to-go, whitened like REINFORCE++'s
    assert torch.allclose(got, compute_advantages("reinforce_pp", rewards, mask, torch.tensor(GROUP)), atol=1e-4)
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages("nope", rewards, mask, torch.tensor(GROUP))
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"}


def _loop_loss(logp, old, adv, mask, eps, eps_high, aggregation, max_length, ref=None, beta=0.0):
    per_row, total, count = [], 0.0, 0
    low = high = 0
    for i in range(len(logp)):
        row = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            rho = math.exp(logp[i][t] - old[i][t])
            a = adv[i][t]
            term = max(-a * rho, -a * min(max(rho, 1 - eps), 1 + eps_high))
            if ref is not None:
                d = ref[i][t] - logp[i][t]
                term += beta * (math.exp(d) - d - 1)
            row.append(term)
            low += rho < 1 - eps and a < 0
            high += rho > 1 + eps_high and a > 0
        per_row.append(sum(row) / len(row))
        total += sum(row)
        count += len(row)
    loss = {
        "sequence": sum(per_row) / len(per_row),
        "token": total / count,
        "constant": total / (len(logp) * max_length),
    }[aggregation]
    return loss, low / count, high / count


@pytest.mark.parametrize("aggregation", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("with_ref", [False, True])
def test_clipped_policy_loss_matches_a_loop(aggregation, with_ref):
    g = torch.Generator().manual_seed(0)
    old, ref = (-torch.rand(4, 5, generator=g) * 2 for _ in range(2))
    logp = old + 0.5 * torch.randn(4, 5, generator=g)
    adv = torch.randn(4, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    eps, eps_high, beta = 0.2, 0.28, 0.04
    loss, stats = clipped_policy_loss(
        logp,
        old,
        adv,
        mask,
        eps,
        eps_high,
        aggregation,
        max_length=8,
        ref_logprobs=ref if with_ref else None,
        kl_coef=beta,
    )
    expected, low, high = _loop_loss(
        logp.tolist(),
        old.tolist(),
        adv.tolist(),
        mask.tolist(),
        eps,
        eps_high,
        aggregation,
        8,
        ref.tolist() if with_ref else None,
        beta,
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clipfrac/low"].item() == pytest.approx(low) and stats["clipfrac/high"].item() == pytest.approx(high)
    assert low > 0 and high > 0  # the random ratios exercise both sides
    assert ("kl" in stats) == with_ref


def test_policy_loss_at_ratio_one_is_minus_the_mean_advantage():
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = clipped_policy_loss(logp, logp.detach(), adv, mask, aggregation="sequence")
    assert loss.item() == pytest.approx(-(1.0 + -2.0) / 2)
    loss.backward()  # d/dlogp of -A rho at rho = 1 is -A, scaled by 1 / (rows * row length)
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25, 0.0], [1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_statistics_over_episodes_not_rows(name):
    """An episode of two sequences (an agent that rewrote its history) and unused all-masked rows: the group's
    statistics are those of its episodes (each counted once), every sequence of an episode gets its episode's
    advantage, the unused rows none; equal to the estimator on one row per episode."""

    # prompt 0: episodes 0 (two sequences, reward 1), 1 (one sequence and an unused row, reward 0), 2 (reward 0.5)
    episode = torch.tensor([0, 0, 1, 1, 2, 2])
    group = torch.zeros(6, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]])
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.0])
    rewards = torch.zeros(6, 3)
    last = mask.cumsum(1).argmax(1)
    rewards[torch.arange(6), last] = scores * mask.any(1)
    got = compute_advantages(name, rewards, mask, group, episode=episode)
    heads = torch.tensor([0, 2, 4])
    per_episode = compute_advantages(name, rewards[heads], mask[heads], group[heads])[:, 0]  # one row each
    expected = per_episode[episode].unsqueeze(1) * mask
    torch.testing.assert_close(got, expected)
    by_hand = {"dr_grpo": [0.5, -0.5, 0.0], "rloo": [0.75, -0.75, 0.0]}  # mean 0.5; leave-one-out baselines
    if name in by_hand:
        torch.testing.assert_close(per_episode, torch.tensor(by_hand[name]))
    assert (got[[3, 5]] == 0).all()  # the unused rows
    assert torch.equal(got[0, :2], got[1, :2])  # both sequences of episode 0: its advantage
