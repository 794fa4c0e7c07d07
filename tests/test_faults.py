"""Faults an unlucky operator meets (issue 26): SIGTERM from a scheduler, reward functions that hang or call
``os._exit``. Each ends the run with a non-zero exit status and one line saying what happened."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
from dpo_utils import write_config

from aitraining_pl.cli import main


class SigtermAtStep(pl.Callback):
    """Sends SIGTERM to this process after optimizer step ``step`` (as SLURM or Kubernetes would)."""

    def __init__(self, step: int = 2):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_exits_143_with_one_line_naming_the_last_checkpoint(tmp_path, capsys):
    """Before: Lightning raised SIGTERMException, a SystemExit with no code, and the command exited 0."""
    checkpoints = tmp_path / "ckpt"
    config = write_config(tmp_path, trainer={"max_steps": 20, "enable_checkpointing": True})
    args = [
        "fit",
        "--config",
        str(config),
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.dirpath",
        str(checkpoints),
        "--trainer.callbacks.every_n_train_steps",
        "1",
        "--trainer.callbacks.save_top_k",
        "-1",
        "--trainer.callbacks+=test_faults.SigtermAtStep",
    ]
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as info:
            main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("aitraining-pl:")]
    assert info.value.code == 143
    assert len(lines) == 1 and lines[0].startswith("aitraining-pl: stopped by SIGTERM after "), lines
    path = lines[0].split("last checkpoint: ", 1)[1].split(" ", 1)[0]
    assert Path(path).is_file() and Path(path).parent == checkpoints, lines
    assert f"--ckpt_path {path}" in lines[0]


def test_guarded_calls_keep_the_callers_torch_mode_and_leave_other_exits_alone():
    """The worker thread of a reward call runs under the caller's grad mode; ``os._exit`` raises only in that
    thread, so a child the reward forks still exits with its status."""
    import torch

    from aitraining_pl.guarded_call import CallTimeout, ExitCalled, guarded_call

    with torch.no_grad():
        assert guarded_call(torch.is_grad_enabled, (), 5.0) is False
    assert guarded_call(torch.is_grad_enabled, (), 5.0) is True

    def fork_and_wait():
        pid = os.fork()
        if pid == 0:
            os._exit(3)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert guarded_call(fork_and_wait, (), 10.0) == 3
    with pytest.raises(ExitCalled) as info:
        guarded_call(os._exit, (5,), 5.0)
    assert info.value.code == 5
    with pytest.raises(CallTimeout, match="did not return within 0.2 s"):
        guarded_call(__import__("time").sleep, (30,), 0.2)


def test_checkpoints_are_written_beside_their_target_and_leftovers_of_killed_runs_removed(tmp_path, monkeypatch):
    """Issue 26, item 10: Lightning staged each checkpoint with ``tempfile.mkstemp()`` in /tmp (a killed write
    left it there). Here /tmp staging fails outright, and a dead run's temporary file is cleaned up."""
    import subprocess
    import sys
    import tempfile

    import torch
    from conftest import TINY_LLAMA
    from dpo_utils import preference_data, preference_rows

    from aitraining_pl.modules.dpo import DPOModule

    def no_tmp(*args, **kwargs):
        raise AssertionError("a checkpoint was staged in the system temporary folder")

    monkeypatch.setattr(tempfile, "mkstemp", no_tmp)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = folder / f".last.ckpt.tmp-{int(dead.stdout)}-0123abcd"
    running = folder / f".last.ckpt.tmp-{os.getpid()}-89abcdef"  # a live run's write in progress: kept
    leftover.write_bytes(b"x" * 1024)
    running.write_bytes(b"x")
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-3)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_last=True)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[checkpoint],
    )  # fmt: skip
    trainer.fit(module, preference_data(preference_rows(16), module.tokenizer, val_split=0, batch_size=4))
    assert not leftover.exists() and running.exists()
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == [running.name]


def test_sigterm_while_a_reward_function_hangs_stops_the_wait():
    """Before: the handler installed before (Lightning's) recorded SIGTERM and the wait for the call went on; now
    the wait ends with ``CallInterrupted`` (a Lightning ``SIGTERMException``: exit status 143 on the command line),
    not a ``RewardError``, once that handler has run."""
    import threading

    from aitraining_pl.guarded_call import CallInterrupted
    from aitraining_pl.rewards import score_responses

    started, release, seen = threading.Event(), threading.Event(), []

    def hangs(prompts, responses, metadata):
        started.set()
        release.wait()
        return [1.0]

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    sender = threading.Thread(target=lambda: started.wait() and os.kill(os.getpid(), signal.SIGTERM))
    sender.start()
    try:
        with pytest.raises(CallInterrupted):
            score_responses(hangs, ["p"], ["r"], [{}], timeout=None)
    finally:
        release.set()
        sender.join()
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is previous
