"""The seed's API (``autotrain.trainers.rl``) in one place: change ``autotrain.trainers.rl`` to
``aitraining_pl.compat`` in an import and the seed's code runs on the Lightning pieces.

=============================================== =================================================
seed import                                     this package
=============================================== =================================================
``autotrain.trainers.rl``                       ``aitraining_pl.compat``
``autotrain.trainers.rl.dpo``                   ``aitraining_pl.compat.dpo``
``autotrain.trainers.rl.environments``          ``aitraining_pl.compat.environments``
``autotrain.trainers.rl.forward_backward``      ``aitraining_pl.compat.forward_backward``
=============================================== =================================================

The facades (``facades``, ``reward_trainer``) share ``compat.common``; ``reward_models`` adds the seed's methods
(``forward_pair``, ``compute_bradley_terry_loss``, ``compute_multi_objective_loss``) to the core reward models; the
seed's forward/backward pipeline is ``compat.forward_backward``. The rest (models, environments, data) is the core's,
re-exported here. Nothing outside this package imports it (tests/test_layering.py). Names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

#: the seed's ``autotrain.trainers.rl`` names -> module that defines them
_EXPORTS: dict[str, str] = {
    "PPOConfig": "aitraining_pl.compat.facades",
    "PPOTrainer": "aitraining_pl.compat.facades",
    "DPOConfig": "aitraining_pl.compat.facades",
    "DPOTrainer": "aitraining_pl.compat.facades",
    "RewardModelTrainer": "aitraining_pl.compat.reward_trainer",
    "ForwardBackwardPipeline": "aitraining_pl.compat.forward_backward",
    "AsyncTrainingClient": "aitraining_pl.compat.forward_backward",
    "PreferenceDataset": "aitraining_pl.datamodules.preference",
    "RewardModel": "aitraining_pl.models",
    "RewardModelConfig": "aitraining_pl.models",
    "PairwiseRewardModel": "aitraining_pl.compat.reward_models",  # the core class + the seed's methods
    "MultiObjectiveRewardModel": "aitraining_pl.compat.reward_models",
    "PPOModel": "aitraining_pl.models",
    "ValueHead": "aitraining_pl.models",
    "Observation": "aitraining_pl.environments",
    "StepResult": "aitraining_pl.environments",
    "Trajectory": "aitraining_pl.environments",
    "RLEnvironment": "aitraining_pl.environments",
    "TextGenerationEnv": "aitraining_pl.environments",
    "MultiObjectiveRewardEnv": "aitraining_pl.environments",
    "PreferenceComparisonEnv": "aitraining_pl.environments",
    "MathProblemEnv": "aitraining_pl.environments",
    "CodeGenerationEnv": "aitraining_pl.environments",
    "create_math_problem_env": "aitraining_pl.environments",
    "create_code_generation_env": "aitraining_pl.environments",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'aitraining_pl.compat' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
