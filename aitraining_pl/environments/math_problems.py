"""Arithmetic word problems with known answers, and the math environment built on them."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from aitraining_pl.environments.text import MultiObjectiveRewardEnv

#: the instruction appended to every question.
ANSWER_INSTRUCTION = "Finish with a line 'Answer: <number>'."

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jin")
_ITEMS = ("apple", "book", "coin", "marble", "pencil", "card", "shell", "stamp")

# (operation, template, answer(a, b, c)); operands are drawn so that every answer is a whole number >= 0.
_TEMPLATES = (
    ("add", "{n} has {a} {i}s and gets {b} more. How many {i}s does {n} have now?", lambda a, b, c: a + b),
    ("sub", "{n} has {a} {i}s and gives away {b}. How many {i}s are left?", lambda a, b, c: a - b),
    ("mul", "{n} buys {a} boxes with {b} {i}s in each. How many {i}s is that?", lambda a, b, c: a * b),
    ("div", "{n} shares {ab} {i}s equally among {b} friends. How many {i}s does each get?", lambda a, b, c: a),
    (
        "two_step",
        "{n} has {a} {i}s, buys {b} more, then gives away {c}. How many {i}s are left?",
        lambda a, b, c: a + b - c,
    ),
)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_LINE = re.compile(r"^\s*Answer:\s*-?\d[\d,]*(?:\.\d+)?\s*\.?\s*$", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class MathProblem:
    """One generated problem: the prompt text, its whole-number answer and the expression it came from."""

    prompt: str
    answer: int
    expression: str
    operation: str


def generate_math_problems(num_problems: int = 100, seed: int = 0, max_operand: int = 20) -> list[MathProblem]:
    """``num_problems`` word problems from a ``random.Random(seed)`` stream (same seed, same problems).

    Operations: addition, subtraction (never negative), multiplication, exact division and a two-step
    add-then-subtract, with operands from 1 to ``max_operand``.
    """
    rng = random.Random(seed)
    problems = []
    for _ in range(num_problems):
        op, template, answer_of = rng.choice(_TEMPLATES)
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if op == "sub" and b > a:
            a, b = b, a
        c = rng.randint(0, a + b) if op == "two_step" else 0
        question = template.format(n=rng.choice(_NAMES), i=rng.choice(_ITEMS), a=a, b=b, c=c, ab=a * b)
        expression = {
            "add": f"{a} + {b}",
            "sub": f"{a} - {b}",
            "mul": f"{a} * {b}",
            "div": f"{a * b} // {b}",
            "two_step": f"{a} + {b} - {c}",
        }[op]
        problems.append(MathProblem(f"{question} {ANSWER_INSTRUCTION}\n", answer_of(a, b, c), expression, op))
    return problems


def parse_final_number(text: str) -> float | None:
    """The last number written in ``text`` (``1,234`` and ``-3.5`` are understood), or ``None``."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


def math_correctness_reward(
    prompt: str, generated: str, full_text: str, metadata: dict[str, Any] | None = None
) -> float:
    """1.0 when the final number of the response equals ``metadata["answer"]``, else 0.0. The answer is a number
    or a text whose last number is the answer (GSM8K's worked solutions end with ``#### <answer>``)."""
    if not metadata or "answer" not in metadata:
        raise ValueError(f"no known answer for the prompt {prompt[:60]!r}: give metadata={{'answer': ...}}")
    answer = metadata["answer"]
    expected = float(answer) if isinstance(answer, (int, float)) else parse_final_number(str(answer))
    if expected is None:
        raise ValueError(f"no number in the known answer {str(answer)[-60:]!r} of the prompt {prompt[:60]!r}")
    value = parse_final_number(generated)
    return float(value is not None and abs(value - expected) < 1e-6)


def math_format_reward(prompt: str, generated: str, full_text: str) -> float:
    """1.0 when the response has a line ``Answer: <number>``, else 0.0."""
    return float(_ANSWER_LINE.search(generated) is not None)


class MathProblemEnv(MultiObjectiveRewardEnv):
    """A ``MultiObjectiveRewardEnv`` over generated arithmetic word problems.

    Components: ``correctness`` (weight 1.0: the final number of the response equals the answer) and
    ``formatting`` (weight 0.1: the response has an ``Answer: <number>`` line). Each prompt's metadata holds
    ``answer``; used as a reward source, prompts the environment generated find their answer themselves,
    other prompts need ``{"answer": ...}`` in their metadata. As a class it can be named in YAML as a PPO
    reward source: ``reward: aitraining_pl.environments.MathProblemEnv``.

    Args:
        tokenizer: a Hugging Face tokenizer or a name for ``load_tokenizer`` (only episodes use it; scoring
            as a reward source does not).
        num_problems: how many problems (prompts) to generate.
        seed: seed of the problem generator.
        max_length: maximum tokens of prompt plus response.
        correctness_weight: weight of the correctness component.
        format_weight: weight of the formatting component.
        **kwargs: other ``TextGenerationEnv`` arguments (``stop_sequences``, ``temperature``).
    """

    def __init__(
        self,
        tokenizer: Any = "byte",
        num_problems: int = 100,
        seed: int = 0,
        max_length: int = 256,
        correctness_weight: float = 1.0,
        format_weight: float = 0.1,
        **kwargs: Any,
    ):
        self.problems = generate_math_problems(num_problems, seed)
        super().__init__(
            tokenizer,
            [p.prompt for p in self.problems],
            reward_components={"correctness": math_correctness_reward, "formatting": math_format_reward},
            reward_weights={"correctness": correctness_weight, "formatting": format_weight},
            prompt_metadata=[{"answer": p.answer, "expression": p.expression} for p in self.problems],
            max_length=max_length,
            **kwargs,
        )


def create_math_problem_env(tokenizer: Any, **kwargs: Any) -> MathProblemEnv:
    """The seed's math environment: ``MathProblemEnv(tokenizer, **kwargs)`` (correctness 1.0, formatting 0.1)."""
    return MathProblemEnv(tokenizer, **kwargs)
