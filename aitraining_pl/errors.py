"""Typed errors for failures the user causes and can fix (bad data, config, model or reward files, reward
sources, hyperparameters).

The command line prints each as one line, ``aitraining-pl: <what> error: <where>: <why>``, and exits with
status 2 (``aitraining_pl.cli``); any other exception is an internal error and keeps its traceback. This
module imports nothing from the project, so every layer can raise these.
"""

from __future__ import annotations


class UserError(ValueError):
    """A failure the user can fix. ``what`` names the kind (``data``, ``config``, ...), ``where`` the file,
    argument or source, ``why`` the problem; ``str(err)`` is ``"<where>: <why>"``."""

    what = "input"

    def __init__(self, where: str, why: str | None = None):
        self.where, self.why = (where, why) if why is not None else ("", where)
        super().__init__(f"{where}: {why}" if why is not None else where)


class ConfigError(UserError):
    """A bad command-line option or configuration value."""

    what = "config"


class HyperparameterError(ConfigError):
    """A hyperparameter outside its allowed range (see ``aitraining_pl.validation``)."""

    what = "hyperparameter"


class ModelLoadError(UserError):
    """A model or tokenizer that cannot be loaded: missing folder, unreadable or corrupt weights file."""

    what = "model"


class RewardError(UserError, RuntimeError):
    """A reward source failed: it could not be built, it raised or exited, or it returned something other
    than one finite float per response. Re-exported by ``aitraining_pl.rewards``."""

    what = "reward"


class SandboxError(UserError):
    """The code sandbox cannot run the candidate's code on this machine (e.g. an interpreter it cannot start):
    raised once when the code environment is built, instead of scoring every test 0."""

    what = "sandbox"


class GenerationServerError(UserError, RuntimeError):
    """A generation server (``generation.server``: ``connect``, ``launch``, a URL or a fleet) could not be
    reached, did not answer in time, closed the connection or refused a request: one line naming its ``host:port``,
    what was being done, and how to go on (start it; resume the run from its last checkpoint with ``--ckpt_path``)."""

    what = "generation server"
