"""aitraining_pl: SFT, DPO, reward-model and online-RL (PPO) training for language models as PyTorch Lightning
components.

The top level holds what a training script needs: the LightningModules, the DataModules, the callbacks, the
FSDP2 strategy, the configs (``LoRAConfig``, ``GenerationConfig``) and the CLI (``AlignmentCLI``, ``main``).
Everything else is imported from its subpackage (``aitraining_pl.losses``, ``.models``, ``.rewards``, ``.rollout``,
``.environments``); the seed's API is ``aitraining_pl.compat``. Names load on first use, so
``import aitraining_pl`` stays cheap. (The online-RL bases ``OnlineRLModule`` and ``CriticFreeModule``, like
``AlignmentModule``, are imported from ``aitraining_pl.modules.online`` / ``.critic_free`` / ``.base``.)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # LightningModules
    "SFTModule": "aitraining_pl.modules.sft",
    "DPOModule": "aitraining_pl.modules.dpo",
    "KTOModule": "aitraining_pl.modules.kto",
    "ORPOModule": "aitraining_pl.modules.orpo",
    "CPOModule": "aitraining_pl.modules.orpo",
    "RewardModule": "aitraining_pl.modules.reward",
    "PairwiseRewardModule": "aitraining_pl.modules.reward",
    "MultiObjectiveRewardModule": "aitraining_pl.modules.reward",
    "PPOModule": "aitraining_pl.modules.ppo",
    "GRPOModule": "aitraining_pl.modules.critic_free",
    "RLOOModule": "aitraining_pl.modules.critic_free",
    "DistillationModule": "aitraining_pl.modules.distill",
    # DataModules
    "SFTDataModule": "aitraining_pl.datamodules.sft",
    "PreferenceDataModule": "aitraining_pl.datamodules.preference",
    "KTODataModule": "aitraining_pl.datamodules.kto",
    "ScoresDataModule": "aitraining_pl.datamodules.scores",
    "PromptDataModule": "aitraining_pl.datamodules.prompt",
    # callbacks
    "AdaptiveKLCallback": "aitraining_pl.callbacks.kl",
    "ExactResumeCallback": "aitraining_pl.callbacks.resume",
    "HFExportCallback": "aitraining_pl.callbacks.export",
    "NonFiniteGuard": "aitraining_pl.callbacks.guard",
    "SamplingCallback": "aitraining_pl.callbacks.sampling",
    "GreedyEvalCallback": "aitraining_pl.callbacks.greedy_eval",
    "SyncReferenceCallback": "aitraining_pl.callbacks.reference_sync",
    "CompletionLogCallback": "aitraining_pl.callbacks.completions",
    # strategy (FSDP2)
    "FSDP2Strategy": "aitraining_pl.strategies",
    # configs
    "LoRAConfig": "aitraining_pl.models",
    "QuantizationConfig": "aitraining_pl.models.quantization",
    "GenerationConfig": "aitraining_pl.rollout",
    # command line
    "AlignmentCLI": "aitraining_pl.cli",
    "main": "aitraining_pl.cli",
}

#: names the top level exported before 0.2, importable from here until the next release with a
#: ``DeprecationWarning`` that names the module to import them from
_MOVED: dict[str, str] = {
    "AdaptiveKLController": "aitraining_pl.callbacks.kl",
    **dict.fromkeys(
        [
            "PPOModel",
            "ValueHead",
            "ReferencePolicy",
            "load_causal_lm",
            "load_tokenizer",
            "RewardModelConfig",
            "RewardModel",
            "load_reward_model",
        ],
        "aitraining_pl.models",
    ),
    # with the seed's methods (forward_pair, compute_bradley_terry_loss, compute_multi_objective_loss)
    **dict.fromkeys(["PairwiseRewardModel", "MultiObjectiveRewardModel"], "aitraining_pl.compat"),
    "AlignmentModule": "aitraining_pl.modules.base",
    "PromptDataset": "aitraining_pl.datamodules.prompt",
    "PreferenceDataset": "aitraining_pl.datamodules.preference",
    **dict.fromkeys(["RewardSource", "RewardError", "WeightedRewards", "build_reward_source"], "aitraining_pl.rewards"),
    **dict.fromkeys(["Rollout", "RolloutEngine"], "aitraining_pl.rollout"),
    **dict.fromkeys(
        [
            "Observation",
            "StepResult",
            "Trajectory",
            "RLEnvironment",
            "TextGenerationEnv",
            "MultiObjectiveRewardEnv",
            "PreferenceComparisonEnv",
            "MathProblemEnv",
            "CodeGenerationEnv",
            "create_math_problem_env",
            "create_code_generation_env",
        ],
        "aitraining_pl.environments",
    ),
    **dict.fromkeys(
        [
            "PPOConfig",
            "PPOTrainer",
            "DPOConfig",
            "DPOTrainer",
            "RewardModelTrainer",
            "ForwardBackwardPipeline",
            "AsyncTrainingClient",
        ],
        "aitraining_pl.compat",
    ),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        from aitraining_pl.compat.common import warn_moved

        warn_moved(f"from aitraining_pl import {name}", f"from {_MOVED[name]} import {name}")
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'aitraining_pl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
