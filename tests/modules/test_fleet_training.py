"""Online RL through a fleet of generation servers (``generation.server: {launch: {count: 2}}``,
``generation.servers.fleet``): one of the two launched HF servers is SIGKILLed mid-run, its requests go to the
other, the run ends normally and logs ``train/fleet/servers_up`` 1."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from async_fixtures import grpo
from conftest import quiet_trainer


class Watch(pl.Callback):
    """Records the fleet's logged figures after each step; kills server ``kill`` after step ``at``."""

    def __init__(self, kill: int | None = None, at: int = 2):
        self.kill, self.at, self.logged = kill, at, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        metrics = trainer.callback_metrics
        if "train/fleet/servers_up" in metrics:
            self.logged.append({k: float(v) for k, v in metrics.items() if k.startswith("train/fleet/")})
        if self.kill is not None and trainer.global_step == self.at:
            pl_module._launched[0].servers[self.kill].process.kill()


@pytest.mark.slow
def test_one_of_two_servers_killed_mid_run_and_the_run_goes_on(tmp_path):
    watch = Watch(kill=1, at=2)
    prompts = [chr(97 + i) * 2 for i in range(12)]  # 6 steps of 2 prompts
    module, data = grpo({"server": {"launch": {"count": 2}, "token_timeout": 5.0}, "max_staleness": 1}, prompts)
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    with pytest.warns(
        RuntimeWarning, match=r"generation fleet: server 1 \(http://127\.0\.0\.1:\d+\) is down"
    ) as caught:
        quiet_trainer(tmp_path, max_steps=6, callbacks=[watch]).fit(module, data)
    print(*[w.message for w in caught if "generation fleet" in str(w.message)], sep="\n")
    assert watch.logged[0]["train/fleet/size"] == 2.0 and watch.logged[0]["train/fleet/servers_up"] == 2.0
    assert watch.logged[0]["train/fleet/0/requests"] >= 1 and watch.logged[0]["train/fleet/1/requests"] >= 1
    assert watch.logged[-1]["train/fleet/servers_up"] == 1.0
    assert any(not torch.equal(before[k], v) for k, v in module.policy.state_dict().items())
    assert module._launched[0] is None  # both servers stopped at the end
