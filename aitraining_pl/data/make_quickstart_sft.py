"""Regenerates ``quickstart_sft.jsonl``: 400 synthetic prompt-completion rows for the SFT quickstart.

The prompts ask about the topics of the DPO quickstart (``make_quickstart_preferences``) and the completions
are its preferred answers (a polite reply that defines the topic), so the SFT export is a natural starting
policy for the DPO quickstart: SFT -> DPO. Run: ``python -m aitraining_pl.data.make_quickstart_sft``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from aitraining_pl.data.make_quickstart_preferences import ASK, GOOD, TOPICS


def make(n: int = 400, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        t = rng.choice(list(TOPICS))
        prompt = rng.choice(ASK).format(t=t)
        completion = rng.choice(GOOD).format(t=t, T=t[0].upper() + t[1:], d=TOPICS[t])
        rows.append({"prompt": prompt, "completion": completion})
    return rows


if __name__ == "__main__":
    out = Path(__file__).with_name("quickstart_sft.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in make()), encoding="utf-8")
    print(f"wrote {out}")
