"""Each family learns on a real pretrained chat model (SmolLM2-135M-Instruct, tests marked ``real``): the task is
``quickstart_arithmetic.jsonl``, sums and differences asked for as just the number, which the model answers by habit
as a worked sum (``"14 + 7 = 21"``). Short rows through the model's own chat template, LoRA, a few CPU steps; the
held-out metric is measured before and after training. Figures measured on the 2-core machine are in
docs/real_models.md."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import quiet_trainer
from real_model import arithmetic_rows, assistant_turn, brevity_reward, user_turn

from aitraining_pl.datamodules.preference import PreferenceDataModule
from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.datamodules.sft import SFTDataModule
from aitraining_pl.models.lora import LoRAConfig
from aitraining_pl.rewards import exact_answer_reward
from aitraining_pl.rollout import GenerationConfig

pytestmark = [pytest.mark.real, pytest.mark.slow]

LORA = LoRAConfig(r=8, alpha=16, dropout=0.0)


def _pairs(rows: list[dict]) -> dict[str, list]:
    """Preference columns of ``rows``: a user turn, the bare answer chosen, the habit's worked sum rejected."""
    return {
        "prompts": [user_turn(r) for r in rows],
        "chosen": [assistant_turn(r["chosen"]) for r in rows],
        "rejected": [assistant_turn(r["rejected"]) for r in rows],
    }


def _fit_and_compare(tmp_path, module, data, metric: str, steps: int) -> tuple[float, float]:
    """``metric`` on the held-out rows before and after ``steps`` optimizer steps."""
    trainer = quiet_trainer(tmp_path, max_steps=steps, num_sanity_val_steps=0, limit_val_batches=1.0)
    before = trainer.validate(module, datamodule=data, verbose=False)[0][metric]
    trainer.fit(module, datamodule=data)
    after = trainer.validate(module, datamodule=data, verbose=False)[0][metric]
    print(f"{type(module).__name__} {metric}: {before:.3f} -> {after:.3f} after {steps} steps")
    return before, after


def test_sft_lowers_the_held_out_loss_of_the_real_model(tmp_path, smollm2):
    from aitraining_pl.modules.sft import SFTModule

    pl.seed_everything(0)
    train, held_out = arithmetic_rows(24, 8)
    rows = [{"messages": user_turn(r) + assistant_turn(r["completion"])} for r in train + held_out]
    module = SFTModule(model_name=smollm2, lora=LORA, learning_rate=2e-3, warmup_ratio=0.0, lr_schedule="constant")
    data = SFTDataModule(rows=rows, tokenizer=module.tokenizer, val_split=len(held_out) / len(rows), batch_size=8)
    before, after = _fit_and_compare(tmp_path, module, data, "val/loss", steps=3)
    assert after < 0.5 * before


def test_dpo_raises_the_held_out_preference_accuracy_of_the_real_model(tmp_path, smollm2):
    from aitraining_pl.modules.dpo import DPOModule

    pl.seed_everything(0)
    train, held_out = arithmetic_rows(24, 8)
    module = DPOModule(model_name=smollm2, lora=LORA, beta=0.1, learning_rate=2e-3, warmup_ratio=0.0)
    data = PreferenceDataModule(**_pairs(train + held_out), tokenizer=module.tokenizer, val_split=0.25, batch_size=8)
    before, after = _fit_and_compare(tmp_path, module, data, "val/rewards/accuracies", steps=3)
    assert before == pytest.approx(0.5)  # policy == reference: every implicit reward is 0
    assert after >= 0.9


def test_reward_model_raises_its_held_out_accuracy_on_the_real_trunk(tmp_path, smollm2):
    """The reward model learns to prefer the worked sum over the bare number (the pairs of the file reversed,
    those with a wrong number left out): a freshly initialised head prefers the shorter bare number on every
    held-out pair (measured: accuracy 1.0 on the file's order), so its accuracy on the reversed pairs starts low."""
    from aitraining_pl.modules.reward import RewardModule

    pl.seed_everything(0)
    train, held_out = ([r for r in rows if "=" in r["rejected"]] for rows in arithmetic_rows(32, 12))
    reverse = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in train + held_out]
    module = RewardModule(model_name=smollm2, lora=LORA, learning_rate=2e-3, warmup_ratio=0.0, disable_dropout=True)
    data = PreferenceDataModule(
        **_pairs(reverse), tokenizer=module.tokenizer, val_split=len(held_out) / len(reverse), batch_size=8
    )
    head = module.reward_model.head.weight.detach().clone()
    before, after = _fit_and_compare(tmp_path, module, data, "val/rewards/accuracies", steps=3)
    assert after >= 0.9 and after > before + 0.3
    assert not torch.equal(module.reward_model.head.weight, head)


def greedy_reward(
    module, rows: list[dict], max_new_tokens: int = 12, reward=exact_answer_reward
) -> tuple[float, list[str]]:
    """Mean ``reward`` of the module's greedy answers to ``rows`` (through the chat template)."""
    tokenizer = module.tokenizer
    texts = [tokenizer.apply_chat_template(user_turn(r), tokenize=False, add_generation_prompt=True) for r in rows]
    tokenizer.padding_side = "left"
    try:
        encoded = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = "right"
    greedy = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)
    rollout = module.generate(encoded["input_ids"], encoded["attention_mask"], greedy)
    scores = reward([r["prompt"] for r in rows], rollout.texts, rows)
    return sum(scores) / len(scores), rollout.texts


BREVITY = {"reward": "real_model:brevity_reward", "learning_rate": 2e-3, "kl_coef": 0.0, "lr_schedule": "constant",
           "generation": {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0}}  # fmt: skip


def brevity_fit(tmp_path, module, train: int, batch_size: int, steps: int) -> tuple[float, float]:
    """The greedy held-out ``brevity_reward`` (8 held-out prompts) before and after ``steps`` steps of ``module`` on
    the first ``train`` arithmetic prompts, ``batch_size`` a step (printed with two answers and the step's timing)."""
    train_rows, held_out = arithmetic_rows(train, 8)
    data = PromptDataModule(
        prompts=[r["prompt"] for r in train_rows],
        metadata=[{"answer": r["answer"]} for r in train_rows],
        tokenizer=module.tokenizer,
        use_chat_template=True,
        batch_size=batch_size,
    )
    before, answers_before = greedy_reward(module, held_out, reward=brevity_reward)
    quiet_trainer(tmp_path, max_steps=steps, limit_val_batches=0).fit(module, datamodule=data)
    after, answers_after = greedy_reward(module, held_out, reward=brevity_reward)
    logged = {k: round(float(v), 3) for k, v in module.trainer.callback_metrics.items() if "timing_s" in k}
    name = type(module).__name__
    print(f"{name} greedy held-out reward {before:.3f} -> {after:.3f}; {answers_before[:2]} -> {answers_after[:2]}")
    print(f"{name} last step: {logged}")
    return before, after


def test_grpo_raises_the_held_out_reward_of_the_real_model(tmp_path, smollm2):
    """Shorter answers (``real_model.brevity_reward``: the model's habit is a worked sum, often wrong, so the
    arithmetic task's reward is 0 in every sample of a group and GRPO has nothing to learn from): the greedy held-out
    reward rises within a few steps of 2 prompts x 4 samples."""
    from aitraining_pl.modules.critic_free import GRPOModule

    pl.seed_everything(0)
    module = GRPOModule(model_name=smollm2, lora=LORA, num_generations=4, mini_batch_size=8, **BREVITY)
    before, after = brevity_fit(tmp_path, module, train=8, batch_size=2, steps=4)
    assert after > before + 0.1


def test_ppo_raises_the_held_out_reward_of_the_real_model(tmp_path, smollm2):
    """PPO with a value head on the real model, on GRPO's task (``real_model.brevity_reward``): one sample per
    prompt, advantages from GAE on the value head; the greedy held-out reward rises within 8 steps of 8 prompts and
    the value head trains."""
    from aitraining_pl.modules.ppo import PPOModule

    pl.seed_everything(0)
    module = PPOModule(model_name=smollm2, lora=LORA, mini_batch_size=8, num_iterations=2, **BREVITY)
    head = [p.detach().clone() for p in module.model.value_head.parameters()]
    before, after = brevity_fit(tmp_path, module, train=64, batch_size=8, steps=8)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(head, module.model.value_head.parameters()))
    assert after > before + 0.1


def test_the_real_model_quickstart_runs_through_the_cli(tmp_path, smollm2):
    """configs/quickstart/grpo_smollm2.yaml as the README runs it (the model's folder on the command line), one
    iteration of 2 prompts: the greedy held-out reward is measured before and after (GreedyEvalCallback, logged as
    ``val/greedy_reward``), the step logs its reward, the model is exported. Its learning is measured by running the
    command itself (docs/real_models.md); the GRPO test above shows GRPO learning on the real model."""
    import csv
    from pathlib import Path

    from aitraining_pl.callbacks.greedy_eval import GreedyEvalCallback
    from aitraining_pl.cli import build_cli

    root = Path(__file__).resolve().parents[2]
    cli = build_cli(
        [
            "fit",
            "--config",
            str(root / "configs/quickstart/grpo_smollm2.yaml"),
            "--model.init_args.model_name",
            smollm2,
            "--data.init_args.data_path",
            str(root / "aitraining_pl/data/quickstart_capitals.jsonl"),
            "--data.init_args.batch_size",
            "2",
            "--model.init_args.mini_batch_size",
            "8",
            "--data.init_args.val_split",
            "0.05",
            "--trainer.max_steps",
            "1",
            "--trainer.enable_progress_bar",
            "false",
            "--output_dir",
            str(tmp_path),
        ]
    )
    (greedy,) = [c for c in cli.trainer.callbacks if isinstance(c, GreedyEvalCallback)]
    assert set(greedy.results) == {"before", "after"} and all(0 <= v <= 1 for v in greedy.results.values())
    assert len(greedy.answers["before"]) == len(cli.datamodule.val_dataset) >= 4
    print(f"quickstart, one step: {greedy.results}; {greedy.answers['before'][:2]} -> {greedy.answers['after'][:2]}")
    (metrics,) = list(tmp_path.glob("csv/version_*/metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    assert len([r for r in rows if r.get("val/greedy_reward")]) == 2
    assert len([r for r in rows if r.get("train/reward_mean")]) == 1
    assert (tmp_path / "export").is_dir()


def test_a_small_student_distils_the_real_model(tmp_path, smollm2):
    """On-policy GKD (``mode: full``, reverse KL over the full vocabulary) of SmolLM2-135M-Instruct into a small random
    student that shares its tokenizer and chat template (the ``tiny-llama`` preset with SmolLM2's 49152-token
    vocabulary and its special tokens): the student's per-token KLs to the teacher on its samples of held-out prompts
    fall within 6 steps of 8 prompts, and the teacher's log-prob of the student's tokens rises. (SmolLM2 is the only
    real model here, so the student is a random one: what this shows is the real teacher's path, its tokenizer, chat
    template and 49152-token head through the fused loss, not a skill.)"""
    from aitraining_pl.modules.distill import DistillationModule

    pl.seed_everything(0)
    student = {"preset": "tiny-llama", "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    module = DistillationModule(
        model_config=student, tokenizer_name=smollm2, teacher_model_name=smollm2, learning_rate=1e-2,
        lr_schedule="constant", warmup_ratio=0.0, mini_batch_size=8,
        generation={"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0},
    )  # fmt: skip
    train, held_out = arithmetic_rows(48, 8)
    rows = train + held_out
    data = PromptDataModule(
        prompts=[r["prompt"] for r in rows],
        tokenizer=module.tokenizer,
        use_chat_template=True,
        batch_size=8,
        val_split=len(held_out) / len(rows),
    )
    trainer = quiet_trainer(tmp_path, max_steps=6, num_sanity_val_steps=0, limit_val_batches=1.0)
    before = {k: float(v) for k, v in trainer.validate(module, datamodule=data, verbose=False)[0].items()}
    trainer.fit(module, datamodule=data)
    after = {k: float(v) for k, v in trainer.validate(module, datamodule=data, verbose=False)[0].items()}
    print(f"DistillationModule held-out before {before}\nafter {after}")
    assert after["val/reverse_kl"] < 0.9 * before["val/reverse_kl"]  # 4.59 -> 3.59 here (seed 0)
    assert after["val/forward_kl"] < 0.9 * before["val/forward_kl"]  # 5.11 -> 3.95
    assert after["val/teacher_logprob"] > before["val/teacher_logprob"]
