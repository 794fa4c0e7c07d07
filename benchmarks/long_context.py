"""Long rows on CPU processes: ``--parts a`` (and the parts added beside it), one JSON line per measurement.

(a) Sequence parallelism (Ulysses, ``FSDP2Strategy(sequence_parallel_size=2)``): the policy forward and backward of
one GRPO step (``models.rollout_scoring.response_logps`` with entropies, then ``losses.clipped_policy_loss``) on
one rollout row of 2k, 4k, 8k and 16k tokens (a 256-token prompt and the response), on 2 gloo processes with the
policy sharded by FSDP2 over both: sequence parallel 1 (each rank scores a row of its own) against 2 (both ranks
split one row). Per rank: the bytes of the activations saved for backward (every tensor autograd saves that is
not a parameter, each storage once: ``saved_tensors_hooks``), the process's peak RSS, and seconds per step (mean
of ``--steps`` steps after one warm-up step on a short row). Each (length, size) pair runs in a fresh pair of
processes, the two sizes alternated per length. Target: at sequence parallel 2, activations per rank at most 0.6x
sequence parallel 1's.

    python benchmarks/long_context.py --parts a --lengths 2048 4096 8192 16384 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import peak_rss_mb, print_header  # noqa: E402

PROMPT = 256
#: a small Llama whose attention splits over 2 ranks (4 query heads, 2 key/value heads of 32)
MODEL = {
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
    ids = torch.randint(3, MODEL["vocab_size"], (1, length), generator=g)
    return ids, torch.ones_like(ids)


def grpo_step(policy, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """One GRPO policy forward and backward on the row: (seconds, activation bytes saved for backward)."""
    from aitraining_pl.losses import clipped_policy_loss
    from aitraining_pl.models.rollout_scoring import response_logps

    start = time.perf_counter()
    with SavedActivations() as saved:
        scores = response_logps(policy, ids, mask, PROMPT, with_entropy=True)
        response = mask[:, PROMPT:].float()
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
    policy = shard(build_causal_lm(MODEL, seed=0), mesh)
    grpo_step(policy, *rollout_row(PROMPT + 256, seed=0))  # warm-up (and the scoring probe)
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_a(args: argparse.Namespace) -> None:
    import tempfile

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


PARTS = {"a": part_a}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=sorted(PARTS), help="parts to run")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384], help="(a) row tokens")
    parser.add_argument("--steps", type=int, default=2, help="(a) timed steps per measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    print_header(args.threads, model=MODEL, processes=2)
    for part in args.parts:
        PARTS[part](args)


if __name__ == "__main__":
    main()
