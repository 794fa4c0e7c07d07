"""DistillationModule (issue 33): the student reaches a fixed teacher on the one-token bandit (full-distribution mode
at beta 0, 0.5, 1; sampled-token mode), a different tokenizer is one error before training, the teacher is never
checkpointed, lmbda < 1 trains on the data's completions, and at a 32k vocabulary the step keeps no (rows, length,
vocabulary) tensor."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from bandit import POLICY, word_tokenizer
from conftest import TINY_LLAMA, quiet_trainer, saved_for_backward

from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.errors import ConfigError
from aitraining_pl.models import load_tokenizer
from aitraining_pl.modules.distill import DistillationModule
from aitraining_pl.rollout import GenerationConfig

#: the teacher of the bandit: the same Llama with larger initial weights, so its next-token distribution is far from
#: the random student's near-uniform one (about 0.51 on one word, 0.002 on another)
TEACHER = {**POLICY, "initializer_range": 0.25}


def next_token(model, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(model(input_ids=prompt).logits[0, -1].double(), -1)


def bandit(tmp_path, steps: int, **options) -> tuple[torch.Tensor, torch.Tensor, DistillationModule]:
    """Distil ``TEACHER`` into a random student on the prompt "a" with one-token responses; returns the student's and
    the teacher's next-token distributions after ``steps`` iterations of 8 prompts."""
    pl.seed_everything(0)
    folder = word_tokenizer(tmp_path / "tokenizer")
    module = DistillationModule(
        model_config=POLICY,
        teacher_model_config=TEACHER,
        tokenizer_name=folder,
        generation=GenerationConfig(max_new_tokens=1, temperature=1.0, top_p=1.0),
        **options,
    )
    tokenizer = load_tokenizer(folder)
    prompt = tokenizer("a", return_tensors="pt", add_special_tokens=False)["input_ids"]
    dm = PromptDataModule(prompts=["a"] * (8 * steps), tokenizer=tokenizer, batch_size=8)
    quiet_trainer(tmp_path, max_epochs=1).fit(module, dm)
    return next_token(module.policy, prompt), next_token(module.teacher.model, prompt), module


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p - q).abs().sum() / 2)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bandit_full_distribution_reaches_teacher(tmp_path, beta):
    student, teacher, module = bandit(tmp_path, 50, mode="full", beta=beta, learning_rate=0.02, mini_batch_size=8)
    tv = total_variation(student, teacher)
    print(f"full beta={beta}: TV {tv:.4f}")
    assert tv < 0.02
    assert set(module.state_dict()) == {f"model.{k}" for k in module.policy.state_dict()}  # the student only


def test_bandit_sampled_token_reaches_teacher(tmp_path):
    """Reward r_t = log p_teacher(y_t) - log p_student(y_t), the online policy loss (RLOO over 8 samples)."""
    student, teacher, _ = bandit(
        tmp_path, 30, mode="sampled", num_generations=8, advantage="rloo", learning_rate=0.03, mini_batch_size=64
    )
    tv = total_variation(student, teacher)
    print(f"sampled: TV {tv:.4f}")
    assert tv < 0.05


def test_different_tokenizer_is_one_error(tmp_path):
    with pytest.raises(ConfigError, match="teacher's tokenizer differs"):
        DistillationModule(
            model_config=TINY_LLAMA, teacher_model_config={**TINY_LLAMA, "vocab_size": 200}, tokenizer_name="byte"
        )
    with pytest.raises(ConfigError, match="lmbda"):
        DistillationModule(model_config=TINY_LLAMA, teacher_model_config=TINY_LLAMA, tokenizer_name="byte",
                           mode="sampled", lmbda=0.5)  # fmt: skip


def test_lmbda_zero_trains_on_the_data_completions(tmp_path):
    module = DistillationModule(
        model_config=TINY_LLAMA, teacher_model_config=TINY_LLAMA, tokenizer_name="byte", lmbda=0.0,
        generation=GenerationConfig(max_new_tokens=6),
    )  # fmt: skip
    tokenizer = module.tokenizer
    encoded = tokenizer(["hi", "yo"], return_tensors="pt", padding=True, add_special_tokens=False)
    batch = {**encoded, "prompts": ["hi", "yo"], "metadata": [{"completion": "abc"}, {"completion": "abcdefgh"}]}
    module.train()
    rollout = module.rollout(batch, 2)
    assert rollout.texts == ["abc", "abc", "abcdefgh", "abcdefgh"]
    assert rollout.mask.sum(1).tolist() == [4, 4, 6, 6]  # "abc" + EOS; the other cut at max_new_tokens
    assert rollout.ended.tolist() == [True, True, False, False]
    with pytest.raises(ConfigError, match="completion"):
        module.rollout({**batch, "metadata": [{}, {}]}, 1)


def test_step_keeps_no_vocabulary_sized_tensor():
    """At a 32k vocabulary, the full-distribution step saves nothing of (rows, length, vocabulary) size for backward;
    the largest saved tensor (the peak of what the step keeps) is the head's gradient, (V, H)."""
    config = {**TINY_LLAMA, "vocab_size": 32_000}
    module = DistillationModule(model_config=config, teacher_model_config=config, tokenizer_name="byte", beta=0.5)
    rows, prompt, length = 4, 6, 24
    ids = torch.randint(3, 32_000, (rows, prompt + length))
    attention, mask = torch.ones_like(ids), torch.ones(rows, length, dtype=torch.long)
    teacher = module.teacher.hidden(ids, attention, prompt, mask)
    shapes = saved_for_backward(module, lambda: module.divergence(ids, attention, prompt, mask, teacher).loss)
    largest = max(shapes, key=lambda s: torch.Size(s).numel())
    print(f"largest saved tensor: {largest} ({torch.Size(largest).numel() * 4 / 2**20:.1f} MiB in float32)")
    assert not [s for s in shapes if torch.Size(s).numel() >= rows * length * 32_000], shapes
    assert torch.Size(largest).numel() <= 32_000 * config["hidden_size"]


@pytest.fixture(scope="module")
def sft_teacher(tmp_path_factory):
    """The SFT quickstart's model after 3 epochs (about 8 s): the quickstart's teacher."""
    from pathlib import Path

    from aitraining_pl.cli import build_cli

    root, folder = Path(__file__).resolve().parents[2], tmp_path_factory.mktemp("sft")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        build_cli(
            ["fit", "--config", str(root / "configs/quickstart/sft.yaml"), "--data.init_args.data_path",
             str(root / "aitraining_pl/data/quickstart_sft.jsonl"), "--trainer.max_epochs", "3",
             "--trainer.enable_progress_bar", "false"]
        )  # fmt: skip
    return folder / "runs/quickstart-sft/export/last"


@pytest.mark.slow
def test_quickstart_student_approaches_the_sft_teacher(sft_teacher, tmp_path, monkeypatch):
    """configs/quickstart/distill.yaml (one epoch) on the SFT quickstart's model: the random student's held-out
    divergence and per-token KLs to the teacher fall, and its held-out task reward rises toward the teacher's."""
    from pathlib import Path

    from aitraining_pl.cli import build_cli

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    args = [
        "--config", str(root / "configs/quickstart/distill.yaml"), "--model.init_args.teacher_model_name",
        str(sft_teacher), "--data.init_args.data_path", str(root / "aitraining_pl/data/quickstart_sft.jsonl"),
        "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip

    def metrics(cli) -> dict[str, float]:
        return {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/")}

    before = metrics(build_cli(["validate", *args]))
    as_teacher = ["--model.init_args.model_name", str(sft_teacher), "--model.init_args.model_config", "null"]
    teacher = metrics(build_cli(["validate", *args, *as_teacher]))
    cli = build_cli(["fit", *args])
    after = metrics(cli)
    print(f"before {before}\nafter {after}\nteacher {teacher}")
    assert after["val/loss"] < 0.8 * before["val/loss"]
    assert after["val/forward_kl"] < before["val/forward_kl"] and after["val/reverse_kl"] < before["val/reverse_kl"]
    assert after["val/teacher_logprob"] > before["val/teacher_logprob"]
    assert teacher["val/loss"] < 1e-4  # the teacher against itself
    assert before["val/reward_mean"] < after["val/reward_mean"] <= teacher["val/reward_mean"] + 0.05
    assert (tmp_path / "runs/quickstart-distill/export/last/model.safetensors").is_file()


def test_any_online_module_distils_with_use_teacher(tmp_path):
    """Sampled-token distillation is the k1 KL in the reward with the teacher as the reference: RLOOModule with
    ``use_teacher`` (no task reward) reaches the bandit's teacher as DistillationModule's sampled mode does."""
    from bandit import word_tokenizer as tokenizer_folder

    from aitraining_pl.models.loading import load_causal_lm
    from aitraining_pl.modules.critic_free import RLOOModule
    from aitraining_pl.modules.distill import no_task_reward, use_teacher

    pl.seed_everything(0)
    folder = tokenizer_folder(tmp_path / "tokenizer")
    module = RLOOModule(
        model_config=POLICY, tokenizer_name=folder, reward=no_task_reward, kl_coef=1.0, kl_in_reward=True,
        generation=GenerationConfig(max_new_tokens=1, temperature=1.0, top_p=1.0), num_generations=8,
        learning_rate=0.03, mini_batch_size=64,
    )  # fmt: skip
    teacher = use_teacher(module, load_causal_lm(model_config=TEACHER, seed=1)).model
    tokenizer = load_tokenizer(folder)
    prompt = tokenizer("a", return_tensors="pt", add_special_tokens=False)["input_ids"]
    quiet_trainer(tmp_path).fit(module, PromptDataModule(prompts=["a"] * 240, tokenizer=tokenizer, batch_size=8))
    tv = total_variation(next_token(module.policy, prompt), next_token(teacher, prompt))
    print(f"RLOOModule + use_teacher: TV {tv:.4f}")
    assert tv < 0.05


@pytest.mark.parametrize("mode", ["full", "sampled"])
def test_trains_on_multi_turn_episodes(tmp_path, mode):
    """The guessing game's two-turn episodes: only the student's tokens (not the environment's, the holes of the
    response mask) carry the teacher's signal, and the student's weights move."""
    from episode_fixtures import fit_on_the_game

    from aitraining_pl.environments.multiturn import GuessingGame

    torch.manual_seed(0)
    module = DistillationModule(
        model_config=TINY_LLAMA, teacher_model_config=TINY_LLAMA, tokenizer_name="byte", mode=mode,
        reward=GuessingGame(max_turns=2), generation=GenerationConfig(max_new_tokens=2, temperature=1.0),
        num_generations=2, mini_batch_size=8, learning_rate=0.01,
    )  # fmt: skip
    seen, make_experience = {}, module.make_experience

    def spy(rollout):
        experience, stats = make_experience(rollout)
        seen.update(rollout=rollout, experience=experience, stats=stats)
        return experience, stats

    module.make_experience = spy
    before = [p.detach().clone() for p in module.policy.parameters()]
    fit_on_the_game(module, tmp_path, epochs=1, prompts=8, batch_size=4)
    rollout, experience = seen["rollout"], seen["experience"]
    holes = (rollout.attention_mask[:, rollout.prompt_length :] == 1) & (rollout.mask == 0)
    assert holes.any()
    if mode == "full":
        assert (experience.teacher_hidden[holes] == 0).all() and (
            experience.teacher_hidden[rollout.mask.bool()] != 0
        ).any()
    else:
        assert (experience.advantages[holes] == 0).all() and torch.isfinite(seen["stats"]["reverse_kl"])
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))


def test_checkpoint_round_trip_rebuilds_the_teacher(tmp_path):
    """A checkpoint holds the student only; ``load_from_checkpoint`` rebuilds the module from its hyperparameters,
    the teacher from its own source."""
    module = DistillationModule(model_config=TINY_LLAMA, teacher_model_config=TINY_LLAMA, tokenizer_name="byte")
    trainer = quiet_trainer(tmp_path, max_steps=0)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]
    assert set(state) == {f"model.{k}" for k in module.policy.state_dict()}
    loaded = DistillationModule.load_from_checkpoint(tmp_path / "last.ckpt", weights_only=True)
    assert loaded.hparams.teacher_model_config == TINY_LLAMA and loaded.hparams.beta == 1.0
    for a, b in zip(loaded.teacher.model.parameters(), module.teacher.model.parameters()):
        assert torch.equal(a, b)
