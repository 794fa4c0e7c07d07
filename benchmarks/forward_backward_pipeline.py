"""Cost of the seed's ``ForwardBackwardPipeline`` over plain PyTorch on the same model.

    python benchmarks/forward_backward_pipeline.py
    python benchmarks/forward_backward_pipeline.py --hidden 512 --layers 8 --device cuda

Prints one JSON line per measurement (median seconds over ``--repeats`` runs after one warm-up):

- ``train/plain`` vs ``train/pipeline``: ``--micro-batches`` forward/backward passes of cross-entropy plus one
  AdamW step, written as a plain loop and queued through the pipeline (futures collected at the end);
- ``sample/pipeline`` vs ``sample/generate``: ``--new-tokens`` greedy tokens from one prompt with the
  pipeline's KV-cache sampler and with Hugging Face ``generate``;
- ``overhead``: pipeline time / plain time for each pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _common import print_header

from aitraining_pl.compat.forward_backward import ForwardBackwardPipeline
from aitraining_pl.models import build_causal_lm


def model_config(hidden: int, layers: int) -> dict:
    return {
        "model_type": "llama", "vocab_size": 384, "hidden_size": hidden, "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": max(1, hidden // 32),
        "num_key_value_heads": max(1, hidden // 64), "max_position_embeddings": 2048, "pad_token_id": 0,
        "eos_token_id": 1, "bos_token_id": None, "tie_word_embeddings": False,
    }  # fmt: skip


def timed(fn, repeats: int, sync) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--length", type=int, default=128, help="tokens per row")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print_header(args.threads, device=args.device)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = build_causal_lm(model_config(args.hidden, args.layers)).to(device)
    batches = [torch.randint(3, 384, (args.batch, args.length), device=device) for _ in range(args.micro_batches)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    pipeline = ForwardBackwardPipeline(model, device=device, gradient_accumulation_steps=args.micro_batches)
    common = {"hidden": args.hidden, "layers": args.layers, "batch": args.batch, "length": args.length,
              "device": args.device, "threads": args.threads}  # fmt: skip

    def plain_train():
        for ids in batches:
            (model(input_ids=ids, labels=ids, use_cache=False).loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def pipeline_train():
        futures = [pipeline.forward_backward(ids) for ids in batches]
        futures.append(pipeline.optim_step(optimizer, max_grad_norm=1.0))
        for future in futures:
            future.result()

    prompt = batches[0][0, :16].tolist()

    def plain_generate():
        with torch.no_grad():
            model.generate(torch.tensor([prompt], device=device), max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip

    def pipeline_sample():
        pipeline.sample(prompt, max_tokens=args.new_tokens, temperature=0.0)

    results = {}
    for name, fn in (("train/plain", plain_train), ("train/pipeline", pipeline_train),
                     ("sample/generate", plain_generate), ("sample/pipeline", pipeline_sample)):  # fmt: skip
        results[name] = timed(fn, args.repeats, sync)
        print(json.dumps({"measurement": name, "seconds": round(results[name], 5), **common}), flush=True)
    for kind, plain in (("train", "train/plain"), ("sample", "sample/generate")):
        ratio = results[f"{kind}/pipeline"] / results[plain]
        print(json.dumps({"measurement": f"overhead/{kind}", "pipeline_over_plain": round(ratio, 3), **common}))
    pipeline.shutdown()


if __name__ == "__main__":
    main()
