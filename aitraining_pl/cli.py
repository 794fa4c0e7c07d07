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
traceback of a user error too. SIGTERM (a scheduler's preemption) ends the run with exit status 143 and one line
naming the last checkpoint written.

``aitraining-pl vllm-serve --model MODEL`` starts vLLM's own ``vllm serve`` with the flags a run's generation server
needs (``aitraining_pl.generation.servers.vllm_serve``; docs/vllm.md, Server mode); this project's HF server is
``python -m aitraining_pl.generation.servers.hf_routes``. ``aitraining-pl serve`` (the frame protocol) is gone: one
line names these.

``aitraining-pl`` alone (or ``--help``) lists the modules and the recipes in ``configs/``; ``--version`` prints the
version. ``fit`` takes ``--output_dir`` (one folder for logs, checkpoints and exports), ``--run_name`` and
``--threads`` (CPU threads; see docs/cli.md). A closing line after ``fit`` gives the final metrics and the export.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from aitraining_pl.cli_errors import (  # noqa: F401 - re-exported: the command's error translation
    USER_ERRORS,
    Terminated,
    _user_error,
    format_error,
    parser_error,
    terminated_line,
)
from aitraining_pl.cli_help import (  # noqa: F401 - re-exported: the command's help
    MODULES,
    NESTED_HELP,
    _import,
    available_modules,
    nested_help,
    overview,
    recipes,
    version,
)
from aitraining_pl.errors import ConfigError
from aitraining_pl.validation import RenamedArgumentWarning, check_arguments


class _DropRecord(logging.Filter):
    """Drops log records whose message starts with one of ``prefixes`` (Lightning's advertisement)."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefixes)


def quiet_known_noise() -> None:
    """Silence, narrowly, output that says nothing to a user of this command: Lightning's litlogger
    advertisement, and Lightning's own use of a torch API torch deprecated (``LeafSpec``, lightning/pytorch/
    utilities/_pytree.py)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropRecord) for f in logger.filters):
            logger.addFilter(
                _DropRecord(
                    "💡 Tip: For seamless cloud logging",  # the litlogger advertisement
                    "Trainer already configured with model summary callbacks: [<class 'aitraining_pl.callbacks.summary",
                )
            )
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", module=r"lightning\..*")
    warnings.simplefilter("default", RenamedArgumentWarning)  # a DeprecationWarning, hidden outside __main__


def strict_yaml_load(stream: str) -> Any:
    """jsonargparse's YAML loader, except that a mapping that gives a key twice (``beta`` twice: the second
    would silently win) is a ``yaml.YAMLError`` naming the key and both lines."""
    import yaml
    from jsonargparse._loaders_dumpers import get_yaml_default_loader, yaml_load

    class UniqueKeys(get_yaml_default_loader()):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (lines {seen[key] + 1} and {key_node.start_mark.line + 1})"
                    )
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    yaml.load(stream, Loader=UniqueKeys)
    return yaml_load(stream)


class AlignmentCLI(LightningCLI):
    """LightningCLI with model and data in subclass mode and the tokenizer linked from model to data."""

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        import yaml
        from jsonargparse import set_loader

        # a key given twice in a config file is an error, not the last one wins
        set_loader("yaml", strict_yaml_load, exceptions=(yaml.YAMLError,))
        # a bad option raises (``parser_error`` turns it into one line) instead of printing the usage dump; an
        # abbreviated option (``--trainer.max_epoch``) is refused, not read as the option it abbreviates
        return super().init_parser(**{"exit_on_error": False, "allow_abbrev": False, **kwargs})

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.tokenizer", "data.init_args.tokenizer", apply_on="instantiate")
        add_run_arguments(parser)

    def before_instantiate_classes(self) -> None:
        """Check the model's and the data module's arguments against their classes' ``argument_ranges`` before
        either is built, so a bad data argument fails before any model is loaded (each class checks its arguments
        when it is built, from Python too)."""
        import importlib

        config = self.config.get(self.subcommand) if self.subcommand else self.config
        for key in ("model", "data"):
            section = config.get(key) if config is not None else None
            init_args = getattr(section, "init_args", None)
            if init_args is not None:
                module, _, owner = str(getattr(section, "class_path", key)).rpartition(".")
                cls = getattr(importlib.import_module(module), owner, None) if module else None
                values = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args)
                check_arguments(getattr(cls, "argument_ranges", {}), values, owner)
        if config is not None:
            apply_run_arguments(config)

    def instantiate_trainer(self, **kwargs: Any):
        """The trainer, with ``CompactModelSummary`` unless the config names a model summary or turns it off."""
        from lightning.pytorch.callbacks import ModelSummary

        from aitraining_pl.callbacks.summary import CompactModelSummary

        config = self.config_init.get(self.subcommand) if self.subcommand else self.config_init
        trainer_config = config.get("trainer", {}) if config is not None else {}
        callbacks = trainer_config.get("callbacks") or []
        named = list(callbacks if isinstance(callbacks, list) else [callbacks])
        named += list(kwargs.get("callbacks") or [])  # ``kwargs`` replace the config's keys
        if trainer_config.get("enable_model_summary", True) is not False and not any(
            isinstance(c, ModelSummary) for c in named
        ):
            kwargs["callbacks"] = named + [CompactModelSummary()]
        return super().instantiate_trainer(**kwargs)

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except SIGTERMException:  # a SystemExit with no code (status 0): a scheduler would think the run finished
            raise Terminated(terminated_line(self.trainer)) from None

    def after_fit(self) -> None:
        """One closing line: the final metrics and where the model was exported."""
        if self.trainer.is_global_zero:
            print(closing_line(self.trainer), flush=True)


def add_run_arguments(parser: LightningArgumentParser) -> None:
    """``--output_dir``, ``--run_name`` and ``--threads`` (one place for output paths; CPU threads)."""
    parser.add_argument(
        "--output_dir",
        type=str | None,
        default=None,
        help="One folder for the run: loggers write to it (CSV/TensorBoard under csv/ and tensorboard/), "
        "checkpoints go to <output_dir>/checkpoints and exports to <output_dir>/export. Overrides the "
        "save_dir / dirpath of the recipe's loggers and callbacks.",
    )
    parser.add_argument(
        "--run_name",
        type=str | None,
        default=None,
        help="Name of the run: the W&B run name and the version folder of CSV/TensorBoard logs "
        "(default: W&B's own name; version_N).",
    )
    parser.add_argument(
        "--threads",
        type=int | None,
        default=None,
        help="CPU threads for torch (torch.set_num_threads; default: torch's, one per core). On a shared or "
        "small CPU machine 1 is often several times faster for the tiny quickstart models.",
    )


#: ``(class name, init argument)`` of the directory each known logger / callback writes to.
_LOG_DIRS = {"CSVLogger": "csv", "TensorBoardLogger": "tensorboard", "WandbLogger": None, "MLFlowLogger": None}
_CALLBACK_DIRS = {"ModelCheckpoint": "checkpoints", "HFExportCallback": "export"}


def _as_list(value: Any) -> list:
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def apply_run_arguments(config: Any) -> None:
    """Apply ``threads``, ``output_dir`` and ``run_name`` to the parsed config (a jsonargparse ``Namespace``).

    A logger's ``save_dir`` / ``name`` / ``version`` and the checkpoint and export ``dirpath`` are set from
    ``output_dir`` and ``run_name`` when given. A W&B logger never keeps a ``name`` carried over from another
    logger class (jsonargparse keeps ``init_args`` when ``--trainer.logger`` swaps the class): its ``name``
    is ``run_name`` or W&B's own."""
    threads = config.get("threads")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    output_dir, run_name = config.get("output_dir"), config.get("run_name")
    trainer = config.get("trainer")
    if trainer is None:
        return
    for logger in _as_list(trainer.get("logger")):
        kind = str(getattr(logger, "class_path", "")).rpartition(".")[2]
        args = getattr(logger, "init_args", None)
        if args is None or kind not in _LOG_DIRS:
            continue
        if output_dir is not None:
            args["save_dir"] = output_dir
        if _LOG_DIRS[kind] is None:  # W&B / MLflow: the run name
            if run_name is not None or args.get("name") in ("csv", "tensorboard", "lightning_logs"):
                args["name"] = run_name
        else:
            if output_dir is not None:
                args["name"] = _LOG_DIRS[kind]
            if run_name is not None:
                args["version"] = run_name
    if output_dir is None:
        return
    check_output_dir(output_dir)
    for callback in _as_list(trainer.get("callbacks")):
        kind = str(getattr(callback, "class_path", "")).rpartition(".")[2]
        args = getattr(callback, "init_args", None)
        if args is not None and kind in _CALLBACK_DIRS:
            args["dirpath"] = os.path.join(output_dir, _CALLBACK_DIRS[kind])
    if not _as_list(trainer.get("logger")):
        trainer["default_root_dir"] = output_dir


def check_output_dir(path: str) -> None:
    """``ConfigError`` naming ``--output_dir`` when it is a file, cannot be created, or cannot be written
    (before any model is loaded); creates the folder otherwise."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--output_dir {path}", "is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ConfigError(f"--output_dir {path}", f"cannot be written: {err.strerror or err}") from None


def closing_line(trainer: Any) -> str:
    """``aitraining-pl: done after N steps: <k>=<v> ...; export: <path>; checkpoint: <path>`` after a fit: the
    last ``train/loss`` and validation metrics (all ``train/`` metrics when there is no validation)."""
    headline = ("train/loss", "train/reward_mean", "train/kl", "train/rewards/accuracies")
    metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val/") or k in headline}
    metrics = metrics or {k: v for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
    shown = " ".join(f"{k}={float(v):.4g}" for k, v in sorted(metrics.items()) if getattr(v, "numel", lambda: 1)() == 1)
    parts = [f"aitraining-pl: done after {trainer.global_step} steps: {shown or 'no metrics logged'}"]
    for callback in trainer.callbacks:
        if type(callback).__name__ == "HFExportCallback" and getattr(callback, "dirpath", None) is not None:
            last = Path(callback.dirpath) / "last"
            parts.append(f"export: {last if last.exists() else callback.dirpath}")
    checkpoint = getattr(trainer, "checkpoint_callback", None)
    path = getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")
    if path:
        parts.append(f"checkpoint: {path}")
    return "; ".join(parts)


def build_cli(args: list[str] | None = None, run: bool = True) -> AlignmentCLI:
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


def importable_working_directory() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m`` does, so a ``module:function`` in the user's
    own file (``--model.init_args.reward myreward:has_digit``) imports without ``PYTHONPATH=.``."""
    cwd = os.getcwd()
    if not any(entry in ("", ".", cwd) for entry in sys.path):
        sys.path.insert(0, cwd)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``aitraining-pl``: ``build_cli`` with user errors turned into one message and exit
    status 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if args is None else args)
    if not argv or argv[0] in ("-h", "--help"):
        print(overview())
        if argv:
            print("\nLightning's options of each subcommand: aitraining-pl fit --help")
        raise SystemExit(0)
    if argv[0] == "--version":
        print(version())
        raise SystemExit(0)
    text = nested_help(argv)
    if text is not None:
        print(text)
        raise SystemExit(0)
    quiet_known_noise()
    importable_working_directory()
    try:
        if argv[0] == "vllm-serve":  # vLLM's own server with this project's flags (docs/vllm.md)
            from aitraining_pl.generation.servers.vllm_serve import main as vllm_serve

            vllm_serve(argv[1:])
            return
        if argv[0] == "tinker-serve":  # the tinker client's protocol on this project's models (docs/tinker.md)
            from aitraining_pl.tinker.serve import main as tinker_serve

            tinker_serve(argv[1:])
            return
        if argv[0] == "serve":  # the frame-protocol generation server, removed: one line naming what replaces it
            from aitraining_pl.generation.config import FRAME_PROTOCOL_GONE

            print(f"aitraining-pl serve: {FRAME_PROTOCOL_GONE}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        available_modules()  # imported: ``--model DPOModule`` resolves the short name
        build_cli(args)
    except Terminated as err:
        print(err, file=sys.stderr, flush=True)
        raise SystemExit(Terminated.exit_code) from None
    except argparse.ArgumentError as err:  # jsonargparse's errors: a bad option or config value
        if os.environ.get("AITRAINING_PL_DEBUG"):
            raise
        print(format_error(parser_error(err, args)), file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as err:  # noqa: BLE001 - only user errors are turned into a message
        user = _user_error(err, argv)
        if user is None or os.environ.get("AITRAINING_PL_DEBUG"):
            raise
        print(format_error(user), file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    main()
