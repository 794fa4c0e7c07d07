"""Run by tests/modules/test_reward_ddp.py: RewardModule under 2-process CPU DDP. Rank 0 writes OUT/result.pt with
its final state, the rank-reduced validation metrics and the same metrics computed in one process."""

import os
import sys

import torch

torch.set_num_threads(1)
HELPERS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HELPERS, os.path.dirname(HELPERS)]  # the helpers and tests/ (conftest)

import lightning.pytorch as pl  # noqa: E402
from conftest import TINY_LLAMA  # noqa: E402
from reward_fixtures import synthetic_pairs  # noqa: E402

from aitraining_pl.datamodules.preference import PreferenceDataModule  # noqa: E402
from aitraining_pl.modules.reward import RewardModule  # noqa: E402


def main(out: str) -> None:
    pl.seed_everything(0)
    module = RewardModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=3e-3, warmup_ratio=0.0)
    prompts, chosen, rejected = synthetic_pairs(64, seed=0)
    data = PreferenceDataModule(prompts=prompts, chosen=chosen, rejected=rejected, tokenizer=module.tokenizer,
                                batch_size=8, val_split=0.25, max_length=64, max_prompt_length=32)  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    reduced = {k: float(v) for k, v in trainer.validate(module, datamodule=data, verbose=False)[0].items()}
    state = {k: v.detach().cpu().clone() for k, v in module.reward_model.state_dict().items()}
    gathered = [None] * 2
    torch.distributed.all_gather_object(gathered, state)
    if trainer.global_rank == 0:
        # the 16 validation pairs scored in this one process
        batch = data.collate_fn([data.val_dataset[i] for i in range(len(data.val_dataset))])
        module.eval()
        with torch.no_grad():
            scores = module.reward_model.score(batch["input_ids"], batch["attention_mask"])
        good, bad = scores.chunk(2)
        local = {
            "val/rewards/accuracies": float((good > bad).float().mean()),
            "val/rewards/margins": float((good - bad).mean()),
        }
        torch.save({"reduced": reduced, "local": local, "states": gathered, "steps": trainer.global_step},
                   os.path.join(out, "result.pt"))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
    if torch.distributed.is_initialized():  # gloo's threads joined before the interpreter exits
        torch.distributed.destroy_process_group()  # (a rare 'terminate called' abort at exit otherwise)
