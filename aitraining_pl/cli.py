"""The ``aitraining-pl`` command: a LightningCLI in subclass mode.

    aitraining-pl fit --config configs/quickstart/dpo.yaml
    aitraining-pl fit --config configs/dpo.yaml --model.init_args.beta 0.2 --trainer.devices 2
    aitraining-pl fit --config configs/quickstart/dpo.yaml --print_config

``model:`` and ``data:`` take a ``class_path`` (any LightningModule / LightningDataModule, e.g.
``aitraining_pl.modules.dpo.DPOModule``) and ``init_args``. The tokenizer is loaded once by the model and
handed to the data module (``data.init_args.tokenizer`` is linked from ``model.tokenizer``), so it is
named only once, in the model. Every model class used with this CLI therefore has a ``tokenizer``
attribute after ``__init__``, and every data module class a ``tokenizer`` argument.

Bad input (``DataValidationError`` and other user errors) is printed as one message and the command exits
with status 2; set ``AITRAINING_PL_DEBUG=1`` to see the full traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from aitraining_pl.callbacks.guard import NonFiniteError
from aitraining_pl.datamodules.io import DataValidationError

#: Errors that are the user's to fix: printed as one line, exit status 2 (a NaN/inf loss or gradient norm
#: comes from the data or the hyperparameters, e.g. a learning rate that blows up).
USER_ERRORS: tuple[type[BaseException], ...] = (DataValidationError, FileNotFoundError, ValueError, NonFiniteError)


class AlignmentCLI(LightningCLI):
    """LightningCLI with model and data in subclass mode and the tokenizer linked from model to data."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.tokenizer", "data.init_args.tokenizer", apply_on="instantiate")


def _user_error(err: BaseException) -> Optional[BaseException]:
    """The user error behind ``err`` (jsonargparse and Lightning may wrap it), or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, USER_ERRORS):
            return err
        err = err.__cause__ or err.__context__
    return None


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
    except Exception as err:  # noqa: BLE001 - only user errors are turned into a message
        user = _user_error(err)
        if user is None or os.environ.get("AITRAINING_PL_DEBUG"):
            raise
        name = "data error" if isinstance(user, DataValidationError) else type(user).__name__
        print(f"aitraining-pl: {name}: {user}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    main()
