"""What the Tinker protocol costs: one RL step (sampler weights, sample G responses, ``forward_backward`` with
``importance_sampling``, ``optim_step``) through the ``tinker`` client against ``tinker-serve`` on loopback, against
the same step in process twice: on the same server's engine called directly (the same model, adapter shape and
work, without HTTP, protobuf, JSON or futures), and through the seed's ``ForwardBackwardPipeline`` (its own copy of
the model with the same LoRA shape and AdamW; its ``sample`` draws one continuation a call, so G calls, then one
padded ``forward_backward`` and ``optim_step``). The three sides alternate in one process, on a Llama of about 25M
parameters, at one thread count.

    PYTHONPATH=$PWD python benchmarks/tinker_server.py --steps 6

Prints one JSON line per step and a summary: the protocol's share of the client's step, as the difference to each
in-process side and as the part of each client step the engine's worker was not busy with the step's work."""

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

        phase: dict[str, float] = {}  # seconds of the step's sampling (sampler weights included), then training

        def client_step() -> None:
            start = time.perf_counter()
            client = remote.save_weights_and_get_sampling_client().result()
            sequences = client.sample(types.ModelInput.from_ints(prompt), args.group, sampling).result().sequences
            phase["sample"] = time.perf_counter() - start
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
            phase["train"] = time.perf_counter() - start - phase["sample"]

        def in_process_step() -> None:
            start = time.perf_counter()
            key = sampler.run_snapshot(local, f"local-{time.monotonic()}")
            sequences = sampler.run_sample(key, prompt, sampling.model_dump(), args.group, False)[0]
            phase["sample"] = time.perf_counter() - start
            data = []
            for i, seq in enumerate(sequences):
                n = len(prompt) - 1
                data.append(Datum(prompt + seq["tokens"][:-1], {
                    "target_tokens": torch.tensor([0] * n + seq["tokens"]),
                    "logprobs": torch.tensor([0.0] * n + seq["logprobs"]),
                    "advantages": torch.tensor([0.0] * n + [i % 2 - 0.5] * len(seq["tokens"]))}))  # fmt: skip
            engine.run_forward_backward(local, FwdBwd(local.model_id, "importance_sampling", {}, data, False))
            engine.run_optim_step(local, {**adam.model_dump()})
            phase["train"] = time.perf_counter() - start - phase["sample"]

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

        pipeline_step = seed_pipeline(folder, engine, prompt, args, adam, phase)
        runs = {"client": client_step, "in_process": lambda: engine.submit(in_process_step).result(),
                "pipeline": pipeline_step}  # fmt: skip
        for run in runs.values():  # warm-up
            run()
        times, outside = {name: [] for name in runs}, []
        phases = {(name, part): [] for name in runs for part in ("sample", "train")}
        for step in range(args.steps):
            for name, run in runs.items():
                wall, work = timed(step, run)
                times[name].append(wall)
                for part in ("sample", "train"):
                    phases[name, part].append(phase[part])
                if name == "client":
                    outside.append((wall - work) / wall)
                line = {"step": step, "side": name, "seconds": round(wall, 4), "engine_seconds": round(work, 4),
                        "sample_s": round(phase["sample"], 4), "train_s": round(phase["train"], 4)}  # fmt: skip
                print(json.dumps(line), flush=True)
        client, local_s = statistics.median(times["client"]), statistics.median(times["in_process"])
        seed_s = statistics.median(times["pipeline"])
        summary = {
            "summary": True,
            "client_step_s": round(client, 4),
            "in_process_step_s": round(local_s, 4),
            "pipeline_step_s": round(seed_s, 4),
            # the sides' medians (noisy on a shared machine) and, within each client step, the time not spent
            # on the engine's work (HTTP, protobuf, JSON, futures, the client's own code)
            "protocol_share_vs_in_process": round((client - local_s) / client, 4),
            "protocol_share_vs_pipeline": round((client - seed_s) / client, 4),
            "protocol_share_within_step": round(statistics.median(outside), 4),
            # medians of each side's sampling (sampler weights included) and training (forward_backward, optim_step)
            **{f"{name}_{part}_s": round(statistics.median(v), 4) for (name, part), v in phases.items()},
            "target": 0.10,
        }
        print(json.dumps(summary), flush=True)
        service.close("success").result()


def seed_pipeline(folder: str, engine, prompt: list[int], args, adam, phase: dict[str, float]):
    """The same RL step through the seed's ``ForwardBackwardPipeline`` in process: its own copy of the model with
    the server's LoRA shape (rank 16 on the same layers) and an AdamW with the same parameters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from aitraining_pl.compat.forward_backward import ForwardBackwardPipeline
    from aitraining_pl.tinker.engine import Lora, target_modules

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(folder).eval()
    targets = target_modules(engine.layers, Lora(16))
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets)).eval()
    pipeline = ForwardBackwardPipeline(model, device=engine.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                                  weight_decay=adam.weight_decay)  # fmt: skip

    def step() -> None:
        start = time.perf_counter()
        samples = [pipeline.sample(prompt, args.max_tokens, temperature=1.0) for _ in range(args.group)]
        phase["sample"] = time.perf_counter() - start
        width = len(prompt) + max(len(s["tokens"]) for s in samples)
        ids = torch.zeros(args.group, width, dtype=torch.long)
        labels, mask = torch.full_like(ids, -100), torch.zeros_like(ids)
        old, advantages = torch.zeros(args.group, width - 1), torch.zeros(args.group, width - 1)
        for i, sample in enumerate(samples):
            tokens, n = sample["tokens"], len(prompt)
            ids[i, : n + len(tokens)] = torch.tensor(prompt + tokens)
            mask[i, : n + len(tokens)] = 1
            labels[i, n : n + len(tokens)] = torch.tensor(tokens)
            old[i, n - 1 : n - 1 + len(tokens)] = torch.tensor(sample["logprobs"])
            advantages[i, n - 1 : n - 1 + len(tokens)] = i % 2 - 0.5
        pipeline.forward_backward(ids, mask, labels, "importance_sampling", old_logprobs=old, advantages=advantages)
        pipeline.optim_step(optimizer, max_grad_norm=None).result()
        phase["train"] = time.perf_counter() - start - phase["sample"]

    return step


if __name__ == "__main__":
    main()
