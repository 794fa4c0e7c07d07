"""Adaptive KL penalty for PPO as a Lightning callback (Ziegler et al. 2019, section 2.2)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from aitraining_pl.losses import AdaptiveKLController
from aitraining_pl.validation import check_hparams, renamed


class AdaptiveKLCallback(pl.Callback):
    """Adapts ``pl_module.kl_coef`` after every PPO iteration so the measured KL stays near ``kl_target``.

    The KL unit: KL(pi || ref) of a whole response in nats (per-token estimates summed over the response,
    averaged over the batch and over ranks), as ``PPOModule`` measures it in ``train/kl``. ``kl_target`` is in
    the same unit. The controller's state is saved in checkpoints, so a resumed run continues with the
    coefficient it had.

    Args:
        kl_target: target KL per response, in nats (the seed's ``kl_target``).
        kl_horizon: controller horizon in samples (the seed's ``kl_horizon``); the coefficient changes by at most
            a factor ``1 +/- 0.2 * batch / kl_horizon`` per iteration.
        kl_coef: starting coefficient (default: the module's ``kl_coef``).
        target: deprecated spelling of ``kl_target`` (accepted with a warning until the next release).
        horizon: deprecated spelling of ``kl_horizon``.
        init_kl_coef: deprecated spelling of ``kl_coef``.
    """

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
        check_hparams({k: v for k, v in values.items() if v is not None}, owner)
        self.controller: AdaptiveKLController | None = None

    def _controller(self, pl_module: pl.LightningModule) -> AdaptiveKLController:
        if self.controller is None:
            start = self.kl_coef if self.kl_coef is not None else pl_module.kl_coef
            self.controller = AdaptiveKLController(start, self.kl_target, self.kl_horizon)
        return self.controller

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # runs after a checkpoint's callback state was restored
        pl_module.kl_coef = self._controller(pl_module).value

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        controller = self._controller(pl_module)
        pl_module.kl_coef = controller.update(pl_module.last_kl, pl_module.last_num_samples)

    def state_dict(self) -> dict[str, Any]:
        return (
            {}
            if self.controller is None
            else {**self.controller.state_dict(), "target": self.kl_target, "horizon": self.kl_horizon}
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.controller = AdaptiveKLController(state_dict["value"], self.kl_target, self.kl_horizon)
