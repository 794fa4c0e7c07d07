"""Small verifiers environments for ``environments/test_hubs.py``, built as verifiers' documentation builds them.

This module is an environment package (its id is ``hub_fixtures``: verifiers imports the module and takes
the ``Taskset`` and ``Env`` subclasses it exports in ``__all__``). ``DigitTaskset`` asks for a secret digit
(``@vf.reward`` ``correct``: the secret is in the last reply; ``plain``, weight 0.1: the fraction of its characters
that are letters or digits, which a random policy varies on; ``@vf.metric`` ``replies``; ``@vf.stop`` ``gave_up``
when a reply holds ``?``); ``HigherLower`` is a multi-turn env: its ``run`` answers each wrong guess with ``higher`` /
``lower`` for up to ``ROUNDS`` guesses and records a ``speed`` reward (weight 0.5), ``finalize`` a ``finished`` metric.
``UserSim`` uses a second seat (not exported: built by hand).
"""

from __future__ import annotations

import verifiers.v1 as vf

SECRETS = (3, 5, 6)
ROUNDS = 3


class DigitData(vf.TaskData):
    secret: int = 0


class DigitTask(vf.Task[DigitData]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(str(task.secret) in trace.last_reply)

    @vf.reward(weight=0.1)
    async def plain(self, trace) -> float:
        reply = trace.last_reply
        return sum(c.isalnum() for c in reply) / len(reply) if reply else 0.0

    @vf.metric
    async def replies(self, trace) -> float:
        return float(len(trace.assistant_messages))

    @vf.stop
    async def gave_up(self, trace: vf.Trace) -> bool:
        return "?" in trace.last_reply


class DigitTaskset(vf.Taskset[DigitTask, vf.TasksetConfig]):
    def load(self):
        for secret in SECRETS:
            yield DigitTask(DigitData(prompt="Guess a digit:", system_prompt="One digit only.", secret=secret))


class HigherLowerConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class HigherLower(vf.Env[HigherLowerConfig]):
    async def run(self, task, agents):
        secret = task.data.secret
        async with agents.player.interaction(task) as game:
            segment = await game.turn()
            guesses = 1
            while not segment.terminated and str(secret) not in segment.last_reply and guesses < ROUNDS:
                digits = [int(c) for c in segment.last_reply if c.isdigit()]
                segment = await game.turn("higher" if digits and digits[0] < secret else "lower")
                guesses += 1
            game.trace.record_reward("speed", 1.0 / guesses, weight=0.5)

    async def finalize(self, task, episode):
        for trace in episode.traces:
            trace.record_metric("finished", float(trace.stop_condition == "user_closed"))


class UserSim(vf.Env[HigherLowerConfig]):
    """Uses a second seat (``user``), which verifiers plays with a model: the adapter refuses it."""

    async def run(self, task, agents):
        async with agents.user.interaction(task) as user:
            await user.turn()


__all__ = ["DigitTaskset", "HigherLower"]
