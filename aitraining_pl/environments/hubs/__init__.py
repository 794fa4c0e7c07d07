"""Environment hubs as episode environments: ``VerifiersEnvironment`` (PyPI ``verifiers``, extra
``aitraining-pl[verifiers]``) and ``OpenEnvEnvironment`` (PyPI ``openenv-core``, extra ``aitraining-pl[openenv]``).
Each hub package is imported when its adapter is built, so this package imports without them."""

# Lightning before pydantic / openai: Python caches ``typing.Union`` by its members, so a ``Union[float, int]`` built
# by those packages before Lightning is imported becomes the type of ``Trainer(limit_train_batches=...)``, and the CLI
# then reads ``--trainer.limit_train_batches 1`` as 1.0 (every batch) instead of one batch
import lightning.pytorch  # noqa: F401, E402  (isort: skip)

from aitraining_pl.environments.hubs.openenv_env import OpenEnvEnvironment
from aitraining_pl.environments.hubs.verifiers_env import VerifiersEnvironment

__all__ = ["OpenEnvEnvironment", "VerifiersEnvironment"]
