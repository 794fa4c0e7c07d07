"""The help of the ``aitraining-pl`` command: the overview that ``aitraining-pl`` alone (or ``--help``) prints
(the modules of ``MODULES`` and the recipes in ``configs/``), ``--version``, and the ``--model.<name>.help`` of
the dataclass arguments that jsonargparse cannot print inside a subclass-mode model."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

#: the modules the command lists (name, class path); ``--model DPOModule`` takes the short class name.
MODULES: tuple[tuple[str, str], ...] = (
    ("SFT", "aitraining_pl.modules.sft.SFTModule"),
    ("DPO", "aitraining_pl.modules.dpo.DPOModule"),
    ("KTO", "aitraining_pl.modules.kto.KTOModule"),
    ("ORPO", "aitraining_pl.modules.orpo.ORPOModule"),
    ("CPO", "aitraining_pl.modules.orpo.CPOModule"),
    ("reward", "aitraining_pl.modules.reward.RewardModule"),
    ("pairwise", "aitraining_pl.modules.reward.PairwiseRewardModule"),
    ("multi-objective", "aitraining_pl.modules.reward.MultiObjectiveRewardModule"),
    ("PPO", "aitraining_pl.modules.ppo.PPOModule"),
    ("GRPO", "aitraining_pl.modules.critic_free.GRPOModule"),
    ("RLOO", "aitraining_pl.modules.critic_free.RLOOModule"),
    ("distillation", "aitraining_pl.modules.distill.DistillationModule"),
)

#: dataclass arguments with their own ``--model.<name>.help`` (jsonargparse advertises it but cannot print it
#: inside a subclass-mode model).
NESTED_HELP = {
    "lora": "aitraining_pl.models.lora.LoRAConfig",
    "quantization": "aitraining_pl.models.quantization.QuantizationConfig",
    "generation": "aitraining_pl.rollout.GenerationConfig",
}


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def available_modules() -> list[tuple[str, str, str]]:
    """``(name, class path, first docstring line)`` of each module in ``MODULES`` that imports (importing them
    registers the short class names with jsonargparse)."""
    found = []
    for name, path in MODULES:
        try:
            cls = _import(path)
        except (ImportError, AttributeError):
            continue
        found.append((name, path, (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""))
    return found


def recipe_dir() -> Path | None:
    """``configs/`` in the working directory, else beside the package (a source checkout)."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (root / "configs").is_dir():
            return root / "configs"
    return None


def recipes() -> list[tuple[str, str]]:
    """``(path, description)`` of every YAML recipe; the description is the file's first comment line."""
    folder = recipe_dir()
    if folder is None:
        return []
    found = []
    for path in sorted(folder.rglob("*.y*ml")):
        first = next((line for line in path.read_text().splitlines() if line.startswith("#")), "#")
        try:
            shown = path.relative_to(Path.cwd())
        except ValueError:
            shown = path
        found.append((str(shown), first.lstrip("#").strip()))
    return found


def overview() -> str:
    """The text of ``aitraining-pl`` with no subcommand: usage, modules and recipes."""
    lines = [
        "usage: aitraining-pl {fit,validate,test} --config RECIPE.yaml [--model.init_args.NAME VALUE ...]",
        "       aitraining-pl fit --help | fit --model.help DPOModule | fit --model.lora.help | --version",
        "       aitraining-pl vllm-serve --model MODEL [--port 8000] [vLLM's options]   (a generation server)",
        "       aitraining-pl tinker-serve --model MODEL [--port 8000]   (a server for the tinker client; --help)",
        "",
        "modules (--model CLASS; the short class name is enough):",
    ]
    mods = available_modules()
    width = max((len(n) for n, _, _ in mods), default=0)
    lines += [f"  {name:<{width}}  {path}" for name, path, _ in mods]
    found = recipes()
    if found:
        lines += ["", "recipes (--config PATH):"]
        width = max(len(p) for p, _ in found)
        lines += [f"  {path:<{width}}  {text}" for path, text in found]
    return "\n".join(lines)


def version() -> str:
    return f"aitraining-pl {sys.modules[__package__].__version__}"  # the package is imported with this module


def nested_help(args: list[str]) -> str | None:
    """The help of a dataclass argument (``--model.lora.help``, ``--model.init_args.generation.help``)."""
    for arg in args:
        match = re.fullmatch(r"--model\.(?:init_args\.)?(\w+)\.help", arg)
        if match and match.group(1) in NESTED_HELP:
            from jsonargparse import ArgumentParser

            parser = ArgumentParser(prog=f"--model.{match.group(1)}", exit_on_error=False)
            parser.add_class_arguments(_import(NESTED_HELP[match.group(1)]))
            return parser.format_help()
    return None
