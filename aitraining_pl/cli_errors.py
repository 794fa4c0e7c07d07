"""Error translation of the ``aitraining-pl`` command: a user-caused failure (a typed ``aitraining_pl.errors``
error anywhere in the chain jsonargparse and Lightning wrap around it, a jsonargparse parser error, a refused
checkpoint) becomes one line, ``aitraining-pl: <what> error: <where>: <why>``; SIGTERM becomes ``Terminated``
(exit status 143) with a line naming the last checkpoint."""

from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path
from typing import Any

from aitraining_pl.callbacks.guard import NonFiniteError
from aitraining_pl.datamodules.io import DataValidationError  # noqa: F401 - a UserError (``what = "data"``)
from aitraining_pl.errors import ConfigError, HyperparameterError, ModelLoadError, UserError
from aitraining_pl.models.loading import one_line

#: Errors that are the user's to fix: printed as one line, exit status 2. ``UserError`` (data, config,
#: hyperparameter, model, reward) carries its own kind; the others are printed as ``input error`` (a NaN/inf
#: loss or gradient norm comes from the data or the hyperparameters, e.g. a learning rate that blows up).
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, FileNotFoundError, ValueError, NonFiniteError)


class Terminated(Exception):
    """The run got SIGTERM (a scheduler's preemption or ``kill``); ``main`` prints the message and exits with
    status 143 (128 + SIGTERM), as a process killed by the signal would."""

    exit_code = 143


def last_checkpoint(trainer: Any) -> str:
    """The newest checkpoint file the run's checkpoint callbacks wrote, or ``""``."""
    paths = []
    for callback in getattr(trainer, "checkpoint_callbacks", None) or []:
        paths += [getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", "")]
        paths += list(getattr(callback, "best_k_models", None) or {})
    existing = [Path(p) for p in paths if p and Path(p).is_file()]
    return str(max(existing, key=lambda p: p.stat().st_mtime)) if existing else ""


def terminated_line(trainer: Any) -> str:
    """``aitraining-pl: stopped by SIGTERM after N steps; last checkpoint: <path> (resume: --ckpt_path <path>)``."""
    path = last_checkpoint(trainer) if trainer is not None else ""
    step = getattr(trainer, "global_step", 0)
    where = f"last checkpoint: {path} (resume with --ckpt_path {path})" if path else "no checkpoint was written"
    return f"aitraining-pl: stopped by SIGTERM after {step} steps; {where}"


def _chain(err: BaseException | None):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _user_error(err: BaseException, args: list[str] | None = None) -> BaseException | None:
    """The user error behind ``err``, or None. jsonargparse and Lightning wrap errors raised while building
    the model or data (a ``ValueError`` with the parser's dump), so a typed ``UserError`` anywhere in the
    chain wins over the generic errors around it, and a generic one counts only as the root cause. A checkpoint
    that ``torch.load(weights_only=True)`` refuses (``--ckpt_path``) is a ``ModelLoadError`` naming it."""
    chain = list(_chain(err))
    typed = [e for e in chain if isinstance(e, UserError)]
    if typed:
        return typed[-1]
    refused = next((e for e in chain if isinstance(e, pickle.UnpicklingError)), None)
    if refused is not None:
        argv = list(args or [])
        paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--ckpt_path"]
        paths += [a.split("=", 1)[1] for a in argv if a.startswith("--ckpt_path=")]
        return ModelLoadError(f"--ckpt_path {paths[-1]}" if paths else "checkpoint", one_line(refused))
    root = chain[-1]  # a generic error counts only as the root cause (not jsonargparse's wrapper of a bug)
    return root if isinstance(root, USER_ERRORS) else None


#: lines of jsonargparse's union/class_path dump that say nothing about the problem.
_DUMP_LINES = (
    "Does not validate against",
    "Subtypes:",
    "Errors:",
    "- Problem with given class_path",
    "- Expected a <class 'NoneType'>",
    "Given value type:",
    "Given value:",
    "tip:",
    "usage:",
)


def parser_error(err: BaseException, args: list[str] | None = None) -> UserError:
    """A jsonargparse error (``Parser key "model": ... Parser key "beta": Expected ...``, a 7-line dump) as
    one ``ConfigError`` naming the option (``--model.init_args.beta``) and the innermost reason; a config file
    that is not valid YAML is named by its path (from ``args``, default ``sys.argv``). A value outside a
    ``Literal`` argument's choices is a ``HyperparameterError`` worded as the range table words it."""
    lines = [line.strip() for line in str(err).replace(' in "<unicode string>",', "").splitlines() if line.strip()]
    argv = list(sys.argv[1:] if args is None else args)
    if lines and lines[0].startswith("Problems parsing config"):
        files = _config_files(argv)
        return ConfigError(f"--config {files[-1]}" if files else "--config", " ".join(lines)[:400])
    keys, why = [], None
    for line in lines:
        key = re.match(r'Parser key "([^"]+)":?\s*(.*)', line)
        if key:
            keys.append(key.group(1))
            why = key.group(2) or why
        elif why is None or why.startswith(_DUMP_LINES):
            why = line if not line.startswith(_DUMP_LINES) else why
    unknown = re.search(r"Option '([^']+)' is not accepted", " ".join(lines))
    keys += [unknown.group(1)] if unknown else []
    refused = re.search(r"does not accept option '([^']+)'", " ".join(lines))  # a whole unknown section key
    keys = keys or ([refused.group(1)] if refused else [])
    nested = len(keys) > 1 and any(line.startswith("- Problem with given class_path") for line in lines)
    option = keys[0] + (".init_args." if nested else ".") + ".".join(keys[1:]) if len(keys) > 1 else "".join(keys)
    why = (why or (lines[0] if lines else type(err).__name__)).lstrip("- ")
    choice = re.match(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)", why)
    if choice is None:  # a Literal inside a Union (a name or a list of names, as DPO's loss_type)
        literal = next((x for x in lines if x.startswith("- Expected a typing.Literal[")), None)
        given = next((x for x in lines if x.startswith("Given value: ")), None)
        if literal and given:
            choice = re.match(
                r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)",
                f"{literal[2:].rstrip('.')}. Got value: {given[len('Given value: ') :]}",
            )
    owner = re.search(r"class_path '([\w.]+)'", " ".join(lines))
    if choice and keys:  # a choice outside a Literal: worded as the range table words it
        name, value = keys[-1], choice.group(2).strip()
        where = f"{owner.group(1).rpartition('.')[2]}.{name}" if owner else f"--{option}"
        return HyperparameterError(where, f"unknown {name} {value!r}; must be one of {choice.group(1)}")
    where = _config_file_key(option, argv) or (f"--{option}" if option else "command line")
    return ConfigError(where, why[:400])


def _config_files(argv: list[str]) -> list[str]:
    """The ``--config`` files of ``argv``, in order."""
    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    return files + [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]


def _config_file_key(option: str, argv: list[str]) -> str | None:
    """``"<file>: <key>"`` for an option that is not on the command line but in a ``--config`` file (the last
    one that holds it; a file may leave out ``init_args``), so a typo in a file is named by file and key."""
    if not option or any(a == f"--{option}" or a.startswith(f"--{option}=") for a in argv):
        return None
    import yaml

    for path in reversed(_config_files(argv)):
        try:
            node = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError):
            continue
        for part in option.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif part != "init_args" or not isinstance(node, dict):
                break
        else:
            return f"{path}: {option}"
    return None


def format_error(err: BaseException) -> str:
    """``aitraining-pl: <what> error: <where>: <why>``, on one line. ``what`` is the error's ``what`` attribute
    (every ``UserError``; another class listed in ``USER_ERRORS`` may set one too), else ``input``."""
    if isinstance(getattr(err, "what", None), str):
        what, text = err.what, str(err)
    else:
        what, text = "input", f"{type(err).__name__}: {err}"
    text = " ".join(text.split())
    return f"aitraining-pl: {what} error: {text if len(text) <= 500 else text[:497] + '...'}"
