"""Regenerates ``quickstart_sft.jsonl``: 400 synthetic prompt-completion rows for the SFT quickstart.

The prompts ask about the topics of the DPO quickstart (``make_quickstart_preferences``) and the completions
are its preferred answers (a polite reply that defines the topic), so the SFT export is a natural starting
policy for the DPO quickstart: SFT -> DPO. Run: ``python -m aitraining_pl.data.make_quickstart_sft``.
"""

from __future__ import annotations

import random

from aitraining_pl.data.make_quickstart_preferences import question, write


def make(n: int = 400, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        _, prompt, completion = question(rng)
        rows.append({"prompt": prompt, "completion": completion})
    return rows


if __name__ == "__main__":
    write(make(), "quickstart_sft.jsonl")
