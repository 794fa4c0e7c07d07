"""RL environments for text: episodes with ``reset`` / ``step`` / ``render``, usable as PPO reward sources.

Every environment is also a reward source (``env(prompts, responses, metadata) -> list[float]``, with
per-component scores in ``env.last_components``), so ``PPOModule`` can score its rollouts with it.
"""

from aitraining_pl.environments.base import Observation, RLEnvironment, StepResult, Trajectory, call_reward_fn
from aitraining_pl.environments.code_generation import (
    DEFAULT_CODE_TASKS,
    CodeGenerationEnv,
    TestRunResult,
    create_code_generation_env,
    extract_code,
    run_test_cases,
    style_reward,
    syntax_reward,
)
from aitraining_pl.environments.hubs import OpenEnvEnvironment, VerifiersEnvironment
from aitraining_pl.environments.math_problems import (
    MathProblem,
    MathProblemEnv,
    create_math_problem_env,
    generate_math_problems,
    math_correctness_reward,
    math_format_reward,
    parse_final_number,
)
from aitraining_pl.environments.preference import PreferenceComparisonEnv
from aitraining_pl.environments.text import MultiObjectiveRewardEnv, TextGenerationEnv, word_count_reward

__all__ = [
    "Observation",
    "RLEnvironment",
    "StepResult",
    "Trajectory",
    "call_reward_fn",
    "TextGenerationEnv",
    "MultiObjectiveRewardEnv",
    "PreferenceComparisonEnv",
    "word_count_reward",
    "MathProblem",
    "MathProblemEnv",
    "create_math_problem_env",
    "generate_math_problems",
    "math_correctness_reward",
    "math_format_reward",
    "parse_final_number",
    "DEFAULT_CODE_TASKS",
    "CodeGenerationEnv",
    "TestRunResult",
    "create_code_generation_env",
    "extract_code",
    "run_test_cases",
    "style_reward",
    "syntax_reward",
    "VerifiersEnvironment",
    "OpenEnvEnvironment",
]


def __getattr__(name: str):
    if name == "length_reward":  # deprecated name of word_count_reward (warns)
        from aitraining_pl.environments import text

        return text.length_reward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
