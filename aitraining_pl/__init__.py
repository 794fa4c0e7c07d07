"""aitraining_pl: SFT, PPO, DPO and reward-model training for language models as PyTorch Lightning components.

Public names are imported lazily, so ``import aitraining_pl`` stays cheap and each layer loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> module that defines it. Each module adds its own entries here.
_EXPORTS: dict[str, str] = {
    # layer 1: maths
    "AdaptiveKLController": "aitraining_pl.losses",
    "FixedKLController": "aitraining_pl.losses",
    # layer 2: models
    "LoRAConfig": "aitraining_pl.models",
    "PPOModel": "aitraining_pl.models",
    "ValueHead": "aitraining_pl.models",
    "ReferencePolicy": "aitraining_pl.models",
    "load_causal_lm": "aitraining_pl.models",
    "load_tokenizer": "aitraining_pl.models",
    "RewardModelConfig": "aitraining_pl.models",
    "RewardModel": "aitraining_pl.models",
    "PairwiseRewardModel": "aitraining_pl.models",
    "MultiObjectiveRewardModel": "aitraining_pl.models",
    "load_reward_model": "aitraining_pl.models",
    # layers 3-4: supervised fine-tuning
    "SFTDataModule": "aitraining_pl.datamodules.sft",
    "SFTModule": "aitraining_pl.modules.sft",
    # layers 3-5: DPO (preference data, module, export callback, shared base, CLI)
    "PreferenceDataModule": "aitraining_pl.datamodules.preference",
    "DPOModule": "aitraining_pl.modules.dpo",
    "AlignmentModule": "aitraining_pl.modules.base",
    "HFExportCallback": "aitraining_pl.callbacks.export",
    # layers 3-4: reward-model training
    "ScoresDataModule": "aitraining_pl.datamodules.scores",
    "RewardModule": "aitraining_pl.modules.reward",
    "PairwiseRewardModule": "aitraining_pl.modules.reward",
    "MultiObjectiveRewardModule": "aitraining_pl.modules.reward",
    # layers 3-4: PPO (prompt data, reward sources, rollouts, callbacks, module)
    "PromptDataset": "aitraining_pl.datamodules.prompt",
    "PromptDataModule": "aitraining_pl.datamodules.prompt",
    "RewardSource": "aitraining_pl.rewards",
    "RewardError": "aitraining_pl.rewards",
    "WeightedRewards": "aitraining_pl.rewards",
    "build_reward_source": "aitraining_pl.rewards",
    "GenerationConfig": "aitraining_pl.rollout",
    "Rollout": "aitraining_pl.rollout",
    "RolloutEngine": "aitraining_pl.rollout",
    "AdaptiveKLCallback": "aitraining_pl.callbacks.kl",
    "SamplingCallback": "aitraining_pl.callbacks.sampling",
    "PPOModule": "aitraining_pl.modules.ppo",
    "OnlineRLModule": "aitraining_pl.modules.online",
    "CriticFreeModule": "aitraining_pl.modules.critic_free",
    "GRPOModule": "aitraining_pl.modules.critic_free",
    "RLOOModule": "aitraining_pl.modules.critic_free",
    # layer 3: environments
    "Observation": "aitraining_pl.environments",
    "StepResult": "aitraining_pl.environments",
    "Trajectory": "aitraining_pl.environments",
    "RLEnvironment": "aitraining_pl.environments",
    "TextGenerationEnv": "aitraining_pl.environments",
    "MultiObjectiveRewardEnv": "aitraining_pl.environments",
    "PreferenceComparisonEnv": "aitraining_pl.environments",
    "create_math_problem_env": "aitraining_pl.environments",
    "create_code_generation_env": "aitraining_pl.environments",
    # layer 5: the seed's forward/backward pipeline
    "ForwardBackwardPipeline": "aitraining_pl.forward_backward",
    "AsyncTrainingClient": "aitraining_pl.forward_backward",
    # layer 5: the seed's trainer facades (RewardModelTrainer lives with the reward models' trainer)
    "PPOConfig": "aitraining_pl.facades",
    "PPOTrainer": "aitraining_pl.facades",
    "DPOConfig": "aitraining_pl.facades",
    "DPOTrainer": "aitraining_pl.facades",
    "PreferenceDataset": "aitraining_pl.datamodules.preference",
    "MathProblemEnv": "aitraining_pl.environments",
    "CodeGenerationEnv": "aitraining_pl.environments",
    "RewardModelTrainer": "aitraining_pl.reward_trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'aitraining_pl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
