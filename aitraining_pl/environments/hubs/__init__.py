"""Environment hubs as episode environments: ``VerifiersEnvironment`` (PyPI ``verifiers``, extra
``aitraining-pl[verifiers]``) and ``OpenEnvEnvironment`` (PyPI ``openenv-core``, extra ``aitraining-pl[openenv]``).
Each hub package is imported when its adapter is built, so this package imports without them."""

from aitraining_pl.environments.hubs.openenv_env import OpenEnvEnvironment
from aitraining_pl.environments.hubs.verifiers_env import VerifiersEnvironment

__all__ = ["OpenEnvEnvironment", "VerifiersEnvironment"]
