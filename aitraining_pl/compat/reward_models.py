"""The seed's reward-model methods (``autotrain.trainers.rl``), which only its API uses: ``forward_pair`` and
``compute_bradley_terry_loss`` of ``PairwiseRewardModel``, ``compute_multi_objective_loss`` of
``MultiObjectiveRewardModel``. Each class here is the core class (``aitraining_pl.models.reward``) with those methods
added; it saves and loads the same folders, and the reward modules train it like the core class."""

from __future__ import annotations

import torch

from aitraining_pl.losses import bradley_terry_loss, masked_objective_mse
from aitraining_pl.models import reward

__all__ = ["PairwiseRewardModel", "MultiObjectiveRewardModel"]


class PairwiseRewardModel(reward.PairwiseRewardModel):
    """The seed's ``PairwiseRewardModel``: P(A > B) = s(r_A - r_B) of two inputs, and its Bradley-Terry loss."""

    def forward_pair(
        self,
        input_ids_a: torch.Tensor,
        attention_mask_a: torch.Tensor | None,
        input_ids_b: torch.Tensor,
        attention_mask_b: torch.Tensor | None,
    ) -> torch.Tensor:
        """(B,) probability that A is preferred to B."""
        return torch.sigmoid(self.score(input_ids_a, attention_mask_a) - self.score(input_ids_b, attention_mask_b))

    def compute_bradley_terry_loss(
        self,
        input_ids_a: torch.Tensor,
        attention_mask_a: torch.Tensor | None,
        input_ids_b: torch.Tensor,
        attention_mask_b: torch.Tensor | None,
        labels: torch.Tensor,
        margin: torch.Tensor | None = None,
        center_coef: float = 0.0,
    ) -> torch.Tensor:
        """Scalar Bradley-Terry loss (``bradley_terry_loss``); ``labels`` (B,) is 1 where A is preferred, 0 where
        B is."""
        reward_a, reward_b = self.score(input_ids_a, attention_mask_a), self.score(input_ids_b, attention_mask_b)
        a_wins = labels.to(reward_a.device).bool()
        chosen, rejected = torch.where(a_wins, reward_a, reward_b), torch.where(a_wins, reward_b, reward_a)
        return bradley_terry_loss(chosen, rejected, margin=margin, center_coef=center_coef)


class MultiObjectiveRewardModel(reward.MultiObjectiveRewardModel):
    """The seed's ``MultiObjectiveRewardModel``: one head per objective, and its masked squared-error loss."""

    def compute_multi_objective_loss(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        target_rewards: torch.Tensor,
        objective_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(total, per_objective)`` squared-error loss against (B, n) targets (``masked_objective_mse``);
        ``objective_mask`` (B, n) or (n,) marks known targets, and a masked entry contributes nothing."""
        rewards = self.forward(input_ids, attention_mask, return_all_objectives=True)["rewards"]
        return masked_objective_mse(rewards, target_rewards.to(rewards), objective_mask)
