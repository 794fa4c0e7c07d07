"""Run by tests/modules/test_ppo_ddp.py: 2-process CPU DDP PPO; each rank saves its final state to OUT/rank<r>.pt.

The ranks are given different ``max_new_tokens`` so their rollouts have different lengths (ragged across
ranks): nothing may wait on another rank's shapes.
"""

import os
import sys

import torch

torch.set_num_threads(1)
HELPERS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HELPERS, os.path.dirname(HELPERS)]  # the helpers and tests/ (conftest)

import lightning.pytorch as pl  # noqa: E402
from conftest import TINY_LLAMA  # noqa: E402

from aitraining_pl.callbacks.kl import AdaptiveKLCallback  # noqa: E402
from aitraining_pl.datamodules.prompt import PromptDataModule  # noqa: E402
from aitraining_pl.modules.ppo import PPOModule  # noqa: E402
from aitraining_pl.rollout import GenerationConfig  # noqa: E402


class Record(pl.Callback):
    def __init__(self):
        self.prompts, self.lengths = [], []

    def on_train_start(self, trainer, pl_module):
        pl_module.generation.max_new_tokens = 3 + 4 * trainer.global_rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.prompts.append(list(batch["prompts"]))


def main(out: str, precision: str = "32-true") -> None:
    pl.seed_everything(0)
    module = PPOModule(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        reward="aitraining_pl.rewards:char_fraction_reward",
        generation=GenerationConfig(max_new_tokens=4, temperature=1.0, top_p=1.0),
        learning_rate=1e-3,
        mini_batch_size=2,
        gradient_accumulation_steps=2,
        num_iterations=2,
        kl_coef=0.05,
    )
    data = PromptDataModule(prompts=[f"prompt {i}" for i in range(8)], tokenizer="byte", batch_size=4)
    record = Record()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[AdaptiveKLCallback(kl_target=0.01, kl_horizon=100), record],
    )
    trainer.fit(module, data)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    torch.save(
        {
            "state": state,
            "prompts": record.prompts,
            "kl_coef": module.kl_coef,
            "global_step": trainer.global_step,
            "max_new_tokens": module.generation.max_new_tokens,
        },
        os.path.join(out, f"rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
    if torch.distributed.is_initialized():  # gloo's threads joined before the interpreter exits
        torch.distributed.destroy_process_group()  # (a rare 'terminate called' abort at exit otherwise)
