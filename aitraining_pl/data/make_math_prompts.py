"""Regenerates ``math_prompts.jsonl``: 256 arithmetic word problems (``prompt``, ``answer``) for the PPO
quickstart variant whose reward source is the math environment (``configs/quickstart/ppo_math.yaml``).

The problems are ``generate_math_problems(256, seed=0)``, the same ones ``MathProblemEnv(num_problems=256)``
generates, so the environment knows each answer even without the ``answer`` column.
Run: ``python -m aitraining_pl.data.make_math_prompts``.
"""

from __future__ import annotations

import json
from pathlib import Path

from aitraining_pl.environments.math_problems import generate_math_problems

NUM_PROBLEMS, SEED = 256, 0


def main() -> None:
    path = Path(__file__).with_name("math_prompts.jsonl")
    with path.open("w", encoding="utf-8") as handle:
        for problem in generate_math_problems(NUM_PROBLEMS, SEED):
            handle.write(json.dumps({"prompt": problem.prompt, "answer": problem.answer}) + "\n")
    print(f"wrote {NUM_PROBLEMS} problems to {path}")


if __name__ == "__main__":
    main()
