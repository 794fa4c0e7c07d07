"""Memory per process of ``DPOModule`` under 2-process FSDP2 (``--trainer.strategy fsdp2``) against DDP.

The same randomly initialised Llama (``25m`` or ``3m`` of ``dpo_vs_trl.py``), the same pairs (``dpo_vs_trl``'s
synthetic data, batch 4 per rank, up to 512 tokens), fp32 on CPU with gloo, ``--steps`` optimizer steps. Each
strategy runs in its own pair of processes; the strategies alternate over ``--repeats`` rounds. Per rank it
reports the peak RSS of the process and the bytes of training state it holds, counted tensor by tensor after the
last step: parameters (a ``DTensor``'s local shard under FSDP2), gradients and AdamW's two moments, and the frozen
reference copy. Sharding over 2 ranks should halve the training state per process.

    python benchmarks/fsdp_memory.py --size 25m --steps 3

Prints the command, date and versions, one JSON line per rank and run, and one ``ratio`` line (FSDP2 / DDP of
the mean training state and the mean peak RSS per process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import print_header, quiet_trainer  # noqa: E402
from dpo_vs_trl import MAX_LENGTH, SIZES, _model_config, _peak_rss_mb, make_pairs  # noqa: E402

STRATEGIES = ("ddp", "fsdp2")
PER_RANK_BATCH = 4


def _local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def training_state_mb(module, optimizer) -> dict[str, float]:
    """MB of parameters, gradients, optimizer state and frozen reference this process holds."""
    params = list(module.parameters())
    reference = module.reference.frozen_copy if module.reference is not None else None
    parts = {
        "parameters": sum(_local_bytes(p) for p in params),
        "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values() if v.dim()),
        "reference": sum(_local_bytes(p) for p in reference.parameters()) if reference is not None else 0,
    }
    return {name: round(value / 2**20, 1) for name, value in parts.items()}


def run(args) -> None:
    """One training run (both ranks: Lightning re-launches this command for rank 1)."""
    import torch

    torch.set_num_threads(args.threads)

    from aitraining_pl.datamodules.preference import PreferenceDataModule
    from aitraining_pl.modules.dpo import DPOModule

    module = DPOModule(model_config=_model_config(args.size), tokenizer_name="byte", warmup_ratio=0.0)
    data = PreferenceDataModule(
        data_path=args.data, val_split=0.0, tokenizer=module.tokenizer, batch_size=PER_RANK_BATCH,
        max_length=MAX_LENGTH, max_prompt_length=MAX_LENGTH - 1, shuffle=False,
    )  # fmt: skip
    trainer = quiet_trainer(devices=2, strategy=args.strategy, max_steps=args.steps)
    start = time.perf_counter()
    trainer.fit(module, data)
    result = {
        "strategy": args.strategy,
        "size": args.size,
        "rank": trainer.global_rank,
        "steps": trainer.global_step,
        "fit_s": round(time.perf_counter() - start, 2),
        "training_state_mb": training_state_mb(module, trainer.optimizers[0]),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(result, handle)


def spawn(strategy: str, data: str, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, os.path.abspath(__file__), "--run", "--strategy", strategy, "--data", data,
                   "--out", out, "--size", args.size, "--steps", str(args.steps),
                   "--threads", str(args.threads)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{strategy} failed:\n{proc.stderr[-3000:]}")
        ranks = []
        for rank in (0, 1):
            with open(os.path.join(out, f"rank{rank}.json")) as handle:
                ranks.append(json.load(handle))
        return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="25m", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="alternating rounds")
    parser.add_argument("--threads", type=int, default=1, help="threads per process")
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        return run(args)
    print_header(args.threads, processes=2)
    results: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
    with tempfile.TemporaryDirectory() as folder:
        data = os.path.join(folder, "pairs.jsonl")
        make_pairs(data, n=2 * PER_RANK_BATCH * args.steps)
        for _ in range(args.repeats):
            for strategy in STRATEGIES:
                for line in spawn(strategy, data, args):
                    print(json.dumps(line), flush=True)
                    results[strategy].append(line)

    def mean(strategy: str, key) -> float:
        values = [key(r) for r in results[strategy]]
        return sum(values) / len(values)

    state = {s: mean(s, lambda r: sum(r["training_state_mb"].values())) for s in STRATEGIES}
    rss = {s: mean(s, lambda r: r["peak_rss_mb"]) for s in STRATEGIES}
    ratios = {"training_state_ratio": state["fsdp2"] / state["ddp"], "peak_rss_ratio": rss["fsdp2"] / rss["ddp"]}
    line = {"ratio": True, "size": args.size, "training_state_mb": state, "peak_rss_mb": rss}
    print(json.dumps(line | {k: round(v, 3) for k, v in ratios.items()}))


if __name__ == "__main__":
    main()
