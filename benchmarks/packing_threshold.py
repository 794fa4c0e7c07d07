"""Packed vs padded log-prob passes of rollout rows at several padding fractions (where packing starts to pay).

Rollout rows as online RL makes them (left-padded prompts, right-padded responses) through
``models.rollout_scoring.response_logps`` with packing forced on or off, forward + backward of the log-probs and
entropies, on a randomly initialised Llama (``--size`` as in ``dpo_vs_trl.py``), fp32 on CPU. The rows' real
share is set by cutting responses short; each (share, layout) is timed ``--repeats`` times, interleaved, and the
fastest is kept. Prints one JSON line per share: seconds packed and padded, and their ratio.

    python benchmarks/packing_threshold.py --size 3m --rows 16 --prompt 32 --response 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dpo_vs_trl import _model_config  # noqa: E402

import aitraining_pl.models.rollout_scoring as rollout_scoring  # noqa: E402
from aitraining_pl.models import build_causal_lm  # noqa: E402


def rows(n: int, prompt: int, response: int, share: float, generator: torch.Generator):
    """(ids, attention) whose real tokens are about ``share`` of the padded ones (prompts 1/2..1 of ``prompt``)."""
    ids = torch.randint(2, 384, (n, prompt + response), generator=generator)
    attention = torch.zeros_like(ids)
    total = share * n * (prompt + response)
    prompts = torch.randint(prompt // 2, prompt + 1, (n,), generator=generator)
    per_row = max(1.0, (total - float(prompts.sum())) / n)  # response tokens per row, spread +-50%
    lengths = (per_row * torch.empty(n).uniform_(0.5, 1.5, generator=generator)).round().clamp(1, response).long()
    for i in range(n):
        attention[i, prompt - int(prompts[i]) : prompt + int(lengths[i])] = 1
    return ids, attention


def timed(model, ids, attention, prompt, packed: bool) -> float:
    rollout_scoring.will_pack = lambda *a, **k: packed
    model.zero_grad()
    start = time.perf_counter()
    out = rollout_scoring.response_logps(model, ids, attention, prompt, with_entropy=True)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="3m")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.9, 0.75, 0.6, 0.45])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        json.dumps(
            {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        ),
        flush=True,
    )
    model = build_causal_lm(_model_config(args.size), seed=0)
    generator = torch.Generator().manual_seed(0)
    for share in args.shares:
        ids, attention = rows(args.rows, args.prompt, args.response, share, generator)
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for packed in (True, False):
                times[packed].append(timed(model, ids, attention, args.prompt, packed))
        packed, padded = min(times[True]), min(times[False])
        print(
            json.dumps(
                {
                    "real_share": round(float(attention.float().mean()), 3),
                    "packed_s": round(packed, 3),
                    "padded_s": round(padded, 3),
                    "packed_over_padded": round(packed / padded, 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
