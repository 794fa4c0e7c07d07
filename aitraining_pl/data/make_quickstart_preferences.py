"""Regenerates ``quickstart_preferences.jsonl``: 480 synthetic preference pairs for the DPO quickstart.

Each prompt asks about a topic; the chosen answer defines it correctly, the rejected one is either a
dismissive reply (15%) or, in the same polite words, the right definition with its words shuffled
(85%). So a model has to learn word order, not only a style: a tiny randomly initialised model gets
there within a couple of minutes on a CPU, which is what the quickstart shows.
Run: ``python -m aitraining_pl.data.make_quickstart_preferences``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = {
    "gravity": "the force that pulls masses toward each other",
    "photosynthesis": "how plants turn light, water and air into sugar",
    "a prime number": "a whole number above one divisible only by one and itself",
    "an atom": "the smallest unit of a chemical element",
    "the internet": "a global network of connected computers",
    "a volcano": "an opening in the crust where molten rock escapes",
    "democracy": "government by the people through voting",
    "a rainbow": "sunlight split into colours by water drops",
    "inflation": "a general rise in prices over time",
    "a vaccine": "a preparation that trains the immune system",
    "an algorithm": "a precise list of steps that solves a problem",
    "the moon": "the natural satellite that orbits the earth",
}
ASK = [
    "What is {t}?",
    "Explain {t}.",
    "Can you tell me about {t}?",
    "Describe {t} briefly.",
    "I want to learn about {t}.",
]
GOOD = [
    "Sure! {T} is {d}.",
    "Happy to help: {t} is {d}.",
    "Good question. {T} is {d}.",
    "Of course. In short, {t} is {d}.",
]
BAD = [
    "idk lol",
    "no idea, google it",
    "why would I know that",
    "whatever",
    "not my problem",
    "ask someone else",
    "meh",
]


def answer(rng: random.Random, t: str, d: str) -> str:
    """A polite answer (one of ``GOOD``) saying topic ``t`` is ``d``."""
    return rng.choice(GOOD).format(t=t, T=t[0].upper() + t[1:], d=d)


def question(rng: random.Random) -> tuple[str, str, str]:
    """A topic, a prompt asking about it and the polite answer defining it (three draws of ``rng``, in order)."""
    t = rng.choice(list(TOPICS))
    prompt = rng.choice(ASK).format(t=t)
    return t, prompt, answer(rng, t, TOPICS[t])


def write(rows: list[dict], name: str) -> None:
    """Writes ``rows`` as JSON lines to ``name`` beside this file."""
    out = Path(__file__).with_name(name)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {out}")


def make(n: int = 480, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        t, prompt, chosen = question(rng)
        d = TOPICS[t]
        kind = rng.random()
        if kind < 0.15:
            rejected = rng.choice(BAD)
        else:
            words = d.split()
            while words == d.split():
                rng.shuffle(words)
            rejected = answer(rng, t, " ".join(words))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


if __name__ == "__main__":
    write(make(), "quickstart_preferences.jsonl")
