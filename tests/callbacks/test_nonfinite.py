"""NonFiniteGuard: a NaN/inf loss or gradient norm stops the run naming the metric and step (exit status 2
through the CLI) with earlier exports and checkpoints intact, or, with action="skip", skips the step."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY_LLAMA
from dpo_utils import preference_data, preference_rows, write_config

from aitraining_pl.callbacks.export import HFExportCallback
from aitraining_pl.callbacks.guard import NonFiniteError, NonFiniteGuard
from aitraining_pl.cli import main
from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.modules.dpo import DPOModule
from aitraining_pl.modules.ppo import PPOModule
from aitraining_pl.rollout import GenerationConfig


class NaNAtStep(DPOModule):
    """DPO whose loss is NaN at optimizer step ``bad_step`` (0-based global_step when the batch starts)."""

    bad_step = 2

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == self.bad_step else loss


def _data(tokenizer):
    rows = preference_rows(24)
    return preference_data(
        rows,
        tokenizer,
        val_split=0,
        batch_size=4,
    )


def _trainer(tmp_path, callbacks, **kw):
    options = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        enable_checkpointing=True,
    )
    return pl.Trainer(callbacks=callbacks, **{**options, **kw})


def _finite_export(path) -> bool:
    from safetensors.torch import load_file

    return all(bool(torch.isfinite(t).all()) for t in load_file(path / "model.safetensors").values())


def test_nan_loss_stops_the_run_and_keeps_earlier_exports_and_checkpoints(tmp_path):
    module = NaNAtStep(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-3)
    export = HFExportCallback(tmp_path / "export", every_n_train_steps=1, keep_last_k=None)
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    with pytest.raises(NonFiniteError, match=r"non-finite train/loss \(nan\) at global_step 2 \(epoch 0, batch 2\)"):
        _trainer(tmp_path, [export, ckpt], max_steps=5).fit(module, _data(module.tokenizer))
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["step-1", "step-2"]  # no last, no step-3
    assert all(_finite_export(tmp_path / "export" / name) for name in ("step-1", "step-2"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=1.ckpt", "step=2.ckpt"]
    state = torch.load(tmp_path / "ckpt" / "step=2.ckpt", weights_only=True)["state_dict"]
    assert all(bool(torch.isfinite(v).all()) for v in state.values())
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())  # the bad step was never taken


def test_learning_rate_that_blows_up_stops_the_run_through_the_cli(tmp_path, capsys):
    config = write_config(tmp_path, model={"learning_rate": 1e12}, trainer={"max_steps": 20})
    export = tmp_path / "export"
    args = [
        "fit",
        "--config",
        str(config),
        "--trainer.callbacks+=aitraining_pl.callbacks.export.HFExportCallback",
        "--trainer.callbacks.dirpath",
        str(export),
        "--trainer.callbacks.every_n_train_steps",
        "1",
        "--trainer.callbacks.keep_last_k",
        "1",
    ]
    with pytest.raises(SystemExit) as info:
        main(args)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Writing model shards" not in line]
    assert info.value.code == 2
    assert len(err) == 1 and err[0].startswith("aitraining-pl: training error: non-finite "), err
    assert "at global_step" in err[0] and ("train/loss" in err[0] or "grad_norm" in err[0])
    print(err[0])
    exports = sorted(p.name for p in export.iterdir())
    assert "last" not in exports and len(exports) == 1 and _finite_export(export / exports[0])


def test_skip_leaves_the_weights_and_optimizer_as_they_were_and_counts(tmp_path):
    module = NaNAtStep(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-3)
    snapshots = {}

    class Snap(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            snapshots[batch_idx] = {k: v.clone() for k, v in pl_module.state_dict().items()}

    guard = NonFiniteGuard(action="skip")
    logger = pl.loggers.CSVLogger(tmp_path, name="csv", version="v")
    trainer = _trainer(
        tmp_path, [guard, Snap()], max_steps=4, enable_checkpointing=False, logger=logger, log_every_n_steps=1
    )
    trainer.fit(module, _data(module.tokenizer))
    assert trainer.global_step == 4 and guard.skipped == 1
    before, after = snapshots[2], snapshots[3]  # batch 2 was the NaN one
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not all(torch.equal(snapshots[1][k], before[k]) for k in before)  # other steps do train
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    assert float(trainer.logged_metrics["train/skipped_nonfinite"]) == 1.0
    assert NonFiniteGuard(action="skip").state_dict() == {"skipped": 0} and guard.state_dict() == {"skipped": 1}


class NaNPPO(PPOModule):
    def minibatch_loss(self, exp, idx):
        loss, stats = super().minibatch_loss(exp, idx)
        return (loss * float("nan"), stats) if self.global_step == 1 else (loss, stats)


@pytest.mark.parametrize("action", ["stop", "skip"])
def test_ppo_manual_optimisation_is_guarded(tmp_path, action):
    module = NaNPPO(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        reward="aitraining_pl.rewards:char_fraction_reward",
        learning_rate=1e-3,
        mini_batch_size=2,
        num_iterations=1,
        generation=GenerationConfig(max_new_tokens=4),
    )
    data = PromptDataModule(prompts=["ab", "cd", "ef", "gh", "ij", "kl"], tokenizer=module.tokenizer, batch_size=2)
    guard = NonFiniteGuard(action=action)
    trainer = _trainer(tmp_path, [guard], max_epochs=1, enable_checkpointing=False)
    if action == "stop":
        with pytest.raises(NonFiniteError, match="non-finite train/loss .* at global_step 1"):
            trainer.fit(module, data)
        assert trainer.global_step == 1
    else:
        trainer.fit(module, data)
        assert guard.skipped == 1 and trainer.global_step == 3
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_infinite_gradient_norm_is_named():
    guard = NonFiniteGuard()
    layer = torch.nn.Linear(2, 1)
    layer.weight.grad = torch.tensor([[float("inf"), 0.0]])
    optimizer = torch.optim.AdamW(layer.parameters())
    trainer = type(
        "T",
        (),
        {
            "precision_plugin": None,
            "world_size": 1,
            "global_step": 7,
            "current_epoch": 1,
            "fit_loop": type("F", (), {"epoch_loop": type("E", (), {"batch_idx": 3})}),
        },
    )()
    with pytest.raises(NonFiniteError, match=r"non-finite grad_norm \(inf\) at global_step 7 \(epoch 1, batch 3\)"):
        guard.on_before_optimizer_step(trainer, None, optimizer)
    with pytest.raises(ValueError, match="action"):
        NonFiniteGuard(action="ignore")


def test_skip_through_the_cli(tmp_path):
    from dpo_utils import read_metrics, series

    config = write_config(tmp_path, model={"learning_rate": 1e12}, trainer={"max_steps": 4})
    cli_args = [
        "fit",
        "--config",
        str(config),
        "--trainer.callbacks+=aitraining_pl.callbacks.guard.NonFiniteGuard",
        "--trainer.callbacks.action",
        "skip",
    ]
    main(cli_args)  # completes (no SystemExit)
    skipped = series(read_metrics(tmp_path), "train/skipped_nonfinite")
    assert len(skipped) == 4 and skipped[-1] >= 1 and skipped == sorted(skipped)


class _OverflowingLearningRate(pl.Callback):
    """Sets every learning rate to 1e39 when training starts (the range check refuses it as an argument):
    AdamW's first step then writes inf/NaN into the weights while the loss and gradients are finite."""

    def on_train_start(self, trainer, pl_module):
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = 1e39


def test_weights_made_non_finite_by_the_step_are_never_exported_or_checkpointed(tmp_path):
    """Issue 26, item 4: lr 1e39 with an export and a checkpoint every step; before, step-1 and the checkpoint
    were all inf/NaN and the message said 'stopped before the optimizer step'."""
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-3)
    export = HFExportCallback(tmp_path / "export", every_n_train_steps=1, keep_last_k=None)
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}", save_last=True
    )
    trainer = _trainer(tmp_path, [_OverflowingLearningRate(), export, ckpt], max_steps=3)
    with pytest.raises(NonFiniteError, match=r"non-finite weights \(.+\) after optimizer step 1 .*stopped") as caught:
        trainer.fit(module, _data(module.tokenizer))
    assert "before the optimizer step" not in str(caught.value)
    assert not (tmp_path / "export").exists() or list((tmp_path / "export").iterdir()) == []
    assert not (tmp_path / "ckpt").exists() or list((tmp_path / "ckpt").iterdir()) == []
    with pytest.raises(NonFiniteError, match="export 'manual' not written"):
        export.export(module, "manual")


def test_a_learning_rate_above_float32s_range_is_refused():
    from aitraining_pl.errors import HyperparameterError

    with pytest.raises(HyperparameterError, match=r"DPOModule.learning_rate: must be 0 < value <= 3.40282e\+38"):
        DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e39)


def test_losses_are_read_once_per_optimizer_step_not_per_micro_batch(monkeypatch):
    """A host read of a tensor (``item``, ``bool``, ``tolist``, ``float``) is a device sync on a GPU: the losses of
    the micro-batches are checked together at the optimizer step, in one read; a NaN among them is still named."""
    trainer = type(
        "T", (), {"precision_plugin": None, "world_size": 1, "global_step": 4, "current_epoch": 0,
                  "fit_loop": type("F", (), {"epoch_loop": type("E", (), {"batch_idx": 2})})},
    )()  # fmt: skip
    layer = torch.nn.Linear(2, 1)
    layer.weight.grad, layer.bias.grad = torch.ones(1, 2), torch.ones(1)
    optimizer = torch.optim.AdamW(layer.parameters())
    reads = {"n": 0}
    for name in ("tolist", "item", "__bool__", "__float__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _r=real: reads.update(n=reads["n"] + 1) or _r(self, *a)
        )
    guard = NonFiniteGuard()
    for losses, reads_expected in (([0.5, 0.25, 0.75, 1.0], 1), ([0.5, float("nan"), 2.0], None)):
        reads["n"] = 0
        for value in losses:
            guard.on_before_backward(trainer, None, torch.tensor(value))
        assert reads["n"] == 0
        if reads_expected is None:
            with pytest.raises(NonFiniteError, match=r"non-finite train/loss \(nan\) at global_step 4"):
                guard.on_before_optimizer_step(trainer, None, optimizer)
        else:
            guard.on_before_optimizer_step(trainer, None, optimizer)
            assert reads["n"] == reads_expected
