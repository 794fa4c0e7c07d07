"""What the Tinker protocol costs: one RL step (sampler weights, sample G responses, ``forward_backward`` with
``importance_sampling``, ``optim_step``) through the ``tinker`` client against ``tinker-serve`` on loopback, against
the same step on the same server's engine called in process (the same model, adapter shape and work, without
HTTP, protobuf, JSON or futures). Both sides alternate in one process, on a Llama of about 25M parameters.

    PYTHONPATH=$PWD python benchmarks/tinker_server.py --steps 6

Prints one JSON line per step and a summary: the protocol's share of the client's step, as the two sides'
difference and as the part of each client step the engine's worker was not busy with the step's work."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "helpers"))
from _common import print_header  # noqa: E402

SPEC = {
    "model_type": "llama",
    "vocab_size": 384,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per side (alternated), after one warm-up each")
    parser.add_argument("--group", type=int, default=8, help="samples per step")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per sample")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["TINKER_TELEMETRY"] = "0"
    import tinker
    from tinker import types
    from tinker_fixtures import KEYS, saved_model, tinker_server

    from aitraining_pl.tinker.wire import Datum, FwdBwd

    folder = saved_model(tempfile.mkdtemp(), SPEC)
    prompt = [b + 3 for b in b"Write a short line about the sea:"]
    with tinker_server(folder, tempfile.mkdtemp()) as (url, state):
        engine, sampler = state.engine, state.sampler
        params_count = sum(p.numel() for p in engine.model.parameters())
        print_header(args.threads, parameters=params_count, group=args.group, max_tokens=args.max_tokens)
        service = tinker.ServiceClient(base_url=url, api_key=KEYS[0])
        remote = service.create_lora_training_client(base_model=folder, rank=16, seed=0).result()
        local = engine.models[service.create_lora_training_client(base_model=folder, rank=16, seed=0).result().model_id]
        sampling = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
        adam = types.AdamParams(learning_rate=1e-4)

        def client_step() -> None:
            client = remote.save_weights_and_get_sampling_client().result()
            sequences = client.sample(types.ModelInput.from_ints(prompt), args.group, sampling).result().sequences
            datums = []
            for i, seq in enumerate(sequences):
                n = len(prompt) - 1
                datums.append(types.Datum(
                    model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                    loss_fn_inputs={"target_tokens": torch.tensor([0] * n + seq.tokens),
                                    "logprobs": torch.tensor([0.0] * n + seq.logprobs),
                                    "advantages": torch.tensor([0.0] * n + [i % 2 - 0.5] * len(seq.tokens))},
                ))  # fmt: skip
            remote.forward_backward(datums, "importance_sampling")
            remote.optim_step(adam).result()

        def in_process_step() -> None:
            key = sampler.run_snapshot(local, f"local-{time.monotonic()}")
            sequences, _ = sampler.run_sample(key, prompt, sampling.model_dump(), args.group, False)
            data = []
            for i, seq in enumerate(sequences):
                n = len(prompt) - 1
                data.append(Datum(prompt + seq["tokens"][:-1], {
                    "target_tokens": torch.tensor([0] * n + seq["tokens"]),
                    "logprobs": torch.tensor([0.0] * n + seq["logprobs"]),
                    "advantages": torch.tensor([0.0] * n + [i % 2 - 0.5] * len(seq["tokens"]))}))  # fmt: skip
            engine.run_forward_backward(local, FwdBwd(local.model_id, "importance_sampling", {}, data, False))
            engine.run_optim_step(local, {**adam.model_dump()})

        busy = [0.0]  # seconds the engine's worker spent on the step's work
        submit = engine.submit

        def timed_submit(fn, *args):
            def run():
                start = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    busy[0] += time.perf_counter() - start

            return submit(run)

        engine.submit = timed_submit

        def timed(step, run) -> tuple[float, float]:
            busy[0], start = 0.0, time.perf_counter()
            run()
            return time.perf_counter() - start, busy[0]

        runs = {"client": client_step, "in_process": lambda: engine.submit(in_process_step).result()}
        for run in runs.values():  # warm-up
            run()
        times, outside = {name: [] for name in runs}, []
        for step in range(args.steps):
            for name, run in runs.items():
                wall, work = timed(step, run)
                times[name].append(wall)
                if name == "client":
                    outside.append((wall - work) / wall)
                line = {"step": step, "side": name, "seconds": round(wall, 4), "engine_seconds": round(work, 4)}
                print(json.dumps(line), flush=True)
        client, local_s = statistics.median(times["client"]), statistics.median(times["in_process"])
        summary = {
            "summary": True,
            "client_step_s": round(client, 4),
            "in_process_step_s": round(local_s, 4),
            # the two sides' medians (noisy on a shared machine) and, within each client step, the time not spent
            # on the engine's work (HTTP, protobuf, JSON, futures, the client's own code)
            "protocol_share_vs_in_process": round((client - local_s) / client, 4),
            "protocol_share_within_step": round(statistics.median(outside), 4),
            "target": 0.10,
        }
        print(json.dumps(summary), flush=True)
        service.close("success").result()


if __name__ == "__main__":
    main()
