"""Shared by ``modules/test_reward_module.py`` and ``helpers/reward_ddp_script.py``: learnable preference pairs."""

from __future__ import annotations

import random


def synthetic_pairs(n: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    """Learnable preferences: chosen answers are vowels, rejected ones consonants, lengths random."""
    rng = random.Random(seed)
    prompts, chosen, rejected = [], [], []
    for _ in range(n):
        prompts.append("Q: " + "".join(rng.choice("bcdfgh") for _ in range(rng.randint(2, 6))) + "\nA: ")
        chosen.append("".join(rng.choice("aeiou") for _ in range(rng.randint(3, 8))))
        rejected.append("".join(rng.choice("xyzqk") for _ in range(rng.randint(3, 8))))
    return prompts, chosen, rejected
