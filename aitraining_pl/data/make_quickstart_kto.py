"""Regenerates ``quickstart_kto.jsonl``: unpaired labelled completions for the KTO quickstart, derived from
``quickstart_preferences.jsonl`` (TRL's unpaired layout: ``prompt``, ``completion``, ``label``).

Each preference pair gives one row, its chosen completion labelled ``true`` (desirable) or its rejected one
labelled ``false`` (undesirable), by a seeded coin flip: about half of each, and no prompt seen with both of
its completions, as in thumbs-up / thumbs-down feedback. Run: ``python -m aitraining_pl.data.make_quickstart_kto``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def make(pairs: list[dict], seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for pair in pairs:
        desirable = rng.random() < 0.5
        completion = pair["chosen"] if desirable else pair["rejected"]
        rows.append({"prompt": pair["prompt"], "completion": completion, "label": desirable})
    return rows


if __name__ == "__main__":
    source = HERE / "quickstart_preferences.jsonl"
    pairs = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = HERE / "quickstart_kto.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in make(pairs)), encoding="utf-8")
    print(f"wrote {out}")
