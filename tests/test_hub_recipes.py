"""The hub recipes (``configs/*.yaml``) bend to a local model folder and a local data file (issue 49, fixes 6 and Build
item 5): each runs with only ``model_name`` (a teacher's too) and ``data_path`` overridden, on a tiny saved Llama and
a local file in the layout of the recipe's dataset. To keep CI fast the test itself adds trainer limits that a user
would not pass (``max_steps``, ``limit_val_batches``, 32-bit CPU precision) and turns W&B offline
(``WANDB_MODE=offline``); ``val_check_interval``, the data splits and the columns are the recipe's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from conftest import TINY_LLAMA
from dpo_utils import write_jsonl

from aitraining_pl.cli import build_cli
from aitraining_pl.models import build_causal_lm

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "aitraining_pl" / "data"
#: the modules that have a quickstart -> their hub recipe
RECIPES = ["sft", "dpo", "orpo", "kto", "reward", "ppo", "grpo", "rloo", "distill"]
#: test-only limits, not user overrides
LIMITS = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.precision", "32-true"]


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def local_data(recipe: str, folder: Path) -> Path:
    """A local file in the layout of the recipe's hub dataset."""
    if recipe == "sft":  # trl-lib/Capybara: conversations
        turns = [(r["prompt"], r["completion"]) for r in _rows("quickstart_sft.jsonl")]
        rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in turns]
    elif recipe == "kto":  # trl-lib/kto-mix-14k: prompt and completion conversations, label
        rows = [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "completion": [{"role": "assistant", "content": r["completion"]}],
                "label": r["label"],
            }
            for r in _rows("quickstart_kto.jsonl")
        ]
    elif recipe in ("dpo", "orpo", "reward"):  # trl-lib/ultrafeedback_binarized: chosen / rejected conversations
        rows = [
            {
                "chosen": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["rejected"]}],
            }
            for r in _rows("quickstart_preferences.jsonl")
        ]
    elif recipe == "ppo":  # data/prompts.jsonl: prompts
        rows = [{"prompt": r["prompt"]} for r in _rows("quickstart_prompts.jsonl")]
    else:  # openai/gsm8k (main): question, answer ending in "#### <number>"
        rows = [{"question": r["prompt"], "answer": f"It is {r['answer']}.\n#### {r['answer']}"}
                for r in _rows("math_prompts.jsonl")]  # fmt: skip
    return write_jsonl(folder / f"{recipe}.jsonl", rows[:48])


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("local-model")
    build_causal_lm(TINY_LLAMA).save_pretrained(str(folder))
    tokenizer = transformers.ByT5Tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.save_pretrained(str(folder))
    return folder


def reward_folder(model_folder: Path) -> Path:
    """A reward model exported as ``configs/reward.yaml`` exports one, on the tiny model (made once)."""
    from aitraining_pl.modules.reward import RewardModule

    folder = model_folder.parent / "reward-export"
    if not folder.exists():
        RewardModule(model_name=str(model_folder)).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_hub_recipe_runs_on_a_local_folder_and_file(recipe, model_folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe's runs/ folder
    monkeypatch.setenv("WANDB_MODE", "offline")
    overrides = ["--model.init_args.model_name", str(model_folder)]
    overrides += ["--data.init_args.data_path", str(local_data(recipe, tmp_path))]
    if recipe == "distill":  # the teacher's folder
        overrides += ["--model.init_args.teacher_model_name", str(model_folder)]
    if recipe == "ppo":  # the reward model's folder (configs/reward.yaml's export)
        overrides += ["--model.init_args.reward", str(reward_folder(model_folder))]
    cli = build_cli(["fit", "--config", str(ROOT / "configs" / f"{recipe}.yaml"), *overrides, *LIMITS])
    assert cli.trainer.global_step >= 2  # an online batch may take several optimizer steps
    assert cli.datamodule.val_dataloader() is not None  # the recipe's held-out split, from the local file
