"""``benchmarks/vlm_vs_trl.py`` (issue 39): the dry run times this project's VL GRPO and DPO on the tiny Qwen2-VL in
a few seconds without TRL; the chat template TRL's side renders gives the prompt tokens this project's side makes;
the ratio lines and the table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import vlm_vs_trl  # noqa: E402

from aitraining_pl.datamodules.prompt import PromptDataModule  # noqa: E402
from aitraining_pl.models.vision import load_processor  # noqa: E402


def test_dry_run_times_our_vl_grpo_and_dpo_without_trl(monkeypatch, capsys):
    monkeypatch.delenv("TRL_PYTHON", raising=False)
    monkeypatch.setattr(sys, "argv", ["vlm_vs_trl.py", "--dry-run"])
    lines = vlm_vs_trl.main(["--dry-run"])
    assert [(r["side"], r["task"]) for r in lines] == [("ours", "grpo"), ("ours", "dpo")]
    grpo, dpo = lines
    assert grpo["completions_per_s"] > 0 and grpo["completions_per_cpu_s"] > 0 and grpo["completion_tokens"] >= 1
    assert dpo["pairs_per_s"] > 0 and dpo["pairs_per_cpu_s"] > 0
    for r in lines:
        assert r["peak_rss_mb"] >= r["import_rss_mb"] > 0 and r["steps"] == 2
        assert 0 < r["trainable_params"] < r["params"]  # the vision tower is frozen
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert out[0]["header"] is True and "vlm_vs_trl.py --dry-run" in out[0]["command"]
    assert out[1:] == lines


def test_the_chat_template_gives_trl_the_prompt_and_completion_tokens_we_train_on(tmp_path):
    """TRL's side renders ``[{"type": "image"}, {"type": "text", "text": "colour?"}]`` with ``CHAT_TEMPLATE``; ours
    reads the plain prompt ``colour?`` with one image (the placeholder in front). Same ids, and an assistant turn ends
    with the end token as our completions do."""
    processor = load_processor(vlm_vs_trl.PRESET)
    tokenizer = processor.tokenizer
    data = vlm_vs_trl.save_data(str(tmp_path), 3)
    rows = vlm_vs_trl.read_rows(data["prompts"])
    module = PromptDataModule(
        prompts=["colour?"], metadata=[{"images": [rows[0]["image"]]}], tokenizer=tokenizer, batch_size=1
    )
    module.setup("fit")
    ours = module.train_dataset[0]["input_ids"]
    ours = ours.tolist() if hasattr(ours, "tolist") else list(ours)
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}
    rendered = tokenizer.apply_chat_template([user], chat_template=vlm_vs_trl.CHAT_TEMPLATE, tokenize=False)
    image = Image.open(rows[0]["image"]).convert("RGB")
    with_image = processor(text=[rendered], images=[image])["input_ids"][0]
    assert list(with_image) == ours
    turn = [user, {"role": "assistant", "content": "red"}]
    full = tokenizer.apply_chat_template(turn, chat_template=vlm_vs_trl.CHAT_TEMPLATE, tokenize=False)
    assert full == rendered + "red" + tokenizer.eos_token


def test_ratios_are_of_the_medians_and_per_round_and_the_table_shows_them():
    def run(rate, rss, cpu):
        return {"size": "tiny", "threads": 1, "pairs_per_s": rate, "pairs_per_cpu_s": cpu, "peak_rss_mb": rss,
                "run_rss_mb": rss - 400}  # fmt: skip

    ours = [run(30.0, 500, 40.0), run(10.0, 520, 20.0), run(20.0, 510, 30.0)]
    trl = [run(10.0, 600, 20.0), run(10.0, 610, 20.0), run(20.0, 590, 20.0)]
    r = vlm_vs_trl.ratio("dpo", ours, trl)
    assert r["speedup"] == 2.0 and r["speedup_per_round"] == [3.0, 1.0, 1.0] and r["speedup_cpu"] == 1.5
    assert r["speedup_cpu_per_round"] == [2.0, 1.0, 1.5]
    assert r["memory_ratio"] == pytest.approx(510 / 600, abs=1e-3) and r["trl_run_rss_mb"] == 200
    table = vlm_vs_trl.table([r])
    row = (
        "| dpo (pairs_per_s) | tiny | 20.0 | 10.0 | 2.00x | 1.50x (2.00 / 1.00 / 1.50) | 510 / 600 | 0.85 | 110 / 200 |"
    )
    assert row in table
