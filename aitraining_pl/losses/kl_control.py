"""KL-coefficient controllers for RLHF with a KL penalty (Ziegler et al. 2019, "Fine-Tuning Language
Models from Human Preferences", section 2.2). Plain Python state, saved with ``state_dict``."""

from __future__ import annotations


class FixedKLController:
    """A constant KL coefficient; ``update`` is a no-op. Same interface as ``AdaptiveKLController``."""

    def __init__(self, init_kl_coef: float):
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Proportional controller keeping the measured KL near ``target`` (Ziegler et al. 2019):

    ``error = clip(kl / target - 1, -0.2, 0.2)``; ``value *= 1 + error * n_steps / horizon``.

    ``current_kl`` must be in the same unit as ``target``: in this library both are the KL(pi || ref) of a
    whole response in nats (per-token KL summed over the response, averaged over the batch).
    ``n_steps`` is the number of samples (responses) the measurement covers.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be positive, got target={target}, horizon={horizon}")
        super().__init__(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
