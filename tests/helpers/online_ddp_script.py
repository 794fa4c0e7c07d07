"""Run by tests/modules/test_online_ddp.py: 2-process CPU DDP GRPO; each rank saves its final state to OUT/rank<r>.pt.
With ``episodes`` as the second argument the reward is the multi-turn ``GuessingGame`` (episodes of different
lengths and turn counts on the two ranks); with ``async``, asynchronous training (``max_staleness`` 1) on a generation
server rank 0 starts (``server: launch``), for two epochs; with ``budget``, micro-batches within a ``token_budget``
(the ranks' longer and shorter responses need different counts: each makes the most either needs); with
``balance``, ``balance_ranks`` (the ranks' prompt groups dealt by real tokens after sampling). A third argument
sets ``loss_aggregation`` (default GRPO's ``sequence``).

The ranks are given different ``max_new_tokens`` (ragged rollouts across ranks); the reward function records the
prompt of every row it scores, so the test can check that each prompt's G samples stayed on one rank, together.
"""

import os
import sys

import torch

torch.set_num_threads(1)
HELPERS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HELPERS, os.path.dirname(HELPERS)]  # the helpers and tests/ (conftest)

import lightning.pytorch as pl  # noqa: E402
from conftest import TINY_LLAMA  # noqa: E402

from aitraining_pl.datamodules.prompt import PromptDataModule  # noqa: E402
from aitraining_pl.modules.critic_free import GRPOModule  # noqa: E402
from aitraining_pl.rollout import GenerationConfig  # noqa: E402

SCORED: list[list[str]] = []


def recording_reward(prompts, responses, metadata):
    """A score that varies between a group's samples even for a random model (the character codes mod 7)."""
    SCORED.append(list(prompts))
    return [float(sum(map(ord, r)) % 7) for r in responses]


class Record(pl.Callback):
    def __init__(self):
        self.batches = []

    def on_train_start(self, trainer, pl_module):
        pl_module.generation.max_new_tokens = 3 + 4 * trainer.global_rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(list(batch["prompts"]))


def main(out: str, mode: str = "responses", aggregation: str = "sequence") -> None:
    from aitraining_pl.environments.multiturn import GuessingGame

    pl.seed_everything(0)
    episodes = mode == "episodes"
    module = GRPOModule(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        reward=GuessingGame(max_turns=3) if episodes else recording_reward,
        num_generations=4,
        generation=GenerationConfig(
            max_new_tokens=4, temperature=1.0, **({"server": "launch", "max_staleness": 1} if mode == "async" else {})
        ),
        learning_rate=1e-3,
        mini_batch_size=4,
        gradient_accumulation_steps=2,
        num_iterations=2,
        kl_coef=0.04,
        token_budget=20 if mode == "budget" else None,  # rows of 9 to 15 tokens: 3 or 4 micro-batches of 4 rows
        balance_ranks=mode == "balance",
        loss_aggregation=aggregation,
    )
    metadata = [{"secret": 1 + i % 7} for i in range(8)] if episodes else None
    data = PromptDataModule(
        prompts=[f"prompt {i}" for i in range(8)], metadata=metadata, tokenizer="byte", batch_size=2
    )
    record = Record()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2 if mode == "async" else 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(module, data)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    torch.save(
        {
            "state": state,
            "batches": record.batches,
            "scored": SCORED,
            "global_step": trainer.global_step,
            "metrics": metrics,
        },
        os.path.join(out, f"rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
    if torch.distributed.is_initialized():  # gloo's threads joined before the interpreter exits
        torch.distributed.destroy_process_group()  # (a rare 'terminate called' abort at exit otherwise)
