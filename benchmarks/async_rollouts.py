"""Asynchronous vs synchronous online RL on this machine (issue 31): completions per second, the step timeline and the
held-out reward after the same number of updates.

GRPO on the quickstart task (``aitraining_pl/data/quickstart_prompts.jsonl``, ``char_fraction_reward``) with a
randomly initialised Llama of about 3M or 25M parameters (byte tokenizer). Each run is its own process with one CPU
thread for the trainer; the modes:

- ``sync``: the synchronous loop in one process (the policy samples itself: ``generation.server: none``);
- ``sync-server``: the synchronous loop sampling on a generation server the trainer starts (``server: launch``,
  the HF decoder, one thread of its own): the same two processes as the asynchronous runs, one always waiting;
- ``async-1``, ``async-2``: ``max_staleness`` 1 and 2 on that server: the next batches are sampled while the
  current one trains.

The modes alternate within each round (``--rounds``), on the same prompts and seed, so a slow spell of the machine
falls on all of them. A step's figures: wall time; the trainer's wait for rollouts; the generator's busy and idle
time and the weight push (asynchronous runs, from the pipeline's ``async/...`` metrics); the staleness and the
sampler/trainer gap (``sampling/mismatch_kl``, masked sequences). Throughput is over the steady-state updates (the
first ``--warmup`` updates left out). The held-out reward is the mean reward of one sample per held-out
prompt after the run (temperature 1, in-process, the same seed for every mode).

    python benchmarks/async_rollouts.py                       # 25m and 3m, all modes, 2 rounds
    python benchmarks/async_rollouts.py --sizes 3m --rounds 1 --updates 6

A GPU machine, one command: ``python benchmarks/async_rollouts.py --gpu --sizes 0.5b`` runs the same modes in bf16
with ``generation.backend: vllm`` on the Qwen2-0.5B shape (random weights), the launched vLLM server on the same GPU
(``generation.vllm.gpu_memory_utilization`` 0.3, passed to it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import print_header, run_child  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "3m": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4},
    "25m": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
}  # fmt: skip
MODES = {
    "sync": {},
    "sync-server": {"server": "launch"},
    "async-1": {"server": "launch", "max_staleness": 1},
    "async-2": {"server": "launch", "max_staleness": 2},
}


def model_config(size: str) -> dict:
    return {"model_type": "llama", "vocab_size": 384, "max_position_embeddings": 1024, "pad_token_id": 0,
            "eos_token_id": 1, "bos_token_id": 1, "num_key_value_heads": SIZES[size]["num_attention_heads"],
            **SIZES[size]}  # fmt: skip


def child(args: argparse.Namespace) -> None:
    """One run (in its own process): train ``--updates`` updates in ``--mode`` and print a ``RESULT`` line."""
    import lightning.pytorch as pl
    import torch

    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.modules.critic_free import GRPOModule
    from aitraining_pl.rollout import GenerationConfig

    torch.set_num_threads(1)
    pl.seed_everything(0)
    generation = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "top_p": 1.0, **MODES[args.mode]}
    if args.gpu:
        generation["backend"] = "vllm"
    module = GRPOModule(
        reward="aitraining_pl.rewards:char_fraction_reward",
        model_config=model_config(args.size),
        tokenizer_name="byte",
        num_generations=args.generations,
        mini_batch_size=args.prompts * args.generations // 2,
        gradient_accumulation_steps=2,  # one optimizer step per iteration (TRL's steps_per_generation default)
        learning_rate=args.learning_rate,
        kl_coef=args.kl_coef,
        generation=GenerationConfig(**generation),
        padding_free=True,
    )
    data = PromptDataModule(data_path=str(ROOT / "aitraining_pl/data/quickstart_prompts.jsonl"), val_split=0.2,
                            batch_size=args.prompts)  # fmt: skip
    steps: list[dict] = []

    class Timeline(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, *rest):
            pipeline = pl_module.pipeline
            trained = pipeline is None or pipeline.version > sum(s["trained"] for s in steps)
            m = {
                k.removeprefix("train/"): float(v)
                for k, v in trainer.callback_metrics.items()
                if k.startswith("train/")
            }
            kept = {k: m[k] for k in m if k.startswith(("async/", "sampling/")) or k == "reward_mean"}
            now = time.perf_counter()
            steps.append({"end": now, "seconds": now - self.start, "trained": trained, **kept})

    rollout = module.rollout

    def timed_rollout(*a, **k):  # the synchronous loop's generation time (the trainer waits for it)
        t0 = time.perf_counter()
        try:
            return rollout(*a, **k)
        finally:
            if module.pipeline is None:
                module.sync_rollout_seconds = getattr(module, "sync_rollout_seconds", 0.0) + time.perf_counter() - t0

    module.rollout = timed_rollout
    updates_per_iteration = 1  # prompts x generations = 2 micro-batches accumulated, one iteration
    trainer = pl.Trainer(accelerator="gpu" if args.gpu else "cpu", devices=1, precision="bf16-true" if args.gpu else
                         "32-true", max_steps=args.updates * updates_per_iteration, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timeline()])  # fmt: skip
    start = time.perf_counter()
    trainer.fit(module, data)
    wall = time.perf_counter() - start
    trained = [s for s in steps if s["trained"]]
    steady = trained[args.warmup :]
    span = steady[-1]["end"] - trained[args.warmup - 1]["end"] if args.warmup else sum(s["seconds"] for s in steady)
    completions = len(steady) * args.prompts * args.generations
    # held-out reward: one sample per held-out prompt, in this process, the same seed for every mode
    module.rollout = rollout
    torch.manual_seed(1234)
    rewards = []
    with torch.no_grad():
        for batch in data.val_dataloader():
            rewards += module.rollout(batch, 1).scores.tolist()
    mean = lambda key: statistics.fmean(s[key] for s in steady if key in s) if any(key in s for s in steady) else None  # noqa: E731
    result = {
        "size": args.size, "mode": args.mode, "updates": len(trained), "completions_per_s": completions / span,
        "step_s": span / len(steady), "fit_s": wall, "trainer_wait_s": mean("async/trainer_wait_s"),
        "generator_busy_s": mean("async/generator_busy_s"), "generator_idle_s": mean("async/generator_idle_s"),
        "push_s": mean("async/push_s"), "staleness": mean("async/staleness"),
        "staleness_max": max((s.get("async/staleness/max", 0.0) for s in steady), default=0.0),
        "mismatch_kl": mean("sampling/mismatch_kl"), "masked_sequences": mean("sampling/masked_sequences"),
        "sync_rollout_s": getattr(module, "sync_rollout_seconds", 0.0) / max(1, len(trained)) or None,
        "train_reward_last": trained[-1].get("reward_mean"), "heldout_reward": statistics.fmean(rewards),
    }  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["25m", "3m"], choices=sorted(SIZES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rounds", type=int, default=2, help="passes over the modes (alternated)")
    p.add_argument("--updates", type=int, default=10, help="updates (iterations that train) per run")
    p.add_argument("--warmup", type=int, default=2, help="updates left out of the throughput")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--generations", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=3e-4)
    p.add_argument("--kl-coef", type=float, default=0.04, help="0: no reference pass (DAPO-style)")
    p.add_argument("--gpu", action="store_true", help="vLLM on a GPU, bf16 (the 0.5b size)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    print_header(1, server_threads=1, sizes=args.sizes, modes=args.modes, updates=args.updates, prompts=args.prompts,
                 generations=args.generations, max_new_tokens=args.max_new_tokens, learning_rate=args.learning_rate,
                 kl_coef=args.kl_coef)  # fmt: skip
    results: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for size in args.sizes:
            for mode in args.modes:
                command = [sys.executable, __file__, "--child", "--mode", mode, "--size", size]
                for flag in (
                    "updates",
                    "warmup",
                    "prompts",
                    "generations",
                    "max_new_tokens",
                    "learning_rate",
                    "kl_coef",
                ):
                    command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
                command += ["--gpu"] if args.gpu else []
                result = run_child(command, 1, f"{size} {mode}")
                print(json.dumps({"round": round_, **result}), flush=True)
                results.setdefault((size, mode), []).append(result)
    print("\n| size | mode | completions/s | x sync | x sync-server | step s | trainer wait s | generator busy s | "
          "generator idle s | push s | staleness (max) | mismatch_kl | held-out reward |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        base = {m: statistics.median(r["completions_per_s"] for r in results[(size, m)]) for m in args.modes}
        for mode in args.modes:
            runs = results[(size, mode)]
            med = lambda key: statistics.median(r[key] for r in runs) if runs[0].get(key) is not None else None  # noqa: E731
            cps = med("completions_per_s")
            fmt = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
            ratio = lambda ref: fmt(cps / base[ref], 2) if ref in base else "-"  # noqa: E731
            print(f"| {size} | {mode} | {cps:.1f} | {ratio('sync')} | {ratio('sync-server')} | {fmt(med('step_s'), 2)} "
                  f"| {fmt(med('trainer_wait_s'))} | {fmt(med('generator_busy_s'))} | {fmt(med('generator_idle_s'))} "
                  f"| {fmt(med('push_s'))} | {fmt(med('staleness'), 2)} ({fmt(med('staleness_max'), 0)}) "
                  f"| {fmt(med('mismatch_kl'), 5)} | {fmt(med('heldout_reward'))} |")  # fmt: skip


if __name__ == "__main__":
    main()
