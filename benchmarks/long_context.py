"""Long rows on a CPU: one invocation, parts chosen with ``--parts`` (issue 50's benchmark).

- (a) Sequence parallelism (Ulysses, ``FSDP2Strategy(sequence_parallel_size=2)``): the policy forward and backward of
  one GRPO step (``models.rollout_scoring.response_logps`` with entropies, then ``losses.clipped_policy_loss``) on
  one rollout row of 2k, 4k, 8k and 16k tokens (a 256-token prompt and the response), on 2 gloo processes with the
  policy sharded by FSDP2 over both: sequence parallel 1 (each rank scores a row of its own) against 2 (both ranks
  split one row). Per rank: the bytes of the activations saved for backward (every tensor autograd saves that is
  not a parameter, each storage once: ``saved_tensors_hooks``), the process's peak RSS, and seconds per step (mean
  of ``--steps`` steps after one warm-up step on a short row). Each (length, size) pair runs in a fresh pair of
  processes, the two sizes alternated per length. Target: at sequence parallel 2, activations per rank at most 0.6x
  sequence parallel 1's.

- (b) row-count against token-budget micro-batches, on a length-skewed batch. One GRPO update (``update`` of
  ``CriticFreeModule``: every micro-batch's forward and backward, then one AdamW step) over the rows of one rollout
  batch whose response lengths are drawn with a long tail (log-normal, as reasoning traces are), on a randomly
  initialised Llama (``--size`` as in ``dpo_vs_trl.py``), fp32. Sides:

  - ``rows``: ``mini_batch_size`` rows per forward/backward (``--rows-per-micro``), gradient accumulation over the
    batch: the row-count path, whose micro-batch holding the longest row sets the peak;
  - ``budget``: the batch as one minibatch in micro-batches of at most ``--budget`` real tokens (``token_budget``);
  - ``budget+ckpt``: the same with ``gradient_checkpointing`` (item 4: checkpointing, packing, the fused head and
    the budget together);
  - ``reference``: the budget's own cost, one micro-batch of exactly ``--budget`` tokens (rows of the same lengths
    law), forward and backward: the peak the budget promises.

  Each side runs in a process of its own, alternated over ``--repeats``; a measurement is the step's peak resident
  memory above the memory before it (Linux's ``VmHWM`` reset through ``/proc/self/clear_refs`` before the step) and
  its wall and CPU time (one thread: CPU time is the steadier on a shared machine), after one warm-up update.
  Printed per side: the median peak (MiB) and seconds per update (wall and CPU), and the
  tokens of each micro-batch (min, max, spread); then the ratios: ``budget`` peak over ``reference`` peak (target:
  at most 1.1, the peak set by the budget) and ``budget`` seconds over ``rows`` seconds (target: at most 1).

    python benchmarks/long_context.py --parts a --lengths 2048 4096 8192 16384 --steps 1
    python benchmarks/long_context.py --parts b --size 3m --rows 16 --longest 2000 --budget 2560 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import peak_rss_mb, print_header  # noqa: E402
from dpo_vs_trl import SIZES, _model_config  # noqa: E402

SIDES = ("rows", "budget", "budget+ckpt", "reference")
REWARD = "aitraining_pl.rewards:char_fraction_reward"  #: never called: the update trains on a given experience
#: each side's process: one OpenMP thread, and glibc's malloc with a fixed mmap threshold (every block above 64 KiB
#: mapped on its own and returned when freed), so resident memory follows the tensors alive, not the heap's history
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def rss_mb() -> float:
    """This process's resident memory now, MiB (``VmRSS``)."""
    return _status("VmRSS:")


def _status(field: str) -> float:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Reset Linux's high-water mark of resident memory (``VmHWM``) to the current resident memory."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")


def response_lengths(n: int, median: int, sigma: float, longest: int, generator: torch.Generator) -> list[int]:
    """``n`` response lengths from a log-normal law of ``median`` and ``sigma`` (a long tail), cut at ``longest``;
    the first row is ``longest`` itself (the one long trace every batch of reasoning traces has)."""
    draws = torch.empty(n).log_normal_(float(torch.log(torch.tensor(float(median)))), sigma, generator=generator)
    lengths = draws.round().clamp(1, longest).long().tolist()
    lengths[0] = longest
    return lengths


def experience(args, lengths: list[int]):
    """A GRPO experience (``PolicyExperience``) of rows with ``args.prompt`` prompt tokens and these responses."""
    from aitraining_pl.modules.critic_free import PolicyExperience

    g = torch.Generator().manual_seed(1)
    n, R = len(lengths), max(lengths)
    mask = (torch.arange(R) < torch.tensor(lengths)[:, None]).float()
    attention = torch.cat([torch.ones(n, args.prompt, dtype=torch.long), mask.long()], 1)
    ids = torch.randint(2, 384, (n, args.prompt + R), generator=g) * attention
    advantages = torch.randn(n, 1, generator=g).expand(n, R) * mask
    return PolicyExperience(ids, attention, args.prompt, mask, advantages, None, None, mask)


class _Optimizer:
    """Lightning's optimizer wrapper as ``update`` uses it, on one process: AdamW, no gradient sync."""

    def __init__(self, params):
        self.optimizer = torch.optim.AdamW(params, lr=1e-5)

    def toggle_model(self, sync_grad: bool = True):
        from contextlib import nullcontext

        return nullcontext()

    def step(self):
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


def module_for(args, side: str, rows: int):
    """A ``CriticFreeModule`` set up for ``side`` (no trainer: its optimizer and backward are plain torch's)."""
    from aitraining_pl.modules.critic_free import CriticFreeModule

    budgeted = side != "rows"
    per_micro = rows if budgeted else args.rows_per_micro
    module = CriticFreeModule(
        model_config=_model_config(args.size), tokenizer_name="byte", reward=REWARD,
        num_generations=1, kl_coef=0.0, loss_aggregation="token", mini_batch_size=per_micro,
        gradient_accumulation_steps=rows // per_micro, token_budget=args.budget if budgeted else None,
        gradient_checkpointing=side == "budget+ckpt",
    )  # fmt: skip
    module.train()
    optimizer = _Optimizer([p for p in module.parameters() if p.requires_grad])
    module.optimizers = lambda: optimizer
    module.lr_schedulers = lambda: torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0)
    module.manual_backward = lambda loss: loss.backward()
    return module


def micro_tokens(module, exp, side: str, args) -> list[int]:
    """Real tokens of each micro-batch the side's update runs."""
    n = exp.input_ids.shape[0]
    lengths = exp.attention_mask.sum(1)
    if side == "rows":
        return [int(lengths[i : i + args.rows_per_micro].sum()) for i in range(0, n, args.rows_per_micro)]
    return [int(lengths[micro].sum()) for micro, _ in module.micro_batches(exp, torch.arange(n))]


def worker(args) -> None:
    """One side, one process: a warm-up update, then one measured update; prints one JSON line."""
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    lengths = response_lengths(args.rows, args.median, args.sigma, args.longest, g)
    if args.worker == "reference":  # rows of the same law whose tokens fill exactly one budget
        fill, total = [], 0
        for length in lengths[1:] * 4:
            if total + args.prompt + length > args.budget:
                break
            fill.append(length)
            total += args.prompt + length
        fill.append(args.budget - total - args.prompt)
        lengths = fill
    exp = experience(args, lengths)
    n = exp.input_ids.shape[0]
    module = module_for(args, args.worker, n)
    tokens = micro_tokens(module, exp, args.worker, args)
    module.update(exp, n)  # warm-up: the scoring path's probe, allocator
    module.optimizers().zero_grad()
    before = rss_mb()
    reset_peak()
    start, cpu = time.perf_counter(), time.process_time()
    module.update(exp, n)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    peak = _status("VmHWM:") - before
    line = {"side": args.worker, "peak_mb": round(peak, 1), "seconds": round(seconds, 3),
            "cpu_seconds": round(cpu_seconds, 3), "micro_tokens": tokens}  # fmt: skip
    print(json.dumps(line), flush=True)


def part_b(args) -> None:
    """Row-count against token-budget micro-batches (the module docstring)."""
    sides = [s for s in SIDES if s in args.sides]
    results: dict[str, list[dict]] = {s: [] for s in sides}
    for _ in range(args.repeats):
        for side in sides:  # alternated: every repeat runs each side once
            command = [sys.executable, os.path.abspath(__file__), "--worker", side, *sys.argv[1:]]
            out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **WORKER_ENV})
            if out.returncode:
                raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
            results[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {}
    for side, runs in results.items():
        tokens = runs[0]["micro_tokens"]
        summary[side] = {
            "peak_mb": statistics.median(r["peak_mb"] for r in runs),
            "seconds": statistics.median(r["seconds"] for r in runs),
            "cpu_seconds": statistics.median(r["cpu_seconds"] for r in runs),
            "micro_batches": len(tokens),
            "micro_tokens_min": min(tokens),
            "micro_tokens_max": max(tokens),
            "micro_tokens_spread": round(max(tokens) / max(1, min(tokens)), 2),
        }
        print(json.dumps({"part": "b", "side": side, **summary[side], "runs": len(runs)}), flush=True)
    ratios = {"part": "b", "ratio": True}
    if "budget" in summary and "reference" in summary:
        ratios["budget_peak_over_reference"] = round(summary["budget"]["peak_mb"] / summary["reference"]["peak_mb"], 3)
    if "budget" in summary and "rows" in summary:
        ratios["budget_peak_over_rows"] = round(summary["budget"]["peak_mb"] / summary["rows"]["peak_mb"], 3)
        ratios["budget_seconds_over_rows"] = round(summary["budget"]["seconds"] / summary["rows"]["seconds"], 3)
        ratios["budget_cpu_seconds_over_rows"] = round(
            summary["budget"]["cpu_seconds"] / summary["rows"]["cpu_seconds"], 3
        )
    if "budget+ckpt" in summary and "budget" in summary:
        ratios["ckpt_peak_over_budget"] = round(summary["budget+ckpt"]["peak_mb"] / summary["budget"]["peak_mb"], 3)
    print(json.dumps(ratios), flush=True)


SP_PROMPT = 256
#: a small Llama whose attention splits over 2 ranks (4 query heads, 2 key/value heads of 32)
SP_MODEL = {
    "model_type": "llama", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32768, "tie_word_embeddings": False,
}  # fmt: skip


class SavedActivations:
    """Bytes of the distinct storages autograd saves for backward inside the block, parameters left out."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_leaf and tensor.requires_grad) and not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def rollout_row(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SP_MODEL["vocab_size"], (1, length), generator=g)
    return ids, torch.ones_like(ids)


def grpo_step(policy, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """One GRPO policy forward and backward on the row: (seconds, activation bytes saved for backward)."""
    from aitraining_pl.losses import clipped_policy_loss
    from aitraining_pl.models.rollout_scoring import response_logps

    start = time.perf_counter()
    with SavedActivations() as saved:
        scores = response_logps(policy, ids, mask, SP_PROMPT, with_entropy=True)
        response = mask[:, SP_PROMPT:].float()
        advantages = torch.full_like(response, 0.5)
        loss, _ = clipped_policy_loss(scores.logprobs, scores.logprobs.detach(), advantages, response)
        loss = loss - 1e-3 * (scores.entropy * response).sum() / response.sum()
    loss.backward()
    policy.zero_grad(set_to_none=True)
    return time.perf_counter() - start, saved.bytes


def part_a_worker(rank: int, length: int, size: int, steps: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from aitraining_pl.models import build_causal_lm, sequence_parallel
    from aitraining_pl.models.sharding import shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    sequence_parallel.set_group(dist.group.WORLD if size == 2 else None)
    policy = shard(build_causal_lm(SP_MODEL, seed=0), mesh)
    grpo_step(policy, *rollout_row(SP_PROMPT + 256, seed=0))  # warm-up (and the scoring probe)
    row = rollout_row(length, seed=1 if size == 2 else 1 + rank)  # sequence parallel 1: a row per rank
    results = [grpo_step(policy, *row) for _ in range(steps)]
    figures = {
        "rank": rank,
        "seconds_per_step": sum(s for s, _ in results) / steps,
        "activations_mb": max(b for _, b in results) / 2**20,
        "peak_rss_mb": peak_rss_mb(),
    }
    gathered = [None, None]
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(gathered, handle)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # not the interpreter's teardown, where gloo's threads now and then abort


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_a(args: argparse.Namespace) -> None:
    """Sequence parallel 1 against 2 (the module docstring)."""
    import tempfile

    print(json.dumps({"part": "a", "model": SP_MODEL, "prompt": SP_PROMPT, "steps": args.steps}), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for length in args.lengths:
            per_size = {}
            for size in (1, 2):
                out = os.path.join(folder, f"{length}-{size}.json")
                torch.multiprocessing.spawn(
                    part_a_worker, args=(length, size, args.steps, free_port(), out), nprocs=2, join=True
                )
                with open(out) as handle:
                    ranks = json.load(handle)
                per_size[size] = {
                    key: max(r[key] for r in ranks) for key in ("seconds_per_step", "activations_mb", "peak_rss_mb")
                }
                print(json.dumps({"part": "a", "tokens": length, "sequence_parallel": size, **per_size[size]}))
            ratio = {k: per_size[2][k] / per_size[1][k] for k in per_size[1]}
            print(json.dumps({"part": "a", "tokens": length, "sp2_over_sp1": ratio}), flush=True)


#: the parts of this benchmark, by letter; ``--parts`` runs the ones named, in this order
PARTS = {"a": part_a, "b": part_b}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="".join(PARTS), help=f"which parts to run (of {''.join(PARTS)})")
    parser.add_argument("--size", choices=sorted(SIZES), default="3m", help="model size (dpo_vs_trl.py's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per side (median reported)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384], help="(a) row tokens")
    parser.add_argument("--steps", type=int, default=1, help="(a) timed steps per measurement (after a warm-up)")
    parser.add_argument("--rows", type=int, default=16, help="(b) rollout rows in the batch")
    parser.add_argument("--prompt", type=int, default=64, help="(b) prompt tokens per row")
    parser.add_argument("--median", type=int, default=150, help="(b) median response length")
    parser.add_argument("--sigma", type=float, default=1.0, help="(b) log-normal sigma of the response lengths")
    parser.add_argument("--longest", type=int, default=2000, help="(b) the longest response (the first row's)")
    parser.add_argument("--budget", type=int, default=2560, help="(b) token_budget of the budget sides")
    parser.add_argument("--rows-per-micro", type=int, default=4, help="(b) rows per micro-batch of the rows side")
    parser.add_argument("--sides", default=",".join(SIDES), help="(b) sides to run, comma-separated")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {''.join(sorted(unknown))}; this file has {''.join(PARTS)}")
    if args.worker:
        worker(args)
        return
    print_header(args.threads, size=args.size, parts=args.parts)
    for letter in PARTS:
        if letter in args.parts:
            PARTS[letter](args)


if __name__ == "__main__":
    main()
