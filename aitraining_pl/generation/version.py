"""``WeightsVersion``: which weights sampled a rollout, as ``(run, step)``.

A version is the run's id (the same on every rank) and the optimizer step whose weights were pushed. On the wire it
is the text ``run:step`` (the step: the integer after the last ``:``), the only place that text is built or parsed.
A teacher's fixed weights have no version (None)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class WeightsVersion:
    """One push of a run's weights: ``run`` (the run's id) and ``step`` (the optimizer step they are of)."""

    run: str
    step: int

    def __str__(self) -> str:
        return f"{self.run}:{self.step}"

    @classmethod
    def parse(cls, value: Any) -> WeightsVersion | None:
        """The version written as ``run:step`` (a ``WeightsVersion`` passes through); None for anything else (no
        version, a teacher's fixed weights, a malformed text)."""
        if isinstance(value, WeightsVersion):
            return value
        prefix, _, step = value.rpartition(":") if isinstance(value, str) else ("", "", "")
        return cls(prefix, int(step)) if prefix and step.isdigit() else None

    def serves(self, wanted: WeightsVersion | None, newer: bool = False) -> bool:
        """Whether these weights may answer a request for ``wanted`` (None: any): the same version, or with
        ``newer`` a version of the same run at the same step or later."""
        if wanted is None or self == wanted:
            return True
        return newer and self.run == wanted.run and self.step >= wanted.step
