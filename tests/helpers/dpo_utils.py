"""Helpers for the DPO / CLI tests: small preference files and CLI argument lists on a tiny Llama."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

from conftest import TINY_LLAMA

MODEL = "aitraining_pl.modules.dpo.DPOModule"
DATA = "aitraining_pl.datamodules.preference.PreferenceDataModule"
GOOD = ["Sure! {t} is a fine thing.", "Happy to help: {t} is useful.", "Of course. {t} is well known."]
BAD = ["idk lol", "meh", "no idea", "ask someone else"]
TOPICS = ["gravity", "an atom", "a volcano", "the moon", "a battery", "friction", "a glacier", "a neuron"]


def preference_rows(n: int, seed: int = 0) -> list[dict]:
    """Pairs whose chosen answer is polite and on topic and whose rejected one is dismissive."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        t = rng.choice(TOPICS)
        rows.append(
            {"prompt": f"Q{i}: what is {t}?", "chosen": rng.choice(GOOD).format(t=t), "rejected": rng.choice(BAD)}
        )
    return rows


def preference_data(rows: list[dict], tokenizer, **kwargs):
    """A ``PreferenceDataModule`` over in-memory ``rows`` (``preference_rows``); ``kwargs`` go to it."""
    from aitraining_pl.datamodules.preference import PreferenceDataModule

    columns = {k: [r[k] for r in rows] for k in ("prompt", "chosen", "rejected")}
    return PreferenceDataModule(
        prompts=columns["prompt"], chosen=columns["chosen"], rejected=columns["rejected"], tokenizer=tokenizer, **kwargs
    )


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_config(
    tmp_path: Path,
    *,
    n_pairs: int = 48,
    model: dict | None = None,
    data: dict | None = None,
    trainer: dict | None = None,
    model_class: str = MODEL,
    data_class: str = DATA,
    rows: list[dict] | None = None,
) -> Path:
    """A CLI config (JSON is valid YAML) for a tiny DPO run writing CSV metrics under ``tmp_path`` (another
    module / data module with ``model_class`` / ``data_class``; other rows than ``preference_rows`` with ``rows``)."""
    data_path = write_jsonl(tmp_path / "prefs.jsonl", rows if rows is not None else preference_rows(n_pairs))
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 2,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "enable_checkpointing": False,
            "num_sanity_val_steps": 0,
            "default_root_dir": str(tmp_path),
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path), "name": "csv", "version": "v"},
            },
            **(trainer or {}),
        },
        "model": {
            "class_path": model_class,
            "init_args": {
                "model_config": dict(TINY_LLAMA),
                "tokenizer_name": "byte",
                "learning_rate": 1e-3,
                "warmup_ratio": 0.0,
                **(model or {}),
            },
        },
        "data": {
            "class_path": data_class,
            "init_args": {
                "data_path": str(data_path),
                "val_split": 0.25,
                "batch_size": 4,
                "max_length": 96,
                "max_prompt_length": 48,
                **(data or {}),
            },
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def read_metrics(tmp_path: Path) -> list[dict]:
    """Rows of the CSV logger's metrics file (empty strings dropped)."""
    with open(tmp_path / "csv" / "v" / "metrics.csv", encoding="utf-8") as handle:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(handle)]


def series(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]
