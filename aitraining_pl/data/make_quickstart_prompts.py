"""Regenerates ``quickstart_prompts.jsonl``: 80 short prompts (64 for training, 16 held out) for the PPO quickstart
(``configs/quickstart/ppo.yaml``), each with ``target_chars`` metadata read by the built-in reward
``aitraining_pl.rewards:char_fraction_reward`` (the share of response characters that are lowercase letters).

Run: ``python -m aitraining_pl.data.make_quickstart_prompts``.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

TOPICS = (
    "cats dogs rain snow tea bread rivers stars trees birds ships maps clocks books lamps roads bees owls "
    "foxes hills moss salt wind fire glass paper stone wool honey apples pears plums seeds roots leaves "
    "waves sand shells kites drums bells songs poems jokes games cards dice coins keys doors walls roofs "
    "bridges towers gardens fields farms mills boats trains planes bikes carts wheels ropes knots nets "
    "hats boots coats gloves rings masks cups bowls forks jars nuts figs lakes"
).split()
TEMPLATES = ("Write about {}:", "Tell me of {}.", "A note on {}:", "Say something about {}.")


def main() -> None:
    path = Path(__file__).with_name("quickstart_prompts.jsonl")
    with path.open("w", encoding="utf-8") as handle:
        for i, topic in enumerate(TOPICS[:80]):
            row = {"prompt": TEMPLATES[i % len(TEMPLATES)].format(topic), "target_chars": string.ascii_lowercase}
            handle.write(json.dumps(row) + "\n")
    print(f"wrote {min(80, len(TOPICS))} prompts to {path}")


if __name__ == "__main__":
    main()
