"""Every ``python`` snippet in the README and ``docs/`` runs, on a tiny model.

A snippet is executed as written except for three substitutions, so the docs can show real usage:
hub ids (``"Org/Name"``) become a tiny random Llama saved with a byte-level tokenizer and a chat template;
data file names and hub datasets become the package's shipped data; ``pl.Trainer(`` runs 2 steps without loggers or
checkpoints. ``docs/from_the_seed.md`` shows the seed's own code beside ours; its examples are tests in
``tests/compat/test_seed_examples.py``, so it is not run here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import TINY_LLAMA

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "aitraining_pl" / "data"
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "from_the_seed.md")]
#: file names used in the docs -> the shipped file standing in for them
DATA_FILES = {
    "pairs.jsonl": DATA / "quickstart_preferences.jsonl",
    "math.jsonl": DATA / "math_prompts.jsonl",
    "prompts.jsonl": DATA / "quickstart_prompts.jsonl",
    "sft.jsonl": DATA / "quickstart_sft.jsonl",
    # hub datasets named in the docs
    "trl-lib/Capybara": DATA / "quickstart_sft.jsonl",
    "trl-lib/ultrafeedback_binarized": DATA / "quickstart_preferences.jsonl",
    "openai/gsm8k": DATA / "math_prompts.jsonl",
}
HUB_ID = re.compile(r"""(["'])(?!\.)[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+\1""")
FAST_TRAINER = (
    "pl.Trainer(max_steps=2, limit_val_batches=1, num_sanity_val_steps=0, logger=False, "
    "enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, "
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def snippets() -> list:
    found = []
    for page in PAGES:
        for i, match in enumerate(re.finditer(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)):
            found.append(pytest.param(match.group(1), id=f"{page.relative_to(ROOT)}#{i}"))
    return found


@pytest.fixture(scope="module")
def tiny_hub_model(tmp_path_factory) -> Path:
    """A folder standing in for every hub id of the docs: tiny random Llama, byte tokenizer, chat template."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from aitraining_pl.models import load_tokenizer

    path = tmp_path_factory.mktemp("hub") / "tiny"
    torch.manual_seed(0)
    config = dict(TINY_LLAMA)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.save_pretrained(path)
    tokenizer = load_tokenizer("byte")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def substitute(code: str, model_path: Path) -> str:
    code = re.sub(r",\s*enable_checkpointing=False", "", code)  # FAST_TRAINER sets it
    for name, path in DATA_FILES.items():
        code = code.replace(f'"{name}"', repr(str(path)))
    code = HUB_ID.sub(lambda m: repr(str(model_path)), code)
    return code.replace("pl.Trainer(", FAST_TRAINER)


@pytest.mark.parametrize("code", snippets())
def test_doc_trainers_choose_their_checkpointing(code):
    """A snippet's ``pl.Trainer`` says what it checkpoints: Lightning's default writes the whole model (a LoRA base
    and all) to ./lightning_logs on every run; the snippets export with ``HFExportCallback`` instead."""
    for call in re.finditer(r"pl\.Trainer\((.*?)\)\s*(\.|\n)", code, re.S):
        assert "enable_checkpointing" in call.group(1) or "ModelCheckpoint" in call.group(1), call.group(0)


@pytest.mark.slow
@pytest.mark.parametrize("code", snippets())
def test_doc_snippet_runs(code, tiny_hub_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets write their outputs ("out", "reward_model", ...) here
    exec(compile(substitute(code, tiny_hub_model), "<snippet>", "exec"), {"__name__": "__snippet__"})
