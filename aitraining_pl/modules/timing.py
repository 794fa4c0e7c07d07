"""Where an online step's time goes: wall-clock seconds per named section, as verl's ``timing_s/*`` and TRL's
``step_time`` report them (``docs/online_rl.md``)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class Stopwatch:
    """Seconds spent in named sections since the last ``reset``; a section entered twice adds up, and sections may
    nest (each keeps its own total)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def reset(self) -> None:
        self.seconds.clear()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def online_step(self, tokens: int) -> dict[str, float]:
        """The logged figures of one online step from its sections ``rollout`` (sampling and scoring),
        ``gen`` (sampling, inside ``rollout``), ``experience`` (no-gradient passes and advantages), ``ref`` (the
        reference pass, inside ``experience``) and ``update_actor``: ``timing_s/gen``, ``timing_s/reward``
        (``rollout`` less ``gen``), ``timing_s/ref``, ``timing_s/old_log_prob`` (``experience`` less ``ref``: the
        old / proximal log-probs, values and advantages), ``timing_s/update_actor``, ``timing_s/step`` (their sum) and
        ``perf/tokens_per_s``, the step's real (prompt and response) ``tokens`` over its seconds. In asynchronous
        training the sampling runs on the pipeline's worker, beside the step: ``gen`` is the worker's seconds and
        the step's own are the rest."""
        s = self.seconds
        step = s["rollout"] + s["experience"] + s["update_actor"]
        return {
            "timing_s/gen": s["gen"],
            "timing_s/reward": max(0.0, s["rollout"] - s["gen"]),
            "timing_s/ref": s["ref"],
            "timing_s/old_log_prob": max(0.0, s["experience"] - s["ref"]),
            "timing_s/update_actor": s["update_actor"],
            "timing_s/step": step,
            "perf/tokens_per_s": tokens / step if step > 0 else 0.0,
        }
