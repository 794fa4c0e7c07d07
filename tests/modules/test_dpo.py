"""DPOModule through the CLI on a tiny Llama: learning, loss types, precompute / LoRA paths, resume."""

from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer
from dpo_utils import preference_data, preference_rows, read_metrics, series, write_config

from aitraining_pl.cli import build_cli
from aitraining_pl.errors import HyperparameterError
from aitraining_pl.losses import sequence_logps
from aitraining_pl.models import LoRAConfig, build_causal_lm
from aitraining_pl.modules.dpo import DPOModule, can_pack, completion_logps, pack_batch, preference_accuracy

LORA = {"r": 4, "alpha": 8, "dropout": 0.0}


def fit(config, *extra):
    return build_cli(["fit", "--config", str(config), *extra])


LAYOUTS = {"padded": {}, "padding-free": {"padding_free": True}, "shared-prompt": {"share_prompt": True}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("lora", [None, LoRAConfig(r=4, alpha=8, dropout=0.0)], ids=["full", "lora"])
def test_completion_logps_equal_full_logits(byte_tokenizer, lora, layout):
    rows = preference_rows(4)
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", lora=lora)
    dm = preference_data(
        rows,
        byte_tokenizer,
        val_split=0,
        batch_size=4,
    )
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert can_pack(batch, share_prompt=True)
    logits = module.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    slow = sequence_logps(logits, batch["input_ids"], batch["completion_mask"])
    fast = completion_logps(module.policy, batch, **LAYOUTS[layout])
    torch.testing.assert_close(fast.logps, slow.logps, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fast.lengths, slow.lengths)
    # gradients agree too, and the model's own attention implementation is restored afterwards
    fast.logps.sum().backward()
    grads = [p.grad.clone() for p in module.policy.parameters() if p.requires_grad]
    module.policy.zero_grad()
    sequence_logps(
        module.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
        batch["input_ids"],
        batch["completion_mask"],
    ).logps.sum().backward()
    for got, want in zip(grads, (p.grad for p in module.policy.parameters() if p.requires_grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert module.policy.config._attn_implementation == "sdpa"


# pair 0: prompt [5, 6], chosen [7, 1], rejected [8, 9, 1]; pair 1: prompt [4], chosen [3], rejected [2]
HAND_BATCH = {
    "input_ids": torch.tensor([[5, 6, 7, 1, 0], [4, 3, 0, 0, 0], [5, 6, 8, 9, 1], [4, 2, 0, 0, 0]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]),
    "completion_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]),
}


def test_pack_batch_layout_padding_free():
    packed = pack_batch(HAND_BATCH)
    assert packed.input_ids.tolist() == [[5, 6, 7, 1, 4, 3, 5, 6, 8, 9, 1, 4, 2]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 0, 1]]
    assert packed.plan.blocks == [(((0, 4),), 4), (((4, 6),), 2), (((6, 11),), 5), (((11, 13),), 2)]
    assert packed.targets.tolist() == [7, 1, 3, 8, 9, 1, 2]
    assert packed.sources.tolist() == [1, 2, 4, 7, 8, 9, 11]
    assert packed.sequences.tolist() == [0, 0, 1, 2, 2, 2, 3]


def test_pack_batch_layout_shared_prompt():
    packed = pack_batch(HAND_BATCH, share_prompt=True)
    assert packed.input_ids.tolist() == [[5, 6, 7, 1, 8, 9, 1, 4, 3, 2]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4, 0, 1, 1]]
    # the rejected completion's block takes the prompt's keys and its own, skipping the chosen tokens
    assert packed.plan.blocks == [(((0, 4),), 4), (((0, 2), (4, 7)), 3), (((7, 9),), 2), (((7, 8), (9, 10)), 1)]
    assert packed.sources.tolist() == [1, 2, 1, 4, 5, 7, 7]
    assert packed.targets.tolist() == [7, 1, 8, 9, 1, 3, 2]
    assert packed.sequences.tolist() == [0, 0, 2, 2, 2, 1, 3]
    assert can_pack(HAND_BATCH, share_prompt=True)
    other_prompt = {**HAND_BATCH, "input_ids": HAND_BATCH["input_ids"].clone()}
    other_prompt["input_ids"][2, 0] = 9
    assert can_pack(other_prompt) and not can_pack(other_prompt, share_prompt=True)
    no_prompt = {
        **HAND_BATCH,
        "completion_mask": torch.tensor([[1, 1, 1, 1, 0], [0, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]]),
    }
    assert not can_pack(no_prompt)


def test_preference_accuracy_counts_ties_half():
    acc = preference_accuracy(torch.tensor([1.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 0.0]))
    assert acc.tolist() == [1.0, 0.5, 0.0]


@pytest.mark.slow
def test_dpo_learns_through_the_cli(tmp_path):
    config = write_config(tmp_path, n_pairs=64, trainer={"max_steps": 24, "val_check_interval": 12})
    before = build_cli(["validate", "--config", str(config)]).trainer.callback_metrics["val/rewards/accuracies"]
    cli = fit(config)
    rows = read_metrics(tmp_path)
    losses, accuracy = series(rows, "train/loss"), series(rows, "val/rewards/accuracies")
    assert float(before) == pytest.approx(0.5)  # policy == reference: every reward is 0
    assert sum(losses[-4:]) / 4 < 0.5 * losses[0]
    assert accuracy[-1] >= 0.9 > float(before)
    # the policy moved, the reference did not (it equals a fresh model from the same source)
    fresh = build_causal_lm(TINY_LLAMA, seed=0).state_dict()
    policy, reference = cli.model.policy.state_dict(), cli.model.reference.model.state_dict()
    assert any(not torch.equal(policy[k], fresh[k]) for k in fresh)
    assert all(torch.equal(reference[k], fresh[k]) for k in fresh)
    assert not any(k.startswith("reference") for k in cli.model.state_dict())


LOSS_RUNS = [
    {
        "loss_type": t,
        **({"label_smoothing": 0.1} if t in ("sigmoid", "robust") else {}),
        **({"padding_free": False, "share_prompt": False} if t in ("hinge", "simpo") else {}),
    }
    for t in ("sigmoid", "robust", "hinge", "ipo", "simpo")  # the others: tests/losses/test_preference_losses.py
] + [
    {"reference_free": True},
    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},  # RPO
    {"loss_type": "apo_zero"},
]


@pytest.mark.parametrize("model", LOSS_RUNS, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_every_loss_type_runs(tmp_path, model):
    config = write_config(
        tmp_path, n_pairs=16, model=model, trainer={"max_steps": 2, "limit_val_batches": 1, "val_check_interval": 2}
    )
    cli = fit(config)
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2
    assert math.isfinite(float(metrics["train/loss"])) and math.isfinite(float(metrics["val/loss"]))
    assert {"val/rewards/chosen", "val/rewards/margins", "val/logps/rejected"} <= set(metrics)
    assert (cli.model.reference is None) == (model.get("reference_free", False) or model.get("loss_type") == "simpo")


def test_loss_type_lists_are_checked():
    with pytest.raises(HyperparameterError, match="loss_type"):
        DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", loss_type=["sigmoid", "nope"])
    with pytest.raises(ValueError, match="loss_weights has 1 entries for 2"):
        DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    assert DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", loss_type=["simpo", "sft"]).reference is None


def _first_steps(tmp_path, name, steps=3, **model):
    run = tmp_path / name
    run.mkdir()
    config = write_config(run, n_pairs=32, model=model, trainer={"max_steps": steps, "limit_val_batches": 0})
    cli = fit(config)
    rows = read_metrics(run)
    return cli, series(rows, "train/loss"), series(rows, "train/logps/chosen")


def test_precompute_and_lora_give_the_plain_first_step(tmp_path):
    _, plain_loss, plain_logps = _first_steps(tmp_path, "plain")
    cli, pre_loss, pre_logps = _first_steps(tmp_path, "pre", precompute_ref_log_probs=True)
    assert cli.model.reference._frozen == []  # the frozen copy was released after precomputing
    assert len(cli.model._ref_cache["train"]) == 24
    torch.testing.assert_close(torch.tensor(pre_loss), torch.tensor(plain_loss), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(pre_logps), torch.tensor(plain_logps), rtol=1e-4, atol=1e-3)
    cli, lora_loss, lora_logps = _first_steps(tmp_path, "lora", steps=1, lora=LORA)
    assert cli.model.reference.shares_weights
    assert lora_loss[0] == pytest.approx(plain_loss[0], abs=1e-5) and lora_loss[0] == pytest.approx(
        math.log(2), abs=1e-5
    )
    assert lora_logps[0] == pytest.approx(plain_logps[0], rel=1e-5)


class _Probe(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.scheduler = trainer.lr_scheduler_configs[0].scheduler.state_dict()


@pytest.mark.slow
def test_resume_continues_at_the_same_step_with_the_same_optimizer_state(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    trainer = {
        "max_steps": 4,
        "limit_val_batches": 0,
        "enable_checkpointing": True,
        "callbacks": [
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"dirpath": str(ckpt_dir), "every_n_train_steps": 2, "save_top_k": -1},
            }
        ],
    }
    config = write_config(tmp_path, n_pairs=16, trainer=trainer)
    fit(config)
    ckpt = next(ckpt_dir.glob("*step=2.ckpt"))
    saved = torch.load(ckpt, weights_only=True)
    assert not any(k.startswith("_epoch_metrics") or "reference" in k for k in saved["state_dict"])
    cli = build_cli(["--config", str(config)], run=False)
    probe = _Probe()
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=str(ckpt))
    assert probe.step == 2 and cli.trainer.global_step == 4
    want = saved["optimizer_states"][0]
    assert probe.optimizer["state"].keys() == want["state"].keys() and want["state"]
    for key, state in want["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(probe.optimizer["state"][key][name], value, rtol=0, atol=0)
    assert probe.scheduler["last_epoch"] == saved["lr_schedulers"][0]["last_epoch"] == 2


def test_bf16_mixed_smoke(tmp_path):
    config = write_config(
        tmp_path, n_pairs=8, trainer={"max_steps": 1, "limit_val_batches": 0, "precision": "bf16-mixed"}
    )
    cli = fit(config)
    assert cli.trainer.global_step == 1 and math.isfinite(float(cli.trainer.callback_metrics["train/loss"]))


@pytest.mark.ddp
@pytest.mark.slow
def test_ddp_two_cpu_processes(tmp_path):
    """Two CPU ranks through the CLI: fit completes, rank 0 exports, validation metrics reach the logger."""
    import subprocess
    import sys

    config = write_config(
        tmp_path,
        n_pairs=16,
        trainer={
            "max_steps": 2,
            "limit_val_batches": 1,
            "val_check_interval": 2,
            "devices": 2,
            "strategy": "ddp",
            "callbacks": [
                {
                    "class_path": "aitraining_pl.callbacks.export.HFExportCallback",
                    "init_args": {"dirpath": str(tmp_path / "export")},
                }
            ],
        },
    )
    script = tmp_path / "run_cli.py"  # DDP relaunches sys.argv, so the entry point must be a file
    script.write_text("from aitraining_pl.cli import main\nmain()\n")
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), "fit", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "export" / "last" / "model.safetensors").is_file()
    assert "val/rewards/accuracies" in (tmp_path / "csv" / "v" / "metrics.csv").read_text()


class _LightningOrder(DPOModule):
    """``DPOModule`` with Lightning's own ``optimizer_step``: gradients zeroed only after the next forward."""

    def optimizer_step(self, *args, **kwargs):
        pl.LightningModule.optimizer_step(self, *args, **kwargs)


def test_gradients_are_freed_after_each_step_and_training_is_unchanged(tmp_path, byte_tokenizer):
    """Two optimizer steps of two accumulated micro-batches each: the same weights as in Lightning's order, and no
    gradient left after the step (Lightning's order keeps the last step's gradients until the next forward)."""
    rows = preference_rows(8)
    modules = {}
    for cls in (DPOModule, _LightningOrder):
        module = cls(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-2, warmup_ratio=0.0)
        data = preference_data(
            rows,
            byte_tokenizer,
            val_split=0,
            batch_size=2,
            shuffle=False,
        )
        trainer = quiet_trainer(tmp_path, max_steps=2, accumulate_grad_batches=2, limit_val_batches=0)
        trainer.fit(module, data)
        modules[cls] = module
    freed, lightning = modules[DPOModule], modules[_LightningOrder]
    assert all(p.grad is None for p in freed.policy.parameters())
    assert all(p.grad is not None for p in lightning.policy.parameters())
    initial = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte").policy
    assert any(not torch.equal(a, b) for a, b in zip(freed.policy.parameters(), initial.parameters()))  # it trained
    for a, b in zip(freed.policy.parameters(), lightning.policy.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_adamw_runs_fused_under_plain_precision_only(tmp_path, byte_tokenizer, precision):
    """32-true on CPU: fused AdamW (no parameter-sized temporaries at the step); bf16-mixed: the default AdamW,
    since Lightning refuses gradient clipping with a fused optimizer under mixed precision (clipping runs here)."""
    rows = preference_rows(4)
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", warmup_ratio=0.0)
    data = preference_data(
        rows,
        byte_tokenizer,
        val_split=0,
        batch_size=2,
    )
    trainer = quiet_trainer(tmp_path, max_steps=1, precision=precision, gradient_clip_val=1.0, limit_val_batches=0)
    trainer.fit(module, data)
    assert trainer.global_step == 1
    assert bool(trainer.optimizers[0].defaults.get("fused")) is (precision == "32-true")
