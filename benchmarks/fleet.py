"""A fleet of generation servers (issue 38, ``generation.servers.fleet``): how rollouts scale with the servers, and
what a push costs.

- ``simulated``: the real ``Fleet`` and asynchronous pipeline (``max_staleness`` 1) over stand-in servers
  (``tests/helpers/standin.py``: a fixed time per generated token, one request at a time) set so that one server
  needs ``--gen-factor`` (3) times the trainer's fixed step (a sleep) for a batch; N = 1, 2, 4, 8. Completions/s
  against N and against the ceiling ``min(N x one server, trainer)``, and the trainer's wait per step.
- ``push``: seconds and bytes of a push of the Qwen2-0.5B shape (random init, CPU) through ``HTTPReplica`` to a
  launched HF server (``start``: the safetensors file in shared memory its worker loads): full fp32 and bf16;
  LoRA adapters only (r ``--lora-r`` on every linear layer): their bytes and the seconds to write them the same
  way (no server loads adapters yet, so no load is timed for them).
- ``protocol``: GRPO at 25M on this machine (``benchmarks/async_rollouts.py``'s run, ``max_staleness`` 1): one HF
  server over HTTP (a fleet of one) and two (a fleet), alternated by round.

    python benchmarks/fleet.py                       # all three parts
    python benchmarks/fleet.py --parts simulated --steps 30

Prints the command, date and versions, then one JSON line per measurement and a table per part. (The ``overhead``
part compared HTTP with the frame protocol of ``aitraining-pl serve``, removed since: docs/benchmarks.md keeps its
figures.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "helpers"))
from _common import print_header, run_child  # noqa: E402

QWEN2_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
             "max_position_embeddings": 512, "tie_word_embeddings": True}  # fmt: skip
#: ``protocol``'s runs: the server forms compared (``async_rollouts.py``'s child with these modes)
PROTOCOL_MODES = {
    "http-1": {"server": {"launch": {"count": 1}}, "max_staleness": 1},
    "http-2": {"server": {"launch": {"count": 2}}, "max_staleness": 1},
}


def simulated(servers: int, args: argparse.Namespace) -> dict:
    """One fleet size: the pipeline's steady-state completions/s and the trainer's wait."""
    import torch
    from standin import StandInReplica

    from aitraining_pl.generation.backend import SampleRequest, StopRule
    from aitraining_pl.generation.config import GenerationConfig
    from aitraining_pl.generation.servers.fleet import Fleet
    from aitraining_pl.models.loading import build_causal_lm
    from aitraining_pl.models.weights import policy_weights
    from aitraining_pl.rollout.asynchronous import RolloutPipeline

    policy = build_causal_lm({"preset": "tiny-llama"})
    tokens = args.prompts * args.generations * args.max_new_tokens
    latency = args.gen_factor * args.step_s / tokens  # one server: gen_factor x the step for a batch
    replicas = [StandInReplica(f"standin://{i}", token_seconds=latency) for i in range(servers)]
    fleet = Fleet(replicas, weights=policy_weights, run="bench")
    pipeline = RolloutPipeline(fleet, policy, rank=0, lag=1, sync_every=1, seed=0)
    ids = torch.randint(1, 50, (args.prompts, 16))
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens)

    def rollout(batch, seed):
        return fleet.sample(
            SampleRequest(ids, torch.ones_like(ids), generation, [0], StopRule(), 0, args.generations, seed)
        )

    trained, waits, start = 0, [], None
    while trained < args.warmup + args.steps:
        ready = pipeline.step_with({}, rollout)
        if ready is None:
            continue
        time.sleep(args.step_s)  # the trainer's fixed step
        pipeline.trained()
        trained += 1
        wait = float(pipeline.stats()["async/trainer_wait_s"])
        if trained == args.warmup:
            start = time.perf_counter()
        elif trained > args.warmup:
            waits.append(wait)
    span = time.perf_counter() - start
    pipeline.close()
    fleet.close()
    one_server = 1.0 / (args.gen_factor * args.step_s)  # batches/s
    ceiling = min(servers * one_server, 1.0 / args.step_s) * args.prompts * args.generations
    rate = args.steps * args.prompts * args.generations / span
    return {"part": "simulated", "servers": servers, "completions_per_s": rate, "ceiling": ceiling,
            "of_ceiling": rate / ceiling, "x_one_server": rate / (one_server * args.prompts * args.generations),
            "trainer_wait_s": statistics.fmean(waits), "step_s": args.step_s,
            "token_seconds": latency}  # fmt: skip


def push(args: argparse.Namespace) -> list[dict]:
    """Push seconds and bytes of the 0.5B shape: fp32 and bf16 to a launched HF server; LoRA adapters' bytes."""
    import torch
    from safetensors.torch import save_file

    from aitraining_pl.generation.config import VLLMConfig
    from aitraining_pl.generation.servers.http import SHARED_MEMORY, HTTPReplica
    from aitraining_pl.generation.servers.start import start
    from aitraining_pl.generation.version import WeightsVersion
    from aitraining_pl.models.loading import build_causal_lm

    torch.manual_seed(0)
    model = build_causal_lm(dict(QWEN2_05B))
    rows = []
    for dtype in ("float32", "bfloat16"):
        folder = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
        model.config.save_pretrained(folder)
        server = start("hf", folder, options=VLLMConfig(), dtype=dtype, threads=1, trainer_gpus=0, timeout=600)
        try:
            replica = HTTPReplica(server.url, server.token)
            weights = [(n, t.detach().to(getattr(torch, dtype))) for n, t in model.state_dict().items()]
            for step in range(args.repeats):
                report = replica.push(weights, WeightsVersion("bench", step))
                rows.append({"part": "push", "weights": dtype, "seconds": report.seconds, "bytes": report.bytes})
                print(json.dumps(rows[-1]), flush=True)
            replica.close()
        finally:
            server.stop()
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(model, LoraConfig(r=args.lora_r, target_modules="all-linear"))
    adapters = {n: t.detach().contiguous() for n, t in lora.state_dict().items() if "lora_" in n}
    size = sum(t.numel() * t.element_size() for t in adapters.values())
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(dir=SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None) as tmp:
            begin = time.perf_counter()
            save_file(adapters, os.path.join(tmp, "adapters.safetensors"))
            seconds = time.perf_counter() - begin
        rows.append({"part": "push", "weights": f"lora r{args.lora_r} adapters (fp32, written only)",
                     "seconds": seconds, "bytes": size})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def protocol_child(args: argparse.Namespace) -> None:
    import async_rollouts

    async_rollouts.MODES.update(PROTOCOL_MODES)
    async_rollouts.child(args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--parts", nargs="+", default=["simulated", "push", "protocol"], choices=["simulated", "push", "protocol"]
    )
    p.add_argument("--servers", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=2, help="passes over the sides (alternated)")
    p.add_argument("--steps", type=int, default=20, help="simulated: steady-state steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--step-s", type=float, default=0.1, help="simulated: the trainer's fixed step")
    p.add_argument("--gen-factor", type=float, default=3.0, help="simulated: one server's batch time / the step")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="push: pushes per way")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--updates", type=int, default=8, help="protocol: updates per run")
    p.add_argument("--modes", nargs="+", default=list(PROTOCOL_MODES), choices=list(PROTOCOL_MODES))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--size", default="25m", help=argparse.SUPPRESS)
    p.add_argument("--learning-rate", type=float, default=3e-4, help=argparse.SUPPRESS)
    p.add_argument("--kl-coef", type=float, default=0.04, help=argparse.SUPPRESS)
    p.add_argument("--gpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return protocol_child(args)
    import torch

    torch.set_num_threads(1)
    print_header(1, parts=args.parts, cores=os.cpu_count(), prompts=args.prompts, generations=args.generations,
                 max_new_tokens=args.max_new_tokens)  # fmt: skip
    if "simulated" in args.parts:
        runs: dict[int, list[dict]] = {}
        for round_ in range(args.rounds):
            for n in args.servers:
                result = simulated(n, args)
                print(json.dumps({"round": round_, **result}), flush=True)
                runs.setdefault(n, []).append(result)
        print("\n| servers | completions/s | ceiling | of ceiling | x one server | trainer wait s/step |")
        print("|---|---|---|---|---|---|")
        for n, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
            print(f"| {n} | {med['completions_per_s']:.1f} | {med['ceiling']:.1f} | {med['of_ceiling']:.2f} | "
                  f"{med['x_one_server']:.2f} | {med['trainer_wait_s']:.3f} |")  # fmt: skip
    if "push" in args.parts:
        rows = push(args)
        full = statistics.median(r["bytes"] for r in rows if r["weights"] == "float32")
        print("\n| weights | seconds (median) | MB | of fp32 bytes |")
        print("|---|---|---|---|")
        for way in dict.fromkeys(r["weights"] for r in rows):
            rs = [r for r in rows if r["weights"] == way]
            print(f"| {way} | {statistics.median(r['seconds'] for r in rs):.3f} | {rs[0]['bytes'] / 1e6:.1f} | "
                  f"{rs[0]['bytes'] / full:.2%} |")  # fmt: skip
    results: dict[str, list[dict]] = {}
    if "protocol" in args.parts:
        for round_ in range(args.rounds):
            for mode in args.modes:
                command = [sys.executable, __file__, "--child", "--mode", mode, "--size", "25m",
                           "--updates", str(args.updates), "--warmup", str(args.warmup), "--prompts",
                           str(args.prompts), "--generations", str(args.generations), "--max-new-tokens",
                           str(args.max_new_tokens)]  # fmt: skip
                result = run_child(command, 1, f"protocol {mode}")
                print(json.dumps({"round": round_, "part": "protocol", **result}), flush=True)
                results.setdefault(mode, []).append(result)
        print("\n| server | completions/s | step s | trainer wait s | push s |")
        print("|---|---|---|---|---|")
        for mode, rs in results.items():
            med = lambda k: statistics.median(r[k] for r in rs if r.get(k) is not None)  # noqa: E731
            print(f"| {mode} | {med('completions_per_s'):.2f} | {med('step_s'):.3f} | {med('trainer_wait_s'):.3f} | "
                  f"{med('push_s'):.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
