"""The arguments of the package's classes: their allowed ranges, their old names and how they are stored.

Each class declares the ranges of its own arguments in ``argument_ranges`` (argument name -> ``Range`` / ``OneOf``,
or a nested mapping for an options group such as ``generation``), usually built with ``rules(...)`` from
``CONSTRAINTS``, the rules an argument name takes wherever it means the same thing; a name that means something
else in a class gets that class's own rule (``temperature`` scales rewards in ``RewardModule`` and logits in
``GenerationConfig``). ``check_arguments(ranges, values, owner)`` raises a ``HyperparameterError`` naming the
argument, the value and the allowed range; every class runs it once, when it is built (modules and data modules
from ``save_arguments``, before anything is loaded); the CLI runs the same check on the config before it builds
anything, so that a bad data argument fails before a model loads.

``constructor_arguments`` and ``save_hparams`` store a module's hyperparameters in one step, from its own arguments.

``RENAMED`` lists the arguments renamed to one spelling per concept (TRL's and peft's where they exist);
``renamed(...)`` accepts an old name for one release with a ``RenamedArgumentWarning`` (a ``DeprecationWarning``).
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from aitraining_pl.errors import ConfigError, HyperparameterError, ModelLoadError, RewardError

#: old argument name -> its one spelling now; the old names are accepted (with a warning) until the next release.
RENAMED: dict[str, str] = {
    "kl_penalty_coef": "kl_coef",  # PPOModule (the seed's PPOConfig keeps kl_penalty_coef)
    "init_kl_coef": "kl_coef",  # AdaptiveKLCallback
    "target": "kl_target",  # AdaptiveKLCallback (the seed's PPOConfig.kl_target)
    "horizon": "kl_horizon",  # AdaptiveKLCallback (the seed's PPOConfig.kl_horizon)
    "precompute_ref_logps": "precompute_ref_log_probs",  # DPOModule (TRL's DPOConfig name)
    "center_rewards_coef": "center_rewards_coefficient",  # RewardModule (TRL's RewardConfig name)
    "ppo_epochs": "num_iterations",  # PPOModule (the seed's PPOConfig keeps ppo_epochs)
    "clip_ratio": "epsilon",  # PPOModule (the seed's PPOConfig keeps clip_ratio)
    # generation.vllm's correction -> the policy_loss group (any sampler / trainer gap, not only vLLM's; issue 31)
    "importance_sampling_correction": "importance_sampling_mode",  # true: token_truncate, false: none
    "importance_sampling_cap": "importance_sampling_clip_max",
}


class RenamedArgumentWarning(DeprecationWarning):
    """An argument was given by its old name (``RENAMED``); the command line always shows it."""


def renamed(owner: str, new: str, value: Any, default: Any, **old: Any) -> Any:
    """The value of argument ``new``, also accepted under an old name in ``old`` (``name=value``, ``None`` when not
    given) with a ``RenamedArgumentWarning``; a ``ConfigError`` when both spellings are given."""
    given = {name: v for name, v in old.items() if v is not None}
    if not given:
        return value
    if len(given) > 1 or value != default:
        raise ConfigError(f"{owner}.{new}", f"given twice: as {new!r} and as deprecated {', '.join(map(repr, given))}")
    name, old_value = next(iter(given.items()))
    warnings.warn(
        f"{owner}: argument {name!r} is renamed {new!r}; the old name is accepted until the next release",
        RenamedArgumentWarning,
        stacklevel=3,
    )
    return old_value


def replaced(owner: str, old: str, new: str) -> None:
    """Warn (``RenamedArgumentWarning``, as ``renamed()`` does for one argument) that ``old``, a deprecated way to
    write a setting (several fields, another library's class), is replaced by ``new``; the old spelling keeps
    working until the next release."""
    warnings.warn(
        f"{owner}: {old} is replaced by {new}; the old spelling is accepted until the next release",
        RenamedArgumentWarning,
        stacklevel=3,
    )


def constructor_arguments(init: Callable, values: Mapping[str, Any], ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """The arguments of the constructor ``init`` by the names of its signature, read from ``values`` (the
    constructor's own ``locals()`` once its arguments are normalised): the explicit alternative to Lightning's
    caller-frame inspection. Left out: old names (``RENAMED``: their values were resolved into the new names) and
    ``ignore`` (objects that are not saved, e.g. in-memory data)."""
    names = list(inspect.signature(init).parameters)[1:]  # without ``self``
    return {name: values[name] for name in names if name not in RENAMED and name not in ignore and name in values}


def save_hparams(owner: Any, values: Mapping[str, Any]) -> None:
    """Store ``values`` as the hyperparameters of ``owner`` (a module or data module) in one step: Lightning's
    ``save_hyperparameters(dict)``, so checkpoints, ``hparams.yaml`` and every logger get exactly ``values``. Under
    the LightningCLI, its two bookkeeping keys (``_class_path``, ``_instantiator``, which let
    ``load_from_checkpoint`` rebuild the class the CLI built) are kept as well."""
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters

    given = _given_hyperparameters.get() or {}
    cli = {}
    if str(given.get("_class_path", "")).rpartition(".")[2] == type(owner).__name__:  # not a module built inside
        cli = {key: given[key] for key in ("_class_path", "_instantiator") if key in given}
    owner.save_hyperparameters({**cli, **values})


@dataclass(frozen=True)
class Range:
    """``low <(=) value <(=) high`` (either bound optional); ``None`` allowed when ``optional``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  #: ``value > low`` instead of ``>=``
    high_open: bool = False  #: ``value < high`` instead of ``<=``
    integer: bool = False
    optional: bool = False
    reason: str = ""  #: why the range is what it is, when it is not obvious (added to the error)

    def describe(self) -> str:
        low = None if self.low is None else f"{self.low:g} {'<' if self.low_open else '<='} "
        high = None if self.high is None else f" {'<' if self.high_open else '<='} {self.high:g}"
        if low and high:
            text = f"{low}value{high}"
        elif low or high:
            text = f"{'>' if self.low_open else '>='} {self.low:g}" if low else f"{high.strip()}"
        else:
            text = "a finite number"
        text += " (an integer)" if self.integer else ""
        text += " or null" if self.optional else ""
        return text + (f" ({self.reason})" if self.reason else "")

    def allows(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


@dataclass(frozen=True)
class OneOf:
    """A name from a registry (a callable returning the known names, or None when that registry does not exist
    in this version: then anything passes); with ``many``, also a non-empty list of such names."""

    names: Callable[[], list[str] | None]
    optional: bool = False
    many: bool = False
    #: (value, advice) pairs: what to use instead of a value another library gives this argument (e.g. TRL's)
    hints: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        return "one of " + ", ".join(map(repr, self.names() or [])) + (" (or a list of them)" if self.many else "")

    def allows(self, value: Any) -> bool:
        known = self.names()
        if self.many and isinstance(value, (list, tuple)) and not isinstance(value, str):
            return bool(value) and (known is None or all(v in known for v in value))
        return (value is None and self.optional) or known is None or value in known


def registry(module: str, name: str, extra: tuple = ()) -> Callable[[], list[str] | None]:
    """The names of the table ``name`` of ``module`` (imported when first checked), plus ``extra``."""

    def names() -> list[str] | None:
        import importlib

        table = getattr(importlib.import_module(module), name, None)
        return None if table is None else list(table) + list(extra)

    return names


def fixed(*names: str) -> Callable[[], list[str]]:
    """The names given."""

    return lambda: list(names)


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
COUNT = Range(1, integer=True)  #: an integer >= 1
FRACTION = Range(0, 1)  #: 0 <= value <= 1
PROBABILITY_OPEN = Range(0, 1, low_open=True)  #: 0 < value <= 1

Rule = Range | OneOf
#: argument name -> a ``Rule``, or the ``Ranges`` of an options group (a nested mapping, e.g. ``generation``)
Ranges = Mapping[str, Any]

#: argument name -> its allowed values wherever it means the same thing; a class takes these with ``rules(...)``.
CONSTRAINTS: dict[str, Rule] = {
    # optimisation
    "learning_rate": Range(0, 3.4028234663852886e38, low_open=True),  # above float32's largest, every step is inf
    "warmup_ratio": FRACTION,
    "weight_decay": NON_NEGATIVE,
    "lr_schedule": OneOf(registry("aitraining_pl.optim", "SCHEDULES")),
    "max_grad_norm": Range(0, optional=True),
    "gradient_accumulation_steps": COUNT,
    "mini_batch_size": COUNT,
    "token_budget": Range(1, integer=True, optional=True),
    # preference losses (DPO family)
    "beta": POSITIVE,
    "label_smoothing": Range(0, 0.5, high_open=True),
    "simpo_gamma": NON_NEGATIVE,
    "loss_type": OneOf(registry("aitraining_pl.losses", "DPO_LOSSES"), many=True),
    "discopop_tau": POSITIVE,
    "cpo_alpha": NON_NEGATIVE,
    "desirable_weight": NON_NEGATIVE,
    "undesirable_weight": NON_NEGATIVE,
    # reward models
    "dropout_prob": Range(0, 1, high_open=True),
    "center_rewards_coefficient": NON_NEGATIVE,
    "center_rewards_coef": Range(0, optional=True),  # deprecated spelling of center_rewards_coefficient
    "num_objectives": COUNT,
    "pooling_strategy": OneOf(registry("aitraining_pl.losses", "POOLING_STRATEGIES")),
    # online RL (PPO, GRPO, RLOO)
    "ppo_epochs": Range(1, integer=True, optional=True),  # deprecated spelling of num_iterations
    "num_iterations": COUNT,
    "num_generations": COUNT,
    "gamma": PROBABILITY_OPEN,
    "lam": FRACTION,
    "clip_ratio": Range(0, low_open=True, optional=True),  # deprecated spelling of epsilon
    "epsilon": POSITIVE,
    "epsilon_high": Range(0, low_open=True, optional=True),
    "value_clip": Range(0, optional=True),
    "value_coef": NON_NEGATIVE,
    "kl_penalty_coef": Range(0, optional=True),  # deprecated spelling of kl_coef
    "init_kl_coef": Range(0, optional=True),  # deprecated spelling of kl_coef (AdaptiveKLCallback)
    "kl_coef": NON_NEGATIVE,
    "kl_target": POSITIVE,
    "kl_horizon": POSITIVE,
    "kl_estimator": OneOf(registry("aitraining_pl.losses.rl", "_KL_ESTIMATORS")),
    "advantage": OneOf(registry("aitraining_pl.losses", "ADVANTAGE_ESTIMATORS")),
    "loss_aggregation": OneOf(registry("aitraining_pl.losses", "LOSS_AGGREGATIONS")),
    "scale_rewards": OneOf(fixed("group", "batch", "none")),
    "importance_sampling_level": OneOf(registry("aitraining_pl.losses", "IMPORTANCE_SAMPLING_LEVELS")),
    "delta": Range(1, low_open=True, optional=True),
    "top_entropy_quantile": PROBABILITY_OPEN,
    "importance_sampling_mode": OneOf(registry("aitraining_pl.losses", "IMPORTANCE_SAMPLING_MODES", ("auto", "none"))),
    "importance_sampling_clip_min": Range(0, 1, optional=True),
    "importance_sampling_clip_max": Range(1, optional=True),
    "ref_model_mixup_alpha": PROBABILITY_OPEN,
    "ref_model_sync_steps": COUNT,
    "every_n_steps": COUNT,
    "reward_timeout": Range(0, low_open=True, optional=True),
    # sampling (``generation``)
    "max_new_tokens": COUNT,
    "top_p": PROBABILITY_OPEN,
    "top_k": Range(0, integer=True),
    "backend": OneOf(registry("aitraining_pl.generation.registry", "BACKEND_NAMES", ("auto",))),
    # the vLLM backend (``generation.vllm``)
    "gpu_memory_utilization": PROBABILITY_OPEN,
    "server_port": Range(0, 65535, integer=True),
    "server_timeout": POSITIVE,
    "cpu_kv_cache_gb": POSITIVE,
    "tensor_parallel_size": COUNT,
    "max_model_len": Range(1, integer=True, optional=True),
    "importance_sampling_cap": Range(1, optional=True),  # deprecated spelling of importance_sampling_clip_max
    # models and LoRA (``lora.r``, ``lora.alpha``, ``lora.dropout``)
    "r": COUNT,
    "alpha": POSITIVE,
    "dropout": Range(0, 1, high_open=True),
    "dtype": OneOf(registry("aitraining_pl.models.loading", "_DTYPES", extra=("auto",)), optional=True),
    # data modules
    "batch_size": COUNT,
    "eval_batch_size": Range(1, integer=True, optional=True),
    "val_split": Range(0, 1, high_open=True),
    "max_length": COUNT,
    "max_prompt_length": COUNT,
    "max_image_pixels": Range(1, integer=True, optional=True),
    "num_workers": Range(0, integer=True),
}


def rules(*names: str, **own: Rule | Ranges) -> dict[str, Rule | Ranges]:
    """A class's ``argument_ranges``: the shared rules of ``names`` (``CONSTRAINTS``) and ``own`` (rules of this
    class only: a name that means something else here, or the ranges of a nested options group)."""
    return {**{name: CONSTRAINTS[name] for name in names}, **own}


def check_arguments(ranges: Ranges, values: Mapping[str, Any], owner: str) -> None:
    """Raise ``HyperparameterError`` for the first value in ``values`` outside its rule in ``ranges`` (an options
    group, as a mapping or a dataclass, is checked with dotted names: ``PPOModule.generation.max_new_tokens``); also
    the rules between two arguments below. ``owner`` names the class."""
    for name, value in values.items():
        rule = ranges.get(name)
        if rule is None:
            continue
        if isinstance(rule, Mapping):  # an options group
            group = asdict(value) if is_dataclass(value) and not isinstance(value, type) else value
            if isinstance(group, Mapping):
                check_arguments(rule, group, f"{owner}.{name}")
        elif not rule.allows(value):
            if isinstance(rule, OneOf):
                why = f"unknown {name} {value!r}; must be {rule.describe()}"
                why += "".join(f" ({advice})" for known, advice in rule.hints if known == value)
            else:
                why = f"must be {rule.describe()}, got {value!r}"
            raise HyperparameterError(f"{owner}.{name}", why)
    _check_pairs(values, owner)
    _check_paths(values, owner)


def _check_pairs(hparams: Mapping[str, Any], owner: str) -> None:
    """Rules between two arguments."""
    prompt, total = hparams.get("max_prompt_length"), hparams.get("max_length")
    if isinstance(prompt, int) and isinstance(total, int) and prompt >= total:
        raise HyperparameterError(f"{owner}.max_prompt_length", f"must be < max_length ({total}), got {prompt}")
    if hparams.get("model_name") is not None and hparams.get("model_config") is not None:
        raise HyperparameterError(f"{owner}.model_name", "give either model_name or model_config, not both")


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a local path (not a hub id ``org/name`` or an import path)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def names_gguf(name: Any) -> bool:
    """Whether a model or tokenizer name is a GGUF file (local, or ``org/repo/file.gguf`` on the hub): its suffix."""
    return str(name).lower().endswith(".gguf")


def hub_gguf_file(name: str) -> tuple[str, str] | None:
    """``(repo id, file in the repo)`` for a ``.gguf`` name spelled ``org/repo/file.gguf`` (or
    ``org/repo/folder/file.gguf``) that is not a local file: a GGUF file in a hub repo, which transformers reads
    with ``from_pretrained(repo, gguf_file=file)``. None for any other name; one that starts with ``/``, ``.`` or
    ``~`` is a local path."""
    if not names_gguf(name) or name.startswith(("/", ".", "~")) or os.path.isfile(name):
        return None
    parts = name.split("/")
    if len(parts) < 3 or not all(parts) or (os.sep != "/" and os.sep in name):
        return None
    return "/".join(parts[:2]), "/".join(parts[2:])


def _check_paths(hparams: Mapping[str, Any], owner: str) -> None:
    """A local folder named by ``model_name`` / ``tokenizer_name`` (model error) or ``reward`` (reward error)
    must exist."""
    for name, error in (("model_name", ModelLoadError), ("tokenizer_name", ModelLoadError), ("reward", RewardError)):
        value = hparams.get(name)
        if isinstance(value, str) and looks_like_path(value) and not os.path.isdir(os.path.expanduser(value)):
            if names_gguf(value) and name != "reward":
                if not os.path.isfile(os.path.expanduser(value)) and hub_gguf_file(value) is None:
                    raise error(f"{owner}.{name}", f"GGUF file {value!r} not found")
                continue
            raise error(f"{owner}.{name}", f"folder {value!r} not found")
