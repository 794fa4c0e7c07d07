"""Where an online step's time goes: ``train/timing_s/*`` and ``train/perf/tokens_per_s`` (``modules/timing.py``)."""

from __future__ import annotations

import itertools

import pytest
from conftest import TINY_LLAMA, quiet_trainer
from online_fixtures import TOY_REWARD

from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.modules import timing
from aitraining_pl.modules.critic_free import GRPOModule
from aitraining_pl.modules.timing import Stopwatch


def test_stopwatch_adds_up_sections_and_derives_the_step_figures(monkeypatch):
    clock = itertools.count(0.0, 0.5)  # each perf_counter call is half a second after the previous one
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    watch = Stopwatch()
    with watch("rollout"):  # 0.0 .. 1.5: gen (0.5 .. 1.0) inside
        with watch("gen"):
            pass
    with watch("experience"):  # 2.0 .. 3.5: ref 2.5 .. 3.0
        with watch("ref"):
            pass
    with watch("update_actor"):  # 4.0 .. 4.5, then again 5.0 .. 5.5
        pass
    with watch("update_actor"):
        pass
    figures = watch.online_step(tokens=40)
    assert figures == {
        "timing_s/gen": 0.5,
        "timing_s/reward": 1.0,
        "timing_s/ref": 0.5,
        "timing_s/old_log_prob": 1.0,
        "timing_s/update_actor": 1.0,
        "timing_s/step": 4.0,
        "perf/tokens_per_s": 10.0,
    }
    watch.reset()
    assert watch.online_step(tokens=40)["timing_s/step"] == 0.0


def test_a_grpo_step_logs_its_timings(tmp_path, byte_tokenizer):
    module = GRPOModule(
        reward=TOY_REWARD,
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        num_generations=2,
        kl_coef=0.04,
        mini_batch_size=4,
        generation={"max_new_tokens": 4},
    )
    data = PromptDataModule(prompts=["hello", "a longer prompt"], tokenizer=byte_tokenizer, batch_size=2)
    quiet_trainer(tmp_path, limit_train_batches=1).fit(module, data)
    logged = {k: float(v) for k, v in module.trainer.callback_metrics.items()}
    parts = ("gen", "reward", "ref", "old_log_prob", "update_actor")
    for part in ("gen", "ref", "update_actor", "step"):
        assert logged[f"train/timing_s/{part}"] > 0, part
    step = logged["train/timing_s/step"]
    # the step is its parts (sampling and scoring, the no-gradient passes, the update)
    assert sum(logged[f"train/timing_s/{p}"] for p in parts) == pytest.approx(step, rel=1e-5)
    # the real tokens of the 4 rows: each prompt twice and 1 to 4 response tokens per row
    tokens = logged["train/perf/tokens_per_s"] * step
    prompt_tokens = 2 * sum(len(byte_tokenizer(p).input_ids) for p in ("hello", "a longer prompt"))
    assert tokens == pytest.approx(round(tokens), abs=1e-3) and prompt_tokens + 4 <= round(tokens) <= prompt_tokens + 16
