"""Reward-model throughput on CPU: ``RewardModule`` training under ``Trainer.fit`` and
``RewardModel.predict_rewards`` scoring.

A randomly initialised Llama trunk (about 3M parameters, byte-level tokenizer), 256 synthetic preference
pairs of 20 to 400 characters, batch 8, fp32. Prints one JSON line per measurement: ``pairs_per_s`` over the
training steps after 3 warm-up steps, and ``texts_per_s`` of ``predict_rewards`` (batch 16).

    python benchmarks/reward_throughput.py [--threads 2] [--pooling last]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from _common import print_header

TRUNK = {"model_type": "llama", "vocab_size": 384, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 1024, "pad_token_id": 0,
         "eos_token_id": 1, "bos_token_id": None, "tie_word_embeddings": False}  # fmt: skip
WORDS = "the of and to in is was that for on as with by at from model data reward policy prompt answer token".split()
PAIRS, BATCH, WARMUP = 256, 8, 3


def _text(rng: random.Random, low: int, high: int) -> str:
    words, size = [], rng.randint(low, high)
    while sum(len(w) + 1 for w in words) < size:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pooling", default="last", choices=["last", "mean", "cls"])
    args = parser.parse_args()
    print_header(args.threads, pooling=args.pooling)

    import lightning.pytorch as pl
    import torch

    from aitraining_pl.datamodules.preference import PreferenceDataModule
    from aitraining_pl.modules.reward import RewardModule

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [_text(rng, 20, 100) for _ in range(PAIRS)]
    chosen = [_text(rng, 20, 300) for _ in range(PAIRS)]
    rejected = [_text(rng, 20, 300) for _ in range(PAIRS)]
    module = RewardModule(model_config=TRUNK, tokenizer_name="byte", pooling_strategy=args.pooling, learning_rate=1e-5)
    data = PreferenceDataModule(prompts=prompts, chosen=chosen, rejected=rejected, tokenizer=module.tokenizer,
                                batch_size=BATCH, val_split=0.0, max_length=512, max_prompt_length=128)  # fmt: skip

    class Clock(pl.Callback):
        def __init__(self):
            self.start = None

        def on_train_batch_start(self, trainer, *_):
            if trainer.global_step == WARMUP:
                self.start = time.perf_counter()

    clock = Clock()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[clock],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    steps = trainer.global_step - WARMUP
    seconds = time.perf_counter() - clock.start
    common = {"params_m": round(sum(p.numel() for p in module.parameters()) / 1e6, 2), "threads": args.threads,
              "pooling": args.pooling, "batch": BATCH}  # fmt: skip
    print(
        json.dumps(
            {"benchmark": "reward_train", **common, "steps": steps, "pairs_per_s": round(steps * BATCH / seconds, 2)}
        )
    )

    texts = [p + c for p, c in zip(prompts, chosen)]
    model = module.reward_model
    model.predict_rewards(texts[:16], batch_size=16)  # warm-up
    start = time.perf_counter()
    model.predict_rewards(texts, batch_size=16)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {"benchmark": "reward_score", **common, "texts": len(texts), "texts_per_s": round(len(texts) / seconds, 2)}
        )
    )


if __name__ == "__main__":
    main()
