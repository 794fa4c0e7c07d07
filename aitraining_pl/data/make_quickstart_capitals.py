"""Regenerates ``quickstart_capitals.jsonl``: the real-model quickstart's task
(``configs/quickstart/grpo_smollm2.yaml``), capital cities asked for in one word.

Each row asks ``"What is the capital of France? Answer with one word."`` and carries the ``answer`` (for
``aitraining_pl.rewards:short_answer_reward``). SmolLM2-135M-Instruct knows many of these capitals but answers by
habit with a sentence (``"The capital of France is Paris."``, reward 1/6); GRPO teaches it to answer with the word.
Only capitals written as one word in plain ASCII are used, so the reward's exact word match is fair. The rows are
shuffled with ``random.Random(SEED)``; the recipe holds out the last ``val_split`` of them (``PromptDataModule``).
Run: ``python -m aitraining_pl.data.make_quickstart_capitals``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 0
PROMPT = "What is the capital of {}? Answer with one word."

#: (country, capital): capitals that are one ASCII word and not disputed.
CAPITALS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
    ("Egypt", "Cairo"), ("Russia", "Moscow"), ("China", "Beijing"), ("the United Kingdom", "London"),
    ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Hungary", "Budapest"),
    ("Poland", "Warsaw"), ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Belgium", "Brussels"), ("Switzerland", "Bern"), ("the Czech Republic", "Prague"),
    ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"), ("Croatia", "Zagreb"),
    ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Syria", "Damascus"), ("Lebanon", "Beirut"),
    ("Jordan", "Amman"), ("Saudi Arabia", "Riyadh"), ("Afghanistan", "Kabul"), ("Pakistan", "Islamabad"),
    ("Bangladesh", "Dhaka"), ("Nepal", "Kathmandu"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("the Philippines", "Manila"), ("Indonesia", "Jakarta"), ("South Korea", "Seoul"), ("North Korea", "Pyongyang"),
    ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Canada", "Ottawa"), ("Cuba", "Havana"),
    ("Jamaica", "Kingston"), ("Peru", "Lima"), ("Chile", "Santiago"), ("Venezuela", "Caracas"), ("Ecuador", "Quito"),
    ("Uruguay", "Montevideo"), ("Kenya", "Nairobi"), ("Nigeria", "Abuja"), ("Ghana", "Accra"), ("Morocco", "Rabat"),
    ("Algeria", "Algiers"), ("Tunisia", "Tunis"), ("Libya", "Tripoli"), ("Sudan", "Khartoum"), ("Uganda", "Kampala"),
    ("Zimbabwe", "Harare"), ("Zambia", "Lusaka"), ("Senegal", "Dakar"), ("Angola", "Luanda"),
    ("the Netherlands", "Amsterdam"), ("Scotland", "Edinburgh"), ("Wales", "Cardiff"), ("Estonia", "Tallinn"),
    ("Latvia", "Riga"), ("Lithuania", "Vilnius"), ("Belarus", "Minsk"), ("Georgia", "Tbilisi"), ("Armenia", "Yerevan"),
    ("Azerbaijan", "Baku"), ("Kazakhstan", "Astana"), ("Uzbekistan", "Tashkent"), ("Qatar", "Doha"), ("Oman", "Muscat"),
    ("Laos", "Vientiane"), ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"), ("Albania", "Tirana"),
    ("Cyprus", "Nicosia"), ("Malta", "Valletta"), ("Somalia", "Mogadishu"), ("Rwanda", "Kigali"), ("Mali", "Bamako"),
    ("Niger", "Niamey"), ("Madagascar", "Antananarivo"), ("Mozambique", "Maputo"), ("Namibia", "Windhoek"),
    ("Botswana", "Gaborone"), ("Honduras", "Tegucigalpa"), ("Nicaragua", "Managua"), ("Fiji", "Suva"),
]  # fmt: skip


def capital_rows(seed: int = SEED) -> list[dict]:
    """One row per country, ``{"prompt", "answer"}``, shuffled with ``random.Random(seed)``."""
    rows = [{"prompt": PROMPT.format(country), "answer": capital} for country, capital in CAPITALS]
    random.Random(seed).shuffle(rows)
    return rows


def main() -> None:
    path = Path(__file__).with_name("quickstart_capitals.jsonl")
    rows = capital_rows()
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
