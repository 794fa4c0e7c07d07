"""The aitraining-pl command: every shipped config parses, user errors are one message, W&B offline works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dpo_utils import write_config, write_jsonl

from aitraining_pl.cli import build_cli, main

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
    cmd = [
        sys.executable,
        "-c",
        "from aitraining_pl.cli import main; main()",
        "fit",
        "--config",
        str(config),
        "--data.init_args.data_path",
        str(tmp_path / "nope.jsonl"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert "nope.jsonl: file not found" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_quickstart_config_runs_briefly_with_csv_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = ROOT / "aitraining_pl" / "data" / "quickstart_preferences.jsonl"
    cli = build_cli(
        [
            "fit",
            "--config",
            str(ROOT / "configs/quickstart/dpo.yaml"),
            "--data.init_args.data_path",
            str(data),
            "--trainer.max_steps",
            "3",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.val_check_interval",
            "3",
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
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
    cli = build_cli(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.logger",
            "lightning.pytorch.loggers.WandbLogger",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.logger.init_args.offline",
            "true",
            "--trainer.logger.init_args.project",
            "test",
        ]
    )
    import wandb

    wandb.finish()
    assert cli.trainer.global_step == 2
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb"))


def test_overrides_reach_the_module(tmp_path):
    config = write_config(tmp_path)
    cli = build_cli(
        ["--config", str(config), "--model.init_args.beta", "0.25", "--data.init_args.batch_size", "2"], run=False
    )
    assert cli.model.hparams.beta == 0.25 and cli.datamodule.hparams.batch_size == 2
    assert cli.datamodule.tokenizer is cli.model.tokenizer  # linked, not loaded twice


# ---------------------------------------------------------------- the command explains itself (issue 15, item 5)
def test_bare_command_lists_modules_and_recipes(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for args in ([], ["--help"]):
        with pytest.raises(SystemExit) as info:
            main(args)
        out = capsys.readouterr().out
        assert info.value.code == 0
        for name, path in [
            ("DPO", "aitraining_pl.modules.dpo.DPOModule"),
            ("SFT", "aitraining_pl.modules.sft.SFTModule"),
            ("PPO", "aitraining_pl.modules.ppo.PPOModule"),
            ("multi-objective", "MultiObjectiveRewardModule"),
            ("GRPO", "aitraining_pl.modules.critic_free.GRPOModule"),
            ("RLOO", "RLOOModule"),
            ("pairwise", "PairwiseRewardModule"),
        ]:
            assert any(line.split()[:1] == [name] and path in line for line in out.splitlines()), (name, out)
        first = (ROOT / "configs/quickstart/dpo.yaml").read_text().splitlines()[0].lstrip("# ")
        assert any("configs/quickstart/dpo.yaml" in line and first in line for line in out.splitlines()), out


def test_version(capsys):
    import aitraining_pl

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"aitraining-pl {aitraining_pl.__version__}"


def test_short_class_name_help_and_choices(capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--model.help", "DPOModule"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "--model.beta" in out
    assert "{linear,cosine,constant}" in out and "--model.attn_implementation" in out
    assert "--model.loss_type+ LOSS_TYPE" in out and "``sigmoid`` (DPO), ``robust``" in " ".join(out.split())


@pytest.mark.parametrize(
    "option, field",
    [
        ("--model.lora.help", "--alpha"),
        ("--model.init_args.lora.help", "--r"),
        ("--model.generation.help", "--max_new_tokens"),
        ("--model.quantization.help", "--quant_type"),
    ],
)
def test_nested_help(option, field, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--model", "DPOModule", option])
    assert info.value.code == 0 and field in capsys.readouterr().out


def test_output_dir_places_logs_checkpoints_exports_and_wandb_keeps_no_csv_name(tmp_path, monkeypatch):
    """The README's W&B command on a quickstart recipe: jsonargparse carries the CSV logger's name/save_dir over to
    the W&B logger; with --output_dir / --run_name every output lands in one folder and the run is named."""
    pytest.importorskip("wandb")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = str(ROOT / "configs/quickstart/dpo.yaml")
    swap = ["--trainer.logger", "lightning.pytorch.loggers.WandbLogger", "--trainer.logger.init_args.project", "p"]
    cli = build_cli(["--config", config, *swap], run=False)
    assert cli.trainer.logger._wandb_init.get("name") is None  # not "csv"
    cli = build_cli(
        [
            "--config",
            config,
            *swap,
            "--output_dir",
            str(tmp_path / "out"),
            "--run_name",
            "r1",
            "--trainer.enable_checkpointing",
            "true",
            "--trainer.callbacks+",
            "lightning.pytorch.callbacks.ModelCheckpoint",
        ],
        run=False,
    )
    assert cli.trainer.logger._wandb_init["name"] == "r1" and cli.trainer.logger.save_dir == str(tmp_path / "out")
    dirs = {type(c).__name__: str(getattr(c, "dirpath", "")) for c in cli.trainer.callbacks}
    assert dirs["HFExportCallback"] == str(tmp_path / "out" / "export")
    assert dirs["ModelCheckpoint"] == str(tmp_path / "out" / "checkpoints")
    cli = build_cli(["--config", config, "--output_dir", str(tmp_path / "o2"), "--run_name", "r2"], run=False)
    assert cli.trainer.logger.log_dir == str(tmp_path / "o2" / "csv" / "r2")


def test_threads_option(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        build_cli(["--config", str(ROOT / "configs/quickstart/dpo.yaml"), "--threads", "1"], run=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_compact_summary_drops_internal_rows_and_empty_flops():
    from aitraining_pl.callbacks.summary import compact_summary_data

    data = [
        (" ", ["0", "1"]),
        ("Name", ["_epoch_metrics", "policy"]),
        ("Type", ["ModuleDict", "Llama"]),
        ("Params", ["0", "123 K"]),
        ("FLOPs", ["0", "0"]),
    ]
    assert compact_summary_data(data, total_flops=0) == [
        (" ", ["0"]),
        ("Name", ["policy"]),
        ("Type", ["Llama"]),
        ("Params", ["123 K"]),
    ]
    assert ("FLOPs", ["0"]) in compact_summary_data(data, total_flops=10)


def test_lora_run_logs_every_argument_quietly_and_closes_with_metrics(tmp_path, monkeypatch, capsys, caplog):
    """A brief LoRA run: hparams.yaml holds lora; no litlogger advertisement, no internal summary row, no FLOPs
    line; a closing line names the final metrics and the export."""
    import logging

    import yaml

    monkeypatch.chdir(tmp_path)
    data = ROOT / "aitraining_pl" / "data" / "quickstart_preferences.jsonl"
    with caplog.at_level(logging.INFO):
        main(
            [
                "fit",
                "--config",
                str(ROOT / "configs/quickstart/dpo.yaml"),
                "--data.init_args.data_path",
                str(data),
                "--model.init_args.lora",
                '{"r": 4, "alpha": 8}',
                "--output_dir",
                "out",
                "--trainer.max_steps",
                "2",
                "--trainer.limit_val_batches",
                "1",
                "--trainer.val_check_interval",
                "2",
                "--trainer.enable_progress_bar",
                "false",
            ]
        )
    out = capsys.readouterr().out
    hparams = yaml.safe_load(next((tmp_path / "out" / "csv").glob("version_*/hparams.yaml")).read_text())
    assert hparams["lora"]["r"] == 4 and hparams["lora"]["alpha"] == 8 and hparams["beta"] == 0.1
    logged = caplog.text + out
    assert "litlogger" not in logged and "_epoch_metrics" not in logged and "Total Flops" not in logged
    assert "policy" in logged  # the model summary itself is still there
    closing = [line for line in out.splitlines() if line.startswith("aitraining-pl: done after 2 steps")]
    assert closing and "val/rewards/accuracies=" in closing[0] and "export: out/export/last" in closing[0]


@pytest.mark.slow
def test_a_reward_function_in_the_working_directory_imports(tmp_path):
    """``--model.init_args.reward myreward:has_digit`` finds ``myreward.py`` in the working directory without
    ``PYTHONPATH=.`` (the command puts its working directory first on ``sys.path``, as ``python -m`` does). The
    command runs as the console script does: ``python -P`` adds no working directory of its own."""
    (tmp_path / "myreward.py").write_text(
        "def has_digit(prompts, responses, metadata):\n"
        "    return [float(any(c.isdigit() for c in r)) for r in responses]\n"
    )
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"count {i}"} for i in range(4)])
    model = {
        "model_config": {"preset": "tiny-llama"},
        "tokenizer_name": "byte",
        "num_generations": 2,
        "mini_batch_size": 4,
        "generation": {"max_new_tokens": 3},
    }
    config = json.loads(write_config(tmp_path, model=model, trainer={"max_steps": 1}).read_text())
    config["model"]["class_path"] = "aitraining_pl.modules.critic_free.GRPOModule"
    data = {"data_path": str(prompts), "batch_size": 2, "val_split": 0}
    config["data"] = {"class_path": "aitraining_pl.datamodules.prompt.PromptDataModule", "init_args": data}
    (tmp_path / "grpo.yaml").write_text(json.dumps(config))
    config = tmp_path / "grpo.yaml"
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in ("", ".")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *path])}
    cmd = [sys.executable, "-P", "-c", "from aitraining_pl.cli import main; main()", "fit", "--config", str(config)]
    cmd += ["--model.init_args.reward", "myreward:has_digit"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "aitraining-pl: done after 1 steps" in proc.stdout + proc.stderr
