"""The ``aitraining-pl`` command: a LightningCLI in subclass mode.

    aitraining-pl fit --config configs/quickstart/dpo.yaml
    aitraining-pl fit --config configs/dpo.yaml --model.init_args.beta 0.2 --trainer.devices 2
    aitraining-pl fit --config configs/quickstart/dpo.yaml --print_config

``model:`` and ``data:`` take a ``class_path`` (any LightningModule / LightningDataModule, e.g.
``aitraining_pl.modules.dpo.DPOModule``) and ``init_args``. The tokenizer is loaded once by the model and
handed to the data module (``data.init_args.tokenizer`` is linked from ``model.tokenizer``), so it is
named only once, in the model. Every model class used with this CLI therefore has a ``tokenizer``
attribute after ``__init__``, and every data module class a ``tokenizer`` argument.

Every user-caused failure (bad data, option, model or reward folder, reward-source behaviour, hyperparameter
range; the typed errors of ``aitraining_pl.errors``) is printed as one line on stderr,
``aitraining-pl: <what> error: <where>: <why>``, and the command exits with status 2, before training starts
where the input allows. Internal errors keep their traceback; set ``AITRAINING_PL_DEBUG=1`` to see the full
traceback of a user error too.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from aitraining_pl.callbacks.guard import NonFiniteError
from aitraining_pl.datamodules.io import DataValidationError  # noqa: F401 - a UserError (``what = "data"``)
from aitraining_pl.errors import ConfigError, UserError
from aitraining_pl.validation import check_hparams

#: Errors that are the user's to fix: printed as one line, exit status 2. ``UserError`` (data, config,
#: hyperparameter, model, reward) carries its own kind; the others are printed as ``input error`` (a NaN/inf
#: loss or gradient norm comes from the data or the hyperparameters, e.g. a learning rate that blows up).
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, FileNotFoundError, ValueError, NonFiniteError)


class AlignmentCLI(LightningCLI):
    """LightningCLI with model and data in subclass mode and the tokenizer linked from model to data."""

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # a bad option raises (``parser_error`` turns it into one line) instead of printing the usage dump
        return super().init_parser(**{"exit_on_error": False, **kwargs})

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.tokenizer", "data.init_args.tokenizer", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        """Check the model's and the data module's arguments against the range table before either is built,
        so a bad data argument fails before any model is loaded (the bases check them again when built from
        Python)."""
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        for key in ("model", "data"):
            section = config.get(key) if config is not None else None
            init_args = getattr(section, "init_args", None)
            if init_args is not None:
                owner = str(getattr(section, "class_path", key)).rpartition(".")[2]
                check_hparams(init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args), owner)


def _chain(err: Optional[BaseException]):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _user_error(err: BaseException) -> Optional[BaseException]:
    """The user error behind ``err``, or None. jsonargparse and Lightning wrap errors raised while building
    the model or data (a ``ValueError`` with the parser's dump), so a typed ``UserError`` anywhere in the
    chain wins over the generic errors around it, and a generic one counts only as the root cause."""
    chain = list(_chain(err))
    typed = [e for e in chain if isinstance(e, UserError)]
    if typed:
        return typed[-1]
    root = chain[-1]  # a generic error counts only as the root cause (not jsonargparse's wrapper of a bug)
    return root if isinstance(root, USER_ERRORS) else None


#: lines of jsonargparse's union/class_path dump that say nothing about the problem.
_DUMP_LINES = ("Does not validate against", "Subtypes:", "Errors:", "- Problem with given class_path",
               "- Expected a <class 'NoneType'>", "Given value type:", "Given value:", "tip:", "usage:")


def parser_error(err: BaseException, args: Optional[list[str]] = None) -> ConfigError:
    """A jsonargparse error (``Parser key "model": ... Parser key "beta": Expected ...``, a 7-line dump) as
    one ``ConfigError`` naming the option (``--model.init_args.beta``) and the innermost reason; a config file
    that is not valid YAML is named by its path (from ``args``, default ``sys.argv``)."""
    lines = [line.strip() for line in str(err).replace(' in "<unicode string>",', "").splitlines() if line.strip()]
    if lines and lines[0].startswith("Problems parsing config"):
        argv = list(sys.argv[1:] if args is None else args)
        files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
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
    nested = len(keys) > 1 and any(line.startswith("- Problem with given class_path") for line in lines)
    option = keys[0] + (".init_args." if nested else ".") + ".".join(keys[1:]) if len(keys) > 1 else "".join(keys)
    why = (why or (lines[0] if lines else type(err).__name__)).lstrip("- ")
    return ConfigError(f"--{option}" if option else "command line", why[:400])


def format_error(err: BaseException) -> str:
    """``aitraining-pl: <what> error: <where>: <why>``, on one line. ``what`` is the error's ``what`` attribute
    (every ``UserError``; another class listed in ``USER_ERRORS`` may set one too), else ``input``."""
    if isinstance(getattr(err, "what", None), str):
        what, text = err.what, str(err)
    else:
        what, text = "input", f"{type(err).__name__}: {err}"
    text = " ".join(text.split())
    return f"aitraining-pl: {what} error: {text if len(text) <= 500 else text[:497] + '...'}"


def build_cli(args: Optional[list[str]] = None, run: bool = True) -> AlignmentCLI:
    """Parse ``args`` (default ``sys.argv[1:]``), build model, data and trainer, and (``run``) run the
    subcommand; returns the CLI object (``.model``, ``.datamodule``, ``.trainer``). Errors propagate."""
    return AlignmentCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
        auto_configure_optimizers=False,
    )


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of ``aitraining-pl``: ``build_cli`` with user errors turned into one message and exit
    status 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        build_cli(args)
    except argparse.ArgumentError as err:  # jsonargparse's errors: a bad option or config value
        if os.environ.get("AITRAINING_PL_DEBUG"):
            raise
        print(format_error(parser_error(err, args)), file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as err:  # noqa: BLE001 - only user errors are turned into a message
        user = _user_error(err)
        if user is None or os.environ.get("AITRAINING_PL_DEBUG"):
            raise
        print(format_error(user), file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    main()
