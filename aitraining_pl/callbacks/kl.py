"""Adaptive KL penalty for PPO as a Lightning callback (Ziegler et al. 2019, section 2.2)."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl

from aitraining_pl.losses import AdaptiveKLController


class AdaptiveKLCallback(pl.Callback):
    """Adapts ``pl_module.kl_coef`` after every PPO iteration so the measured KL stays near ``target``.

    The KL unit: KL(pi || ref) of a whole response in nats (per-token estimates summed over the response,
    averaged over the batch and over ranks), as ``PPOModule`` measures it in ``train/kl``. ``target`` is in
    the same unit. The controller's state is saved in checkpoints, so a resumed run continues with the
    coefficient it had.

    Args:
        target: target KL per response, in nats (the seed's ``kl_target``).
        horizon: controller horizon in samples (the seed's ``kl_horizon``); the coefficient changes by at most
            a factor ``1 +/- 0.2 * batch / horizon`` per iteration.
        init_kl_coef: starting coefficient (default: the module's ``kl_penalty_coef``).
    """

    def __init__(self, target: float = 0.01, horizon: float = 10000, init_kl_coef: Optional[float] = None):
        self.target, self.horizon, self.init_kl_coef = float(target), float(horizon), init_kl_coef
        self.controller: Optional[AdaptiveKLController] = None

    def _controller(self, pl_module: pl.LightningModule) -> AdaptiveKLController:
        if self.controller is None:
            start = self.init_kl_coef if self.init_kl_coef is not None else pl_module.kl_coef
            self.controller = AdaptiveKLController(start, self.target, self.horizon)
        return self.controller

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # runs after a checkpoint's callback state was restored
        pl_module.kl_coef = self._controller(pl_module).value

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        controller = self._controller(pl_module)
        pl_module.kl_coef = controller.update(pl_module.last_kl, pl_module.last_num_samples)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.controller is None else {**self.controller.state_dict(), "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.controller = AdaptiveKLController(state_dict["value"], self.target, self.horizon)
