"""Bad input through the command line: every user-caused failure (data, config, hyperparameters, model and
reward loading, reward-source behaviour) is one line ``aitraining-pl: <what> error: <where>: <why>`` on stderr
and exit status 2, before training starts where the input allows it (issue 13, items 5 and 6).

Each case is ``(what, arguments, expected parts of the message)``; the arguments extend a tiny DPO or PPO
config. Cases marked ``before_load`` must fail before any model is built (validation of the arguments); data
files are read in ``setup``, after the model is built and before the first step.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_LLAMA
from dpo_utils import write_config, write_jsonl

import aitraining_pl.modules.base as base_module
from aitraining_pl.cli import main
from aitraining_pl.models import build_causal_lm
from aitraining_pl.models.reward import RewardModel, RewardModelConfig
from aitraining_pl.modules.reward import RewardModule

TOY_REWARD = "aitraining_pl.rewards:char_fraction_reward"  # PPO/GRPO/RLOO need a reward source

PPO = "aitraining_pl.modules.ppo.PPOModule"
PROMPTS = "aitraining_pl.datamodules.prompt.PromptDataModule"
REWARD = "aitraining_pl.modules.reward.RewardModule"


# ----------------------------------------------------------------------------- reward sources used below
def raising_reward(prompts, responses, metadata):
    """Fails on the batch; called on one response at a time, fails on the second (index 1)."""
    raising_reward.singles = 0 if len(responses) > 1 else raising_reward.singles + 1
    if len(responses) > 1 or raising_reward.singles == 2:
        raise KeyError("answer")
    return [0.0] * len(responses)


def string_reward(prompts, responses, metadata):
    return [0.5] + ["high"] * (len(responses) - 1)


def exiting_reward(prompts, responses, metadata):
    raise SystemExit(0)


def sleeping_reward(prompts, responses, metadata):
    """Never returns (issue 26, item 7: the run used to hang forever)."""
    import time

    while True:
        time.sleep(3600)


def os_exit_reward(prompts, responses, metadata):
    """Ends the process (issue 26, item 8: the run used to exit 0 with no message)."""
    os._exit(0)


def short_reward(prompts, responses, metadata):
    return [0.0] * (len(responses) - 1)


def nan_reward(prompts, responses, metadata):
    return [0.0, math.nan] + [0.0] * (len(responses) - 2)


# ----------------------------------------------------------------------------- configs
def _dpo(tmp: Path) -> list[str]:
    return ["fit", "--config", str(write_config(tmp))]


def _ppo(tmp: Path) -> list[str]:
    prompts = write_jsonl(tmp / "prompts.jsonl", [{"prompt": f"prompt {i}: say a"} for i in range(4)])
    config = json.loads(write_config(tmp).read_text())
    config["model"] = {
        "class_path": PPO,
        "init_args": {
            "model_config": dict(TINY_LLAMA),
            "tokenizer_name": "byte",
            "reward": "aitraining_pl.rewards:length_reward",
            "generation": {"max_new_tokens": 3},
            "mini_batch_size": 2,
            "num_iterations": 1,
            "learning_rate": 1e-3,
        },
    }
    config["data"] = {"class_path": PROMPTS, "init_args": {"data_path": str(prompts), "batch_size": 2}}
    config["trainer"]["max_steps"] = 1
    path = tmp / "ppo.yaml"
    path.write_text(json.dumps(config))
    return ["fit", "--config", str(path)]


def _reward(tmp: Path) -> list[str]:
    config = json.loads(write_config(tmp).read_text())
    config["model"] = {"class_path": REWARD, "init_args": {"model_config": dict(TINY_LLAMA), "tokenizer_name": "byte"}}
    path = tmp / "reward.yaml"
    path.write_text(json.dumps(config))
    return ["fit", "--config", str(path)]


# ----------------------------------------------------------------------------- files
def _prefs(tmp: Path, name: str, text: str | bytes) -> str:
    path = tmp / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def _row(**fields) -> str:
    return json.dumps({"prompt": "a question", "chosen": "yes", "rejected": "no", **fields}) + "\n"


def _model_folder(tmp: Path, corrupt: bool = False) -> str:
    folder = tmp / "model"
    build_causal_lm(TINY_LLAMA).save_pretrained(folder)
    if corrupt:
        (folder / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    return str(folder)


def _reward_folder(tmp: Path, *drop: str) -> str:
    """A saved reward model with the files ``drop`` deleted (a weights file is overwritten with zeros)."""
    folder = tmp / "rm"
    model = RewardModel(RewardModelConfig(model_config=dict(TINY_LLAMA), tokenizer_name="byte"))
    model.save_pretrained(folder)
    for name in drop:
        if name.endswith(".safetensors"):
            (folder / name).write_bytes(b"\x00" * 16)
        else:
            (folder / name).unlink()
    return str(folder)


class _Exploit:
    """Unpickling runs ``touch <marker>``: what a malicious checkpoint or ``pytorch_model.bin`` does."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil_checkpoint(tmp: Path) -> str:
    import torch

    torch.save({"state_dict": _Exploit(tmp / "EXPLOITED")}, tmp / "evil.ckpt")
    return str(tmp / "evil.ckpt")


def _evil_model_folder(tmp: Path) -> str:
    import torch

    folder = Path(_model_folder(tmp))
    (folder / "model.safetensors").unlink()
    torch.save({"weight": _Exploit(tmp / "EXPLOITED")}, folder / "pytorch_model.bin")
    return str(folder)


def _a_file(tmp: Path) -> Path:
    (tmp / "a_file").write_text("not a folder")
    return tmp / "a_file"


# ----------------------------------------------------------------------------- the table
#: id -> (config, extra arguments (a function of the temporary folder), what, expected parts, before_load)
CASES = {
    # data
    "data-missing-file": (
        _dpo,
        lambda t: ["--data.init_args.data_path", str(t / "nope.jsonl")],
        "data",
        ["nope.jsonl: file not found"],
        False,
    ),
    "data-missing-column": (
        _dpo,
        lambda t: ["--data.init_args.data_path", _prefs(t, "c.jsonl", '{"prompt": "a"}\n')],
        "data",
        ["c.jsonl: missing column(s) 'chosen', 'rejected'"],
        False,
    ),
    "data-duplicate-key": (
        _dpo,
        lambda t: [
            "--data.init_args.data_path",
            _prefs(t, "d.jsonl", _row() + '{"prompt": "q", "chosen": "yes", "rejected": "no", "chosen": "no"}\n'),
        ],
        "data",
        ["d.jsonl, row 2, field 'chosen': duplicate key"],
        False,
    ),
    "data-chat-role-unknown": (
        _dpo,
        lambda t: [
            "--data.init_args.data_path",
            _prefs(t, "r.jsonl", _row() + _row(prompt=[{"role": "wizard", "content": "cast a spell"}])),
        ],
        "data",
        ["r.jsonl, row 2, field 'prompt': message 0 has role 'wizard'; must be one of system, developer, user"],
        False,
    ),
    "data-chat-role-not-a-string": (
        _dpo,
        lambda t: [
            "--data.init_args.data_path",
            _prefs(t, "r.jsonl", _row(chosen=[{"role": "user", "content": "q"}, {"role": 7, "content": "a"}])),
        ],
        "data",
        ["r.jsonl, row 1, field 'chosen': message 1 has role 7; must be one of"],
        False,
    ),
    "config-duplicate-key": (
        _dpo,
        lambda t: ["--config", _prefs(t, "dup.yaml", "model:\n  init_args:\n    beta: 0.1\n    beta: 0.5\n")],
        "config",
        ["dup.yaml: Problems parsing config: duplicate key 'beta' (lines 3 and 4)"],
        True,
    ),
    "data-malformed-json": (
        _dpo,
        lambda t: ["--data.init_args.data_path", _prefs(t, "m.jsonl", _row() + '{"prompt":\n')],
        "data",
        ["m.jsonl, row 2: malformed JSON"],
        False,
    ),
    "data-not-an-object": (
        _dpo,
        lambda t: ["--data.init_args.data_path", _prefs(t, "l.jsonl", _row() + "[1, 2]\n")],
        "data",
        ["l.jsonl, row 2: expected a JSON object, got list"],
        False,
    ),
    "data-empty-text": (
        _dpo,
        lambda t: ["--data.init_args.data_path", _prefs(t, "e.jsonl", _row(prompt=" "))],
        "data",
        ["e.jsonl, row 1, field 'prompt': empty text"],
        False,
    ),
    "data-wrong-type": (
        _dpo,
        lambda t: ["--data.init_args.data_path", _prefs(t, "n.jsonl", _row() + _row(chosen=3))],
        "data",
        ["n.jsonl, row 2, field 'chosen'", "got int"],
        False,
    ),
    "data-not-utf8-jsonl": (
        _dpo,
        lambda t: [
            "--data.init_args.data_path",
            _prefs(t, "u.jsonl", (_row() + _row(chosen="caf\x00")).encode().replace(b"\\u0000", b"\xe9")),
        ],
        "data",
        ["u.jsonl, row 2, field 'chosen': not valid UTF-8 (byte 0xe9 at column"],
        False,
    ),
    "data-not-utf8-json": (
        _dpo,
        lambda t: ["--data.init_args.data_path", _prefs(t, "u.json", b'[\n{"prompt": "\xff"}\n]')],
        "data",
        ["u.json, row 2, field 'prompt': not valid UTF-8 (byte 0xff"],
        False,
    ),
    "data-unsupported-suffix": (
        _dpo,
        lambda t: ["--data.init_args.data_path", _prefs(t, "d.txt", "text")],
        "data",
        ["d.txt: unsupported file type"],
        False,
    ),
    "data-split-leaves-nothing": (
        _dpo,
        lambda t: ["--data.init_args.data_path", _prefs(t, "one.jsonl", _row()), "--data.init_args.val_split", "0.5"],
        "data",
        ["one.jsonl: val_split=0.5 leaves no training rows"],
        False,
    ),
    # config (the argument parser)
    "config-not-a-number": (
        _dpo,
        lambda t: ["--model.init_args.beta", "abc"],
        "config",
        ["--model.init_args.beta: Expected a <class 'float'>. Got value: abc"],
        True,
    ),
    "config-file-unknown-key": (  # a typo inside a YAML file is named by the file and the key, not as a flag
        _dpo,
        lambda t: ["--config", _prefs(t, "typo.yaml", "model:\n  init_args:\n    betta: 0.1\n")],
        "config",
        ["typo.yaml: model.init_args.betta: Option 'betta' is not accepted"],
        True,
    ),
    "config-file-unknown-trainer-key": (
        _dpo,
        lambda t: ["--config", _prefs(t, "epochs.yaml", "trainer:\n  max_epoch: 1\n")],
        "config",
        ["epochs.yaml: trainer.max_epoch: Subcommand 'fit' does not accept option 'trainer.max_epoch'"],
        True,
    ),
    "config-abbreviated-option": (  # argparse's abbreviations are off: --trainer.max_epoch is not max_epochs
        _dpo,
        lambda t: ["--trainer.max_epoch", "1"],
        "config",
        ["unrecognized arguments: --trainer.max_epoch 1"],
        True,
    ),
    "config-unknown-model-option": (
        _dpo,
        lambda t: ["--model.init_args.betta", "0.1"],
        "config",
        ["--model.init_args.betta: Option 'betta' is not accepted"],
        True,
    ),
    "config-unknown-trainer-option": (
        _dpo,
        lambda t: ["--trainer.max_stepz", "3"],
        "config",
        ["unrecognized arguments: --trainer.max_stepz"],
        True,
    ),
    "config-bad-class-path": (
        _dpo,
        lambda t: ["--model", "nosuch.Module"],
        "config",
        ["--model:", "nosuch.Module"],
        True,
    ),
    "config-bad-trainer-value": (
        _dpo,
        lambda t: ["--trainer.max_steps", "many"],
        "config",
        ["--trainer.max_steps: Expected a <class 'int'>. Got value: many"],
        True,
    ),
    # hyperparameters (the range table, before any model is loaded)
    "hp-beta": (
        _dpo,
        lambda t: ["--model.init_args.beta", "-0.1"],
        "hyperparameter",
        ["DPOModule.beta: must be > 0, got -0.1"],
        True,
    ),
    "hp-label-smoothing": (
        _dpo,
        lambda t: ["--model.init_args.label_smoothing", "0.7"],
        "hyperparameter",
        ["DPOModule.label_smoothing: must be 0 <= value < 0.5, got 0.7"],
        True,
    ),
    "hp-learning-rate": (
        _dpo,
        lambda t: ["--model.init_args.learning_rate", "0"],
        "hyperparameter",
        ["DPOModule.learning_rate: must be 0 < value <= 3.40282e+38, got 0.0"],
        True,
    ),
    "hp-warmup-ratio": (
        _dpo,
        lambda t: ["--model.init_args.warmup_ratio", "1.5"],
        "hyperparameter",
        ["DPOModule.warmup_ratio: must be 0 <= value <= 1, got 1.5"],
        True,
    ),
    "hp-lr-schedule": (
        _dpo,
        lambda t: ["--model.init_args.lr_schedule", "step"],
        "hyperparameter",
        ["DPOModule.lr_schedule: unknown lr_schedule 'step'; must be one of 'linear', 'cosine', 'constant'"],
        True,
    ),
    "hp-loss-type": (
        _dpo,
        lambda t: ["--model.init_args.loss_type", "kto"],
        "hyperparameter",
        ["DPOModule.loss_type: unknown loss_type 'kto'; must be one of", "'sigmoid'"],
        True,
    ),
    "hp-dtype": (
        _dpo,
        lambda t: ["--model.init_args.dtype", "float8"],
        "hyperparameter",
        ["DPOModule.dtype: unknown dtype 'float8'; must be one of", "'bfloat16'"],
        True,
    ),
    "hp-lora-rank": (
        _dpo,
        lambda t: ["--model.init_args.lora", '{"r": 0}'],
        "hyperparameter",
        ["DPOModule.lora.r: must be >= 1 (an integer), got 0"],
        True,
    ),
    "hp-batch-size": (
        _dpo,
        lambda t: ["--data.init_args.batch_size", "0"],
        "hyperparameter",
        ["PreferenceDataModule.batch_size: must be >= 1 (an integer), got 0"],
        True,
    ),
    "hp-val-split": (
        _dpo,
        lambda t: ["--data.init_args.val_split", "1.0"],
        "hyperparameter",
        ["PreferenceDataModule.val_split: must be 0 <= value < 1, got 1.0"],
        True,
    ),
    "hp-prompt-longer-than-max": (
        _dpo,
        lambda t: ["--data.init_args.max_prompt_length", "200"],
        "hyperparameter",
        ["PreferenceDataModule.max_prompt_length: must be < max_length (96), got 200"],
        True,
    ),
    "hp-mini-batch-size": (
        _ppo,
        lambda t: ["--model.init_args.mini_batch_size", "0"],
        "hyperparameter",
        ["PPOModule.mini_batch_size: must be >= 1 (an integer), got 0"],
        True,
    ),
    "hp-num-iterations": (
        _ppo,
        lambda t: ["--model.init_args.num_iterations", "0"],
        "hyperparameter",
        ["PPOModule.num_iterations: must be >= 1 (an integer), got 0"],
        True,
    ),
    "hp-kl-coef": (
        _ppo,
        lambda t: ["--model.init_args.kl_coef", "-0.01"],
        "hyperparameter",
        ["PPOModule.kl_coef: must be >= 0, got -0.01"],
        True,
    ),
    "hp-gamma": (
        _ppo,
        lambda t: ["--model.init_args.gamma", "1.5"],
        "hyperparameter",
        ["PPOModule.gamma: must be 0 < value <= 1, got 1.5"],
        True,
    ),
    "hp-kl-estimator": (
        _ppo,
        lambda t: ["--model.init_args.kl_estimator", "k9"],
        "hyperparameter",
        ["PPOModule.kl_estimator: unknown kl_estimator 'k9'; must be one of 'k1', 'k2', 'k3'"],
        True,
    ),
    "hp-generation-temperature": (
        _ppo,
        lambda t: ["--model.init_args.generation.temperature", "0"],
        "hyperparameter",
        ["PPOModule.generation.temperature: must be > 0, got 0.0"],
        True,
    ),
    "hp-generation-top-p": (
        _ppo,
        lambda t: ["--model.init_args.generation.top_p", "0"],
        "hyperparameter",
        ["PPOModule.generation.top_p: must be 0 < value <= 1, got 0.0"],
        True,
    ),
    "hp-reward-dropout": (
        _reward,
        lambda t: ["--model.init_args.dropout_prob", "1.0"],
        "hyperparameter",
        ["RewardModule.dropout_prob: must be 0 <= value < 1, got 1.0"],
        True,
    ),
    "hp-reward-temperature": (
        _reward,
        lambda t: ["--model.init_args.temperature", "-1"],
        "hyperparameter",
        ["RewardModule.temperature: must be > 0, got -1.0"],
        True,
    ),
    "config-file-not-yaml": (
        _dpo,
        lambda t: ["--config", _prefs(t, "bad.yaml", "model: [unclosed\n")],
        "config",
        ["bad.yaml: Problems parsing config", "line 2, column 1"],
        True,
    ),
    "config-file-missing": (
        _dpo,
        lambda t: ["--config", str(t / "none.yaml")],
        "config",
        ["--config: File does not exist", "none.yaml"],
        True,
    ),
    # models
    "model-missing-folder": (
        _dpo,
        lambda t: ["--model.init_args.model_config", "null", "--model.init_args.model_name", str(t / "no-model")],
        "model",
        ["DPOModule.model_name: folder", "no-model' not found"],
        True,
    ),
    "model-missing-tokenizer": (
        _dpo,
        lambda t: ["--model.init_args.tokenizer_name", "./no-tokenizer"],
        "model",
        ["DPOModule.tokenizer_name: folder './no-tokenizer' not found"],
        True,
    ),
    "model-malicious-pickle": (
        _dpo,
        lambda t: ["--model.init_args.model_config", "null", "--model.init_args.model_name", _evil_model_folder(t)],
        "model",
        ["pytorch_model.bin: cannot load the model: refused by torch.load(weights_only=True)", "posix.system"],
        False,
    ),
    "checkpoint-malicious-pickle": (
        _dpo,
        lambda t: ["--ckpt_path", _evil_checkpoint(t)],
        "model",
        ["--ckpt_path ", "evil.ckpt: refused by torch.load(weights_only=True)", "GLOBAL posix.system"],
        False,
    ),
    "config-output-dir-is-a-file": (
        _dpo,
        lambda t: ["--output_dir", str(_a_file(t))],
        "config",
        ["--output_dir ", "a_file: is a file, not a folder"],
        True,
    ),
    "config-output-dir-not-writable": (
        _dpo,
        lambda t: ["--output_dir", str(_a_file(t) / "run")],
        "config",
        ["a_file/run: cannot be written: Not a directory"],
        True,
    ),
    "model-corrupt-weights": (
        _dpo,
        lambda t: [
            "--model.init_args.model_config",
            "null",
            "--model.init_args.model_name",
            _model_folder(t, corrupt=True),
        ],
        "model",
        ["model/model.safetensors: cannot load the model: SafetensorError"],
        False,
    ),
    "model-unknown-type": (
        _dpo,
        lambda t: ["--model.init_args.model_config", '{"model_type": "lama"}'],
        "model",
        ["model_config.model_type: unknown model type 'lama'"],
        False,
    ),
    "model-not-a-model-folder": (
        _dpo,
        lambda t: ["--model.init_args.model_config", "null", "--model.init_args.model_name", str(_mkdir(t / "empty"))],
        "model",
        ["empty: cannot load the model"],
        False,
    ),
    # reward sources: building them
    "reward-missing-folder": (
        _ppo,
        lambda t: ["--model.init_args.reward", str(t / "no-rm")],
        "reward",
        ["PPOModule.reward: folder", "no-rm' not found"],
        True,
    ),
    "reward-not-importable": (
        _ppo,
        lambda t: ["--model.init_args.reward", "no_such_pkg.rewards:score"],
        "reward",
        ["reward source 'no_such_pkg.rewards:score': cannot import module 'no_such_pkg.rewards'"],
        False,
    ),
    "reward-no-such-function": (
        _ppo,
        lambda t: ["--model.init_args.reward", "aitraining_pl.rewards:nope"],
        "reward",
        ["reward source 'aitraining_pl.rewards:nope': module 'aitraining_pl.rewards' has no attribute 'nope'"],
        False,
    ),
    "reward-folder-without-config": (
        _ppo,
        lambda t: ["--model.init_args.reward", _reward_folder(t, "reward_config.json", "config.json")],
        "reward",
        ["rm: cannot build:", "reward_config.json"],
        False,
    ),
    "reward-corrupt-weights": (
        _ppo,
        lambda t: ["--model.init_args.reward", _reward_folder(t, "model.safetensors")],
        "reward",
        ["rm/model.safetensors: cannot build: SafetensorError"],
        False,
    ),
    # reward sources: what they do when called
    "reward-raises": (
        _ppo,
        lambda t: ["--model.init_args.reward", "test_cli_errors:raising_reward"],
        "reward",
        ["reward source 'raising_reward': raised KeyError: 'answer' at index 1"],
        False,
    ),
    "reward-returns-strings": (
        _ppo,
        lambda t: ["--model.init_args.reward", "test_cli_errors:string_reward"],
        "reward",
        ["reward source 'string_reward': returned a str ('high') at index 1, not a float"],
        False,
    ),
    "reward-sleeps": (
        _ppo,
        lambda t: [
            "--model.init_args.reward",
            "test_cli_errors:sleeping_reward",
            "--model.init_args.reward_timeout",
            "1",
        ],
        "reward",
        ["reward source 'sleeping_reward': did not return within 1 s (reward_timeout)"],
        False,
    ),
    "reward-os-exit": (
        _ppo,
        lambda t: ["--model.init_args.reward", "test_cli_errors:os_exit_reward"],
        "reward",
        ["reward source 'os_exit_reward': called os._exit(0) at index 0"],
        False,
    ),
    "hp-reward-timeout": (
        _ppo,
        lambda t: ["--model.init_args.reward_timeout", "0"],
        "hyperparameter",
        ["PPOModule.reward_timeout: must be > 0 or null, got 0"],
        True,
    ),
    "reward-system-exit": (
        _ppo,
        lambda t: ["--model.init_args.reward", "test_cli_errors:exiting_reward"],
        "reward",
        ["reward source 'exiting_reward': raised SystemExit (sys.exit(0)) at index 0"],
        False,
    ),
    "reward-wrong-length": (
        _ppo,
        lambda t: ["--model.init_args.reward", "test_cli_errors:short_reward"],
        "reward",
        ["reward source 'short_reward': returned 1 scores for 2 responses"],
        False,
    ),
    "reward-nan": (
        _ppo,
        lambda t: ["--model.init_args.reward", "test_cli_errors:nan_reward"],
        "reward",
        ["reward source 'nan_reward': returned a non-finite score (nan) at index 1"],
        False,
    ),
}


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _refuse_loading(*args, **kwargs):
    raise AssertionError("a model was loaded before the arguments were validated")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys, monkeypatch):
    config, extra, what, expected, before_load = CASES[case]
    args = config(tmp_path) + extra(tmp_path)
    if before_load:  # validation must fail first: loading a model here is an internal error (traceback)
        monkeypatch.setattr(base_module, "load_policy", _refuse_loading)
        monkeypatch.setattr(RewardModule, "build_reward_model", _refuse_loading)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    messages = [line for line in err.splitlines() if line.startswith("aitraining-pl: ")]
    assert info.value.code == 2, err
    assert len(messages) == 1 and "Traceback" not in err, err
    message = messages[0]
    assert message.startswith(f"aitraining-pl: {what} error: "), message
    for part in expected:
        assert part in message, message
    assert len(message) < 500, message
    assert not list(tmp_path.glob("csv/v/metrics.csv")) or what == "reward"  # nothing trained
    assert not (tmp_path / "EXPLOITED").exists()  # a malicious pickle ran nothing


@pytest.mark.slow
@pytest.mark.parametrize("case", ["config-not-a-number", "hp-num-iterations", "reward-system-exit", "reward-os-exit"])
def test_console_command_prints_one_line_and_exits_2(case, tmp_path):
    """The real command in its own process: exit status 2 and the message as the last line of stderr (Lightning's
    own log lines, such as "Seed set to 0", may come before it), no usage dump, no traceback."""
    config, extra, what, expected, _ = CASES[case]
    tests = str(Path(__file__).resolve().parent)
    path = os.pathsep.join([tests, os.path.join(tests, "helpers"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "aitraining_pl.cli", *config(tmp_path), *extra(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines[-1].startswith(f"aitraining-pl: {what} error: ") and all(part in lines[-1] for part in expected)
    assert sum(line.startswith("aitraining-pl:") for line in lines) == 1
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr


def test_internal_errors_keep_their_traceback(tmp_path, monkeypatch):
    """A bug (not the user's input) is not turned into a one-line message: the exception propagates (jsonargparse
    wraps errors raised while building the model; the bug is its cause)."""
    monkeypatch.setattr(base_module, "load_policy", lambda *a, **k: (_ for _ in ()).throw(ZeroDivisionError("bug")))
    with pytest.raises(Exception) as info:
        main(_dpo(tmp_path))
    chain, err = [], info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert not isinstance(info.value, SystemExit) and any(isinstance(e, ZeroDivisionError) for e in chain)


def test_at_least_25_cases_across_every_kind():
    kinds = {what for _, _, what, _, _ in CASES.values()}
    assert len(CASES) >= 25 and kinds == {"data", "config", "hyperparameter", "model", "reward"}


def test_a_failing_component_is_named_once():
    """A component of a weighted reward that fails is named with its index, not wrapped again."""
    from aitraining_pl.rewards import RewardError, WeightedRewards, score_responses

    source = WeightedRewards({"ok": lambda p, r, m: [1.0] * len(r), "bad": string_reward})
    with pytest.raises(RewardError) as info:
        score_responses(source, ["a", "b"], ["x", "y"], [{}, {}])
    assert str(info.value) == "reward source 'bad': returned a str ('high') at index 1, not a float"


def test_python_construction_is_validated_before_loading(monkeypatch):
    """The same table guards modules and data modules built in Python (no CLI)."""
    from aitraining_pl.datamodules.preference import PreferenceDataModule
    from aitraining_pl.errors import HyperparameterError
    from aitraining_pl.modules.dpo import DPOModule
    from aitraining_pl.modules.ppo import PPOModule

    monkeypatch.setattr(base_module, "load_policy", _refuse_loading)
    monkeypatch.setattr(RewardModule, "build_reward_model", _refuse_loading)
    with pytest.raises(HyperparameterError, match=r"DPOModule.beta: must be > 0, got 0"):
        DPOModule(model_config=dict(TINY_LLAMA), tokenizer_name="byte", beta=0)
    with pytest.raises(HyperparameterError, match=r"PPOModule.generation.max_new_tokens: must be >= 1"):
        PPOModule(
            reward=TOY_REWARD, model_config=dict(TINY_LLAMA), tokenizer_name="byte", generation={"max_new_tokens": 0}
        )
    with pytest.raises(HyperparameterError, match=r"RewardModule.center_rewards_coefficient: must be >= 0, got -1"):
        RewardModule(model_config=dict(TINY_LLAMA), tokenizer_name="byte", center_rewards_coefficient=-1)
    with pytest.raises(HyperparameterError, match=r"PreferenceDataModule.eval_batch_size: must be >= 1"):
        PreferenceDataModule(data_path="x.jsonl", tokenizer="byte", eval_batch_size=0)


@pytest.mark.parametrize(
    "name, good, bad",
    [
        ("beta", 1e-3, 0.0),
        ("label_smoothing", 0.0, 0.5),
        ("gamma", 1.0, 0.0),
        ("lam", 0.0, -0.1),
        ("top_k", 0, -1),
        ("max_grad_norm", None, -1.0),
        ("mini_batch_size", 1, 1.5),
        ("learning_rate", 1.0, float("nan")),
        ("num_generations", 2, True),
        ("epsilon_high", None, 0.0),
        ("lr_schedule", "cosine", "step"),
    ],
)
def test_range_table_bounds(name, good, bad):
    """Each bound is where the table says: inclusive/exclusive ends, integers, null, NaN, booleans."""
    from aitraining_pl.validation import CONSTRAINTS

    assert CONSTRAINTS[name].allows(good) and not CONSTRAINTS[name].allows(bad)
