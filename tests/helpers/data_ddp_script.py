"""Run by tests/datamodules/test_data_formats.py: a DPO fit under 2-process CPU DDP on a JSONL file. Each rank
counts its tokenizer calls before ``setup`` and inside it; rank 0 writes the counts of both ranks to
OUT/counts.json."""

import json
import os
import sys

import torch

torch.set_num_threads(1)
HELPERS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HELPERS, os.path.dirname(HELPERS)]  # the helpers and tests/ (conftest)

import lightning.pytorch as pl  # noqa: E402
import transformers  # noqa: E402
from conftest import TINY_LLAMA  # noqa: E402

from aitraining_pl import DPOModule  # noqa: E402
from aitraining_pl.datamodules.preference import PreferenceDataModule  # noqa: E402

CALLS = [0]
_original = transformers.ByT5Tokenizer.__call__


def _counting(self, *args, **kwargs):
    CALLS[0] += 1
    return _original(self, *args, **kwargs)


transformers.ByT5Tokenizer.__call__ = _counting


class CountingData(PreferenceDataModule):
    def setup(self, stage=None):
        before = CALLS[0]
        super().setup(stage)
        self.counts = {"before_setup": before, "in_setup": CALLS[0] - before}


def main(out: str) -> None:
    path = os.path.join(out, "pairs.jsonl")
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte")
    data = CountingData(data_path=path, tokenizer=module.tokenizer, val_split=0.0, batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    gathered = [None] * 2
    torch.distributed.all_gather_object(gathered, data.counts)
    if trainer.global_rank == 0:
        with open(os.path.join(out, "counts.json"), "w") as handle:
            json.dump(gathered, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    if torch.distributed.is_initialized():  # gloo's threads joined before the interpreter exits
        torch.distributed.destroy_process_group()  # (a rare 'terminate called' abort at exit otherwise)
