"""The LightningModules: SFT, DPO, KTO, ORPO, CPO, the reward modules and the online RL family (PPO, GRPO, RLOO,
REINFORCE++)."""

from aitraining_pl.modules.base import AlignmentModule, SharedStepModule
from aitraining_pl.modules.critic_free import CriticFreeModule, GRPOModule, RLOOModule
from aitraining_pl.modules.distill import DistillationModule
from aitraining_pl.modules.dpo import DPOModule
from aitraining_pl.modules.kto import KTOModule
from aitraining_pl.modules.online import OnlineRLModule, RolloutBatch
from aitraining_pl.modules.orpo import CPOModule, ORPOModule
from aitraining_pl.modules.ppo import PPOModule
from aitraining_pl.modules.preference import PreferenceModule
from aitraining_pl.modules.reward import MultiObjectiveRewardModule, PairwiseRewardModule, RewardModule
from aitraining_pl.modules.sft import SFTModule

__all__ = [
    "AlignmentModule",
    "SharedStepModule",
    "PreferenceModule",
    "SFTModule",
    "DPOModule",
    "KTOModule",
    "ORPOModule",
    "CPOModule",
    "RewardModule",
    "PairwiseRewardModule",
    "MultiObjectiveRewardModule",
    "OnlineRLModule",
    "RolloutBatch",
    "PPOModule",
    "CriticFreeModule",
    "GRPOModule",
    "RLOOModule",
    "DistillationModule",
]
