"""``balance_ranks`` on two data-parallel ranks whose rollouts differ in length (issue 50): GRPO under Lightning's DDP
(gloo, 2 processes, ``--threads`` threads each) on a randomly initialised Llama (``--hidden``, ``--layers``), rank 0
sampling responses of up to ``--short`` tokens and rank 1 of up to ``--long`` (a random model rarely ends early, so
the lengths are about those), ``--prompts`` prompts x G = ``--generations`` per rank and step, ``--iterations``
passes over each rollout in one minibatch. Sides: ``off`` (each rank trains on what it sampled) and ``on``
(``balance_ranks: true``: the prompt groups dealt by real tokens after sampling), alternated over ``--repeats``, each
run in fresh processes. Printed per run: the mean over the steps after the first of the update's seconds
(``train/timing_s/update_actor``; under DDP the faster rank waits for the slower one in every gradient all-reduce,
so each rank's figure is the slower rank's), of the step's, and the logged token imbalance; then the medians and the
ratios ``off / on``.

    python benchmarks/rank_balance.py --short 8 --long 120 --steps 4 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import print_header, run_child  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(args: argparse.Namespace) -> None:
    """One run (both ranks: Lightning launches the second); rank 0 prints the ``RESULT`` line."""
    import lightning.pytorch as pl
    import torch

    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.modules.critic_free import GRPOModule

    torch.set_num_threads(args.threads)
    steps: list[dict[str, float]] = []

    class Lengths(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.generation.max_new_tokens = args.long if trainer.global_rank else args.short

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if "timing_s" in k or "rank_" in k})

    pl.seed_everything(0)
    config = {"preset": "tiny-llama", "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
              "num_hidden_layers": args.layers, "num_attention_heads": 4, "num_key_value_heads": 4}  # fmt: skip
    module = GRPOModule(
        model_config=config,
        tokenizer_name="byte",
        reward=lambda prompts, responses, metadata: [float(len(r) % 5) for r in responses],
        num_generations=args.generations,
        generation={"max_new_tokens": args.long, "temperature": 1.0, "top_p": 1.0},
        mini_batch_size=args.prompts * args.generations,
        num_iterations=args.iterations,
        learning_rate=1e-4,
        kl_coef=0.0,
        balance_ranks=args.side == "on",
    )
    prompts = [f"prompt number {i}" for i in range(2 * args.prompts * args.steps)]
    data = PromptDataModule(prompts=prompts, tokenizer="byte", batch_size=args.prompts)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps * args.iterations, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Lengths()],
    )  # fmt: skip
    trainer.fit(module, data)
    if trainer.global_rank == 0:
        later = steps[1:] or steps
        mean = {k: statistics.mean(s[k] for s in later) for k in later[0]}
        print("RESULT " + json.dumps({"side": args.side, "steps": len(steps), **mean}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", type=int, default=8, help="rank 0's max_new_tokens")
    parser.add_argument("--long", type=int, default=120, help="rank 1's max_new_tokens")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per rank and step")
    parser.add_argument("--generations", type=int, default=4, help="G")
    parser.add_argument("--iterations", type=int, default=4, help="passes over each rollout (num_iterations)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="rollouts per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--side", choices=["off", "on"], help="(child processes)")
    args = parser.parse_args()
    if args.side:
        return child(args)
    print_header(args.threads, ranks=2)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("side", "repeats")]
    for _ in range(args.repeats):
        for side in ("off", "on"):
            result = run_child([sys.executable, __file__, *forwarded, f"--side={side}"], args.threads, side)
            print(json.dumps(result), flush=True)
            runs[side].append(result)
    median = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "side"} for s, rs in runs.items()}
    update, step = "train/timing_s/update_actor", "train/timing_s/step"
    print(json.dumps({"median": median, "update_off_over_on": median["off"][update] / median["on"][update],
                      "step_off_over_on": median["off"][step] / median["on"][step]}))  # fmt: skip


if __name__ == "__main__":
    main()
