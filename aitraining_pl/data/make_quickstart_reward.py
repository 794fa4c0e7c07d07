"""Regenerates ``quickstart_reward.jsonl``: 400 synthetic preference pairs for the reward-model quickstart.

Each prompt asks about a topic; the chosen answer explains it, the rejected one brushes the user off in
words of its own (short or long, often naming the topic, so neither length nor the topic word gives the
answer away). A tiny randomly initialised reward model learns to tell them apart in about a minute on a CPU,
held-out accuracy rising from chance. Run: ``python -m aitraining_pl.data.make_quickstart_reward``.
"""

from __future__ import annotations

import random

from aitraining_pl.data.make_quickstart_preferences import question, write

RUDE = [
    "ugh, {t} again? look it up yourself.",
    "I am not your teacher, go read about {t} somewhere else.",
    "not my problem",
    "why do you even care about {t}? whatever.",
    "meh, {t} is boring and I will not explain it to you today.",
    "ask someone else, I have better things to do than talk about {t}.",
    "no.",
    "figure out {t} on your own, it is not that hard, honestly.",
]


def make(n: int = 400, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        t, prompt, chosen = question(rng)
        rejected = rng.choice(RUDE).format(t=t)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


if __name__ == "__main__":
    write(make(), "quickstart_reward.jsonl")
