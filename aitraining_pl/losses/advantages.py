"""Advantage estimators of online RL for language models, as a registry of small pure functions.

Every estimator has one signature: ``fn(rewards, mask, group, values=None, gamma=1.0, lam=1.0, eps=1e-4)``
with per-token ``rewards`` (N, R) (the sequence score on each response's last token, plus any per-token
KL penalty), the response ``mask`` (N, R), ``group`` (N,) the index of the prompt each row answers (rows of
one group need not be adjacent, groups may differ in size), and ``values`` (N, R) for a critic. It returns
(N, R) advantages, zero outside the mask. Sequence-level estimators score each row by the sum of its token
rewards (the score minus ``kl_coef`` * KL when the KL is in the reward) and give every token of the row that
advantage. A group of one has no baseline: its advantage is 0 (no learning signal), as for a group whose
rewards are all equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from aitraining_pl.losses.logprobs import masked_whiten
from aitraining_pl.losses.rl import gae


def group_statistics(scores: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the size, mean and Bessel-corrected standard deviation of its group (std 0 for a group of one).

    Args:
        scores: (N,) float. group: (N,) long group index of each row.

    Returns:
        ``(count, mean, std)``, each (N,).
    """
    _, index = torch.unique(group, return_inverse=True)
    n_groups = int(index.max()) + 1 if index.numel() else 0
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, index, torch.ones_like(scores))
    mean = zeros.index_add(0, index, scores) / count
    squares = zeros.index_add(0, index, (scores - mean[index]) ** 2)
    std = (squares / (count - 1).clamp_min(1)).sqrt()
    return count[index], mean[index], std[index]


def _per_token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(1) * mask.to(advantages.dtype)


def _sequence_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (rewards * mask.to(rewards.dtype)).sum(1)


def grpo_advantages(
    rewards, mask, group, values=None, gamma=1.0, lam=1.0, eps=1e-4, scale_rewards: str = "group"
) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath, outcome supervision): ``(r_i - mean_g) / (std + eps)``.

    ``scale_rewards`` (TRL's option) picks the std: ``group`` (the group's, GRPO), ``batch`` (the Bessel-corrected
    std of every row's score in the batch, as Liu et al. 2025 recommend and TRL computes it) or ``none`` (no
    division: Dr. GRPO, the same as ``dr_grpo``)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; known: {', '.join(SCALE_REWARDS)}")
    scores = _sequence_scores(rewards, mask)
    count, mean, std = group_statistics(scores, group)
    if scale_rewards == "batch":
        std = scores.std().nan_to_num(0.0).expand_as(scores) if scores.numel() > 1 else torch.zeros_like(scores)
    elif scale_rewards == "none":
        std, eps = torch.ones_like(scores), 0.0
    advantages = torch.where(count > 1, (scores - mean) / (std + eps), torch.zeros_like(scores))
    return _per_token(advantages, mask)


#: The ``scale_rewards`` values of the ``grpo`` estimator (TRL's names), as a type; equal to ``SCALE_REWARDS``.
ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS = ("group", "batch", "none")


def dr_grpo_advantages(rewards, mask, group, values=None, gamma=1.0, lam=1.0, eps=1e-4) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``r_i - mean_g``, no std division
    (which up-weights groups that are almost all right or all wrong)."""
    scores = _sequence_scores(rewards, mask)
    count, mean, _ = group_statistics(scores, group)
    return _per_token(torch.where(count > 1, scores - mean, torch.zeros_like(scores)), mask)


def rloo_advantages(rewards, mask, group, values=None, gamma=1.0, lam=1.0, eps=1e-4) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024; Kool et al. 2019): ``r_i - mean_{j != i, j in g} r_j``, the mean of the
    other samples of the same prompt as the baseline."""
    scores = _sequence_scores(rewards, mask)
    count, mean, _ = group_statistics(scores, group)
    baseline = (mean * count - scores) / (count - 1).clamp_min(1)
    return _per_token(torch.where(count > 1, scores - baseline, torch.zeros_like(scores)), mask)


def reinforce_pp_advantages(rewards, mask, group, values=None, gamma=1.0, lam=1.0, eps=1e-4) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): per-token returns-to-go ``G_t = sum_{s >= t} gamma^(s-t) r_s`` of the token
    rewards (score on the last token, ``-kl_coef * KL`` on every token), normalised over the whole batch's
    tokens (mean and std over the mask), no critic and no group baseline. Masked positions are skipped (holes
    where an environment spoke carry the return across; after the end nothing is left to carry)."""
    mask = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running * mask[:, t]
    if mask.sum() < 2:
        return torch.zeros_like(returns)
    return masked_whiten(returns, mask, eps=eps**2)


def whitened_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) whitened over the batch's tokens, and the returns (``advantages + values``
    before whitening) the critic regresses on: PPO's advantages and value targets from one GAE pass.

    Returns:
        ``(advantages, returns)``, each (N, R), zero outside the mask.
    """
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    return masked_whiten(advantages, mask), returns


def gae_advantages(rewards, mask, group, values=None, gamma=1.0, lam=1.0, eps=1e-4) -> torch.Tensor:
    """GAE (Schulman et al. 2016) with a critic's ``values``, whitened over the batch (``whitened_gae``)."""
    if values is None:
        raise ValueError("the gae advantage estimator needs a critic's values")
    return whitened_gae(rewards, values, mask, gamma, lam)[0]


AdvantageEstimator = Callable[..., torch.Tensor]

#: name -> estimator; ``CRITIC_ESTIMATORS`` need ``values``.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}
CRITIC_ESTIMATORS = frozenset({"gae"})
#: the estimators whose baseline is a statistic of the group's sequence scores (``compute_advantages``' ``episode``)
GROUP_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo"})
#: The critic-free ``advantage`` values, as a type; equal to ``ADVANTAGE_ESTIMATORS`` less ``CRITIC_ESTIMATORS``
#: (tested).
CriticFreeAdvantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group: torch.Tensor,
    values: torch.Tensor | None = None,
    episode: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Run the estimator ``name`` of ``ADVANTAGE_ESTIMATORS`` (see the module docstring for the shapes).

    ``episode`` (N,) long: the episode of each row, where an episode gives several rows (an agent that rewrote its
    history: ``agents.environment``). A group-baseline estimator (``GROUP_ESTIMATORS``) then takes its group
    statistics over episodes, one value each (the first row with sampled tokens stands for its episode), and
    gives every row of an episode its episode's advantage; rows without sampled tokens get none. The token-level
    estimators (``reinforce_pp``, ``gae``) treat each row as its own trajectory already."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(ADVANTAGE_ESTIMATORS)}")
    estimator = ADVANTAGE_ESTIMATORS[name]
    if episode is None or name not in GROUP_ESTIMATORS:
        return estimator(rewards, mask, group, values=values, **kwargs)
    sampled = mask.bool().any(1)
    rows = torch.arange(len(episode), device=episode.device)
    first = torch.full((int(episode.max()) + 1,), len(episode), dtype=torch.long, device=episode.device)
    first = first.scatter_reduce(0, episode[sampled], rows[sampled], reduce="amin")  # each episode's first row
    present = first < len(episode)  # episodes with sampled tokens
    heads = first[present]
    per_token = estimator(rewards[heads], mask[heads], group[heads], **kwargs)
    scalar = torch.zeros(len(first), dtype=per_token.dtype, device=per_token.device)
    scalar[present] = per_token.sum(1) / mask[heads].sum(1).clamp_min(1)
    return _per_token(scalar[episode], mask)
