"""Each class declares the ranges of its own arguments (``argument_ranges``, ``aitraining_pl.validation``): the
declarations name real arguments, a name may have a different range in two classes, and every shared rule is used."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Mapping

import pytest

from aitraining_pl.callbacks.completions import CompletionLogCallback
from aitraining_pl.callbacks.kl import AdaptiveKLCallback
from aitraining_pl.callbacks.reference_sync import SyncReferenceCallback
from aitraining_pl.datamodules import KTODataModule, PreferenceDataModule, TextDataModule
from aitraining_pl.errors import HyperparameterError
from aitraining_pl.generation.config import VLLMConfig
from aitraining_pl.models import LoRAConfig
from aitraining_pl.modules import AlignmentModule, PPOModule, RewardModule
from aitraining_pl.rollout import GenerationConfig
from aitraining_pl.validation import CONSTRAINTS


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def _package_classes() -> list[type]:
    import aitraining_pl.datamodules  # noqa: F401 - every data module class registered as a subclass
    import aitraining_pl.modules  # noqa: F401 - every module class registered as a subclass

    classes = _subclasses(AlignmentModule) + _subclasses(TextDataModule)
    classes += [GenerationConfig, VLLMConfig, LoRAConfig, AdaptiveKLCallback, CompletionLogCallback]
    classes += [SyncReferenceCallback]
    return [c for c in classes if c.__module__.startswith("aitraining_pl.")]


CLASSES = _package_classes()


def _arguments(cls: type) -> dict[str, typing.Any]:
    """The constructor arguments of ``cls`` with their types: a dataclass's fields, else the parameters of its
    ``__init__`` (through the classes a ``**kwargs`` constructor forwards to)."""
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    arguments = {}
    for klass in reversed(cls.__mro__):
        if "__init__" in vars(klass) and klass.__module__.startswith("aitraining_pl."):
            hints = typing.get_type_hints(klass.__init__)
            parameters = inspect.signature(klass.__init__).parameters.values()
            arguments.update({p.name: hints.get(p.name) for p in parameters if p.kind is not p.VAR_KEYWORD})
    return arguments


def _check_names(ranges: Mapping, cls: type, owner: str) -> None:
    arguments = _arguments(cls)
    for name, rule in ranges.items():
        assert name in arguments, f"{owner} declares a range for {name!r}, which is not one of its arguments"
        if isinstance(rule, Mapping):  # an options group: its names are fields of the argument's dataclass
            kinds = [t for t in typing.get_args(arguments[name]) or (arguments[name],) if dataclasses.is_dataclass(t)]
            assert kinds, f"{owner}.{name} has ranges of an options group but its type names no dataclass"
            _check_names(rule, kinds[0], f"{owner}.{name}")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_declared_range_names_a_constructor_argument(cls):
    _check_names(cls.argument_ranges, cls, cls.__name__)


def test_every_shared_rule_is_taken_by_a_class():
    """No row of ``CONSTRAINTS`` matches no argument."""
    taken = set()

    def collect(ranges: Mapping) -> None:
        for name, rule in ranges.items():
            collect(rule) if isinstance(rule, Mapping) else taken.add((name, id(rule)))

    for cls in CLASSES:
        collect(getattr(cls, "argument_ranges", {}))
    unused = [name for name, rule in CONSTRAINTS.items() if (name, id(rule)) not in taken]
    assert not unused, f"rows of CONSTRAINTS no class takes: {unused}"


def test_a_name_can_have_a_different_range_in_two_classes(byte_tokenizer):
    """``batch_size`` is >= 1 for preference data but >= 2 for KTO (its reference point pairs rows of a batch);
    ``kl_coef`` may be null in the KL callback (the module's then applies) but not in a module; ``temperature`` has a
    rule of its own in the reward modules (rewards are divided by it) and in ``generation`` (logits are)."""
    preference, kto = PreferenceDataModule.argument_ranges["batch_size"], KTODataModule.argument_ranges["batch_size"]
    assert preference.allows(1) and not kto.allows(1) and kto.allows(2)
    PreferenceDataModule(prompts=["a"], chosen=["b"], rejected=["c"], tokenizer=byte_tokenizer, batch_size=1)
    with pytest.raises(HyperparameterError, match=r"KTODataModule.batch_size: must be >= 2"):
        KTODataModule(prompts=["a"], completions=["b"], labels=[True], tokenizer=byte_tokenizer, batch_size=1)

    assert AdaptiveKLCallback.argument_ranges["kl_coef"].allows(None)
    assert not PPOModule.argument_ranges["kl_coef"].allows(None)
    assert AdaptiveKLCallback(kl_coef=None).kl_coef is None

    assert "temperature" not in CONSTRAINTS
    assert RewardModule.argument_ranges["temperature"] is not None and GenerationConfig.argument_ranges["temperature"]
