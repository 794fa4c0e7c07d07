"""The aitraining-pl command: every shipped config parses, user errors are one message, W&B offline works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aitraining_pl.cli import build_cli, main
from dpo_utils import read_metrics, series, write_config, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.relative_to(ROOT) for p in (ROOT / "configs").rglob("*.y*ml"))


def test_configs_exist():
    assert Path("configs/dpo.yaml") in CONFIGS and Path("configs/quickstart/dpo.yaml") in CONFIGS


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_every_config_parses(config, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(config), "--print_config"])
    assert info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "model:" in out and "class_path:" in out and "trainer:" in out


def _run_main(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "missing.jsonl: file not found"),
        ("columns", "missing column(s) 'rejected'; columns found: prompt, chosen"),
        ("malformed", "row 2: malformed JSON"),
        ("empty", "row 1, field 'prompt': empty text"),
    ],
)
def test_bad_input_is_one_message_and_exit_2(tmp_path, capsys, case, expected):
    config = write_config(tmp_path)
    path = tmp_path / f"{case}.jsonl"
    if case == "columns":
        write_jsonl(path, [{"prompt": "a", "chosen": "b"}])
    elif case == "malformed":
        path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": \n')
    elif case == "empty":
        write_jsonl(path, [{"prompt": "", "chosen": "b", "rejected": "c"}])
    code, err = _run_main(["fit", "--config", str(config), "--data.init_args.data_path", str(path)], capsys)
    assert code == 2
    assert expected in err and str(path) in err and "Traceback" not in err
    assert not list(tmp_path.glob("csv/v/metrics.csv"))  # nothing ran


def test_bad_hyperparameter_is_one_message(tmp_path, capsys):
    config = write_config(tmp_path)
    code, err = _run_main(["fit", "--config", str(config), "--model.init_args.loss_type", "nope"], capsys)
    assert code == 2 and "unknown loss_type 'nope'" in err and "Traceback" not in err


@pytest.mark.slow
def test_console_script_exit_status(tmp_path):
    config = write_config(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", "from aitraining_pl.cli import main; main()", "fit", "--config", str(config),
           "--data.init_args.data_path", str(tmp_path / "nope.jsonl")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert "nope.jsonl: file not found" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_quickstart_config_runs_briefly_with_csv_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = ROOT / "aitraining_pl" / "data" / "quickstart_preferences.jsonl"
    cli = build_cli(["fit", "--config", str(ROOT / "configs/quickstart/dpo.yaml"), "--data.init_args.data_path", str(data),
                     "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "3",
                     "--trainer.enable_progress_bar", "false"])
    assert cli.trainer.global_step == 3
    metrics = list((tmp_path / "runs/quickstart-dpo/csv").glob("version_*/metrics.csv"))
    assert metrics and "val/rewards/accuracies" in metrics[0].read_text().splitlines()[0]
    assert (tmp_path / "runs/quickstart-dpo/export/last/model.safetensors").is_file()


@pytest.mark.slow
def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = write_config(tmp_path, trainer={"max_steps": 2, "limit_val_batches": 1, "val_check_interval": 2})
    cli = build_cli(["fit", "--config", str(config), "--trainer.logger", "lightning.pytorch.loggers.WandbLogger",
                     "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.offline", "true",
                     "--trainer.logger.init_args.project", "test"])
    import wandb

    wandb.finish()
    assert cli.trainer.global_step == 2
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb"))


def test_overrides_reach_the_module(tmp_path):
    config = write_config(tmp_path)
    cli = build_cli(["--config", str(config), "--model.init_args.beta", "0.25", "--data.init_args.batch_size", "2"], run=False)
    assert cli.model.hparams.beta == 0.25 and cli.datamodule.hparams.batch_size == 2
    assert cli.datamodule.tokenizer is cli.model.tokenizer  # linked, not loaded twice
