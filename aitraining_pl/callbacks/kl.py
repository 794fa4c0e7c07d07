"""Adaptive KL penalty for PPO (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
section 2.2): the proportional controller and the Lightning callback that applies it.

The KL coefficient has one owner, the module (``OnlineRLModule.kl_coef``, checkpointed under ``kl_coef``); the
callback reads it, moves it and writes it back after every iteration, and saves nothing of its own.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from aitraining_pl.validation import Range, check_arguments, renamed, rules


class AdaptiveKLController:
    """Proportional controller keeping the measured KL near ``target`` (Ziegler et al. 2019):

    ``error = clip(kl / target - 1, -0.2, 0.2)``; ``value *= 1 + error * n_steps / horizon``.

    ``current_kl`` must be in the same unit as ``target``: in this library both are the KL(pi || ref) of a
    whole response in nats (per-token KL summed over the response, averaged over the batch).
    ``n_steps`` is the number of samples (responses) the measurement covers.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be positive, got target={target}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLCallback(pl.Callback):
    """Adapts ``pl_module.kl_coef`` after every PPO iteration so the measured KL stays near ``kl_target``.

    The KL unit: KL(pi || ref) of a whole response in nats (per-token estimates summed over the response,
    averaged over the batch and over ranks), as ``PPOModule`` measures it in ``train/kl``. ``kl_target`` is in
    the same unit. The coefficient lives in the module and is saved in its checkpoints, so a resumed run
    continues with the coefficient it had.

    Args:
        kl_target: target KL per response, in nats (the seed's ``kl_target``).
        kl_horizon: controller horizon in samples (the seed's ``kl_horizon``); the coefficient changes by at most
            a factor ``1 +/- 0.2 * batch / kl_horizon`` per iteration.
        kl_coef: starting coefficient (default: the module's ``kl_coef``); a resumed run continues from the
            checkpoint's instead.
        target: deprecated spelling of ``kl_target`` (accepted with a warning until the next release).
        horizon: deprecated spelling of ``kl_horizon``.
        init_kl_coef: deprecated spelling of ``kl_coef``.
    """

    #: ``kl_coef`` may be null here (the module's is used), unlike the modules' ``kl_coef``
    argument_ranges = rules("kl_target", "kl_horizon", "init_kl_coef", kl_coef=Range(0, optional=True))

    def __init__(
        self,
        kl_target: float = 0.01,
        kl_horizon: float = 10000,
        kl_coef: float | None = None,
        target: float | None = None,
        horizon: float | None = None,
        init_kl_coef: float | None = None,
    ):
        owner = type(self).__name__
        self.kl_target = float(renamed(owner, "kl_target", kl_target, 0.01, target=target))
        self.kl_horizon = float(renamed(owner, "kl_horizon", kl_horizon, 10000, horizon=horizon))
        self.kl_coef = renamed(owner, "kl_coef", kl_coef, None, init_kl_coef=init_kl_coef)
        values = {"kl_target": self.kl_target, "kl_horizon": self.kl_horizon, "kl_coef": self.kl_coef}
        check_arguments(self.argument_ranges, values, owner)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # runs before a checkpoint is restored: a resumed module then takes the checkpoint's coefficient
        if self.kl_coef is not None:
            pl_module.kl_coef = float(self.kl_coef)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        controller = AdaptiveKLController(pl_module.kl_coef, self.kl_target, self.kl_horizon)
        pl_module.kl_coef = controller.update(pl_module.last_kl, pl_module.last_num_samples)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Checkpoints written before issue 25 hold the coefficient here too; the module's copy is the one used."""
