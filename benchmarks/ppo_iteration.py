"""Time one PPO iteration of ``PPOModule`` under ``Trainer.fit``, split into its parts, against the same
model's plain ``generate`` and forward/backward passes timed alone.

    python benchmarks/ppo_iteration.py                      # tiny-ish Llama on CPU
    python benchmarks/ppo_iteration.py --hidden 512 --layers 8 --accelerator gpu --precision bf16-mixed

Prints one JSON line per measurement (mean seconds over the measured iterations; the first iteration is
a warm-up and is not counted). A plain round runs right after each PPO iteration, so both see the same machine
load; the random model rarely samples EOS, so responses (PPO's and plain) mostly run to ``max_new_tokens``:

- ``ppo/<part>``: ``iteration`` (``training_step`` wall time), ``generation`` (``generate`` with KV cache,
  masks), ``scoring`` (decode + reward source), ``old_forward`` (policy log-probs and values, no grad),
  ``reference_forward``, ``update`` (``num_iterations`` x minibatch forward/backward/optimizer steps) and
  ``other`` (the rest: concatenation, rewards, GAE, whitening, logging and its all-reduce);
- ``plain/<part>``: the same model's ``generate`` for the same prompts and length, one no-grad forward of
  the whole batch, and the update's forward/backward/AdamW steps on plain cross-entropy;
- ``overhead``: PPO iteration minus the plain parts (generation + 2 no-grad forwards + update), absolute
  and relative; with the mean response lengths of both (PPO: masked tokens; plain: generated tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from functools import wraps

import lightning.pytorch as pl
import torch
from _common import print_header

from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.modules.ppo import PPOModule
from aitraining_pl.rollout import GenerationConfig


def model_config(hidden: int, layers: int) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 384,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": max(1, hidden // 32),
        "num_key_value_heads": max(1, hidden // 64),
        "max_position_embeddings": 1024,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    }


def never_ending_reward(prompts, responses, metadata):
    return [len(r) / 100.0 for r in responses]


class Clock:
    """Accumulates wall time per part within one iteration."""

    def __init__(self, sync):
        self.sync, self.current, self.iterations = sync, defaultdict(float), []

    def wrap(self, obj, name, part=None):
        original = getattr(obj, name)

        @wraps(original)
        def timed(*args, **kwargs):
            key = part(args, kwargs) if callable(part) else (part or name)
            self.sync()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.sync()
                self.current[key] += time.perf_counter() - start

        setattr(obj, name, timed)

    def end_iteration(self):
        self.iterations.append(dict(self.current))
        self.current = defaultdict(float)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--mini-batch-size", type=int, default=4)
    parser.add_argument("--num-iterations", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=4, help="measured iterations (plus one warm-up)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print_header(args.threads, accelerator=args.accelerator, precision=args.precision)
    pl.seed_everything(0)
    device = torch.device("cuda" if args.accelerator in ("gpu", "cuda") else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    module = PPOModule(
        model_config=model_config(args.hidden, args.layers),
        tokenizer_name="byte",
        reward=never_ending_reward,
        generation=GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0),
        learning_rate=1e-5,
        mini_batch_size=args.mini_batch_size,
        num_iterations=args.num_iterations,
    )
    prompts = [("x" * (args.prompt_length - 3)) + f"{i:03d}" for i in range(args.batch_size * (args.iterations + 1))]
    data = PromptDataModule(
        prompts=prompts, tokenizer="byte", batch_size=args.batch_size, max_prompt_length=args.prompt_length
    )

    clock = Clock(sync)
    clock.wrap(module, "generate", "generation")
    clock.wrap(module, "score", "scoring")
    clock.wrap(module, "reference_logprobs", "reference_forward")
    clock.wrap(module, "update", "update")  # OnlineRLModule.update: the num_iterations passes
    # module.forward outside the update is the no-grad old log-probs / values pass
    clock.wrap(module, "forward", lambda a, k: "update_forward" if torch.is_grad_enabled() else "old_forward")
    clock.wrap(module, "training_step", "iteration")

    # the same model, plain (a copy, so PPO's weights are untouched): generate, a no-grad forward, and
    # forward/backward/AdamW steps on cross-entropy, run right after each PPO iteration so that both see the
    # same machine load
    import copy

    plain_model = copy.deepcopy(module.policy).to(device)
    optimizer = torch.optim.AdamW(plain_model.parameters(), lr=1e-5)
    data.setup()
    batch = data.collate_fn([data.train_dataset[i] for i in range(args.batch_size)])
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    plain, lengths = defaultdict(list), defaultdict(list)

    def plain_round():
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision.startswith("bf16"))
        with autocast:
            sync()
            t = time.perf_counter()
            with torch.no_grad():
                plain_model.eval()
                out = plain_model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    max_new_tokens=args.max_new_tokens,
                    pad_token_id=0,
                    eos_token_id=1,
                    use_cache=True,
                )
                plain_model.train()
            sync()
            plain["generation"].append(time.perf_counter() - t)
            lengths["plain"].append(out.shape[1] - ids.shape[1])
            t = time.perf_counter()
            with torch.no_grad():
                plain_model(input_ids=out, attention_mask=torch.ones_like(out)).logits.float().sum().item()
            sync()
            plain["no_grad_forward"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for _ in range(args.num_iterations):
                for start in range(0, args.batch_size, args.mini_batch_size):
                    chunk = out[start : start + args.mini_batch_size]
                    plain_model(input_ids=chunk, labels=chunk).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            sync()
            plain["update"].append(time.perf_counter() - t)

    class EndIteration(pl.Callback):
        def on_train_batch_end(self, trainer, *unused):
            clock.end_iteration()
            lengths["ppo"].append(float(trainer.callback_metrics["train/completion_length"]))
            plain_round()

    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[EndIteration()],
    )
    trainer.fit(module, data)
    measured = clock.iterations[1:]
    ppo = {k: statistics.mean(it.get(k, 0.0) for it in measured) for k in measured[0]}
    ppo["other"] = ppo["iteration"] - sum(
        ppo[k] for k in ("generation", "scoring", "old_forward", "reference_forward", "update")
    )
    plain = {k: statistics.mean(v[1:]) for k, v in plain.items()}
    policy = module.policy

    setup = {
        "hidden": args.hidden,
        "layers": args.layers,
        "batch_size": args.batch_size,
        "mini_batch_size": args.mini_batch_size,
        "num_iterations": args.num_iterations,
        "prompt_length": args.prompt_length,
        "max_new_tokens": args.max_new_tokens,
        "accelerator": args.accelerator,
        "precision": args.precision,
        "threads": args.threads,
        "iterations": len(measured),
        "response_length_ppo": round(statistics.mean(lengths["ppo"][1:]), 1),
        "response_length_plain": round(statistics.mean(lengths["plain"][1:]), 1),
        "params_M": round(sum(p.numel() for p in policy.parameters()) / 1e6, 2),
    }
    for part, seconds in ppo.items():
        if part != "update_forward":
            share = seconds / ppo["iteration"]
            print(
                json.dumps(
                    {"measurement": f"ppo/{part}", "seconds": round(seconds, 4), "share": round(share, 3), **setup}
                )
            )
    for part, seconds in plain.items():
        print(json.dumps({"measurement": f"plain/{part}", "seconds": round(seconds, 4), **setup}))
    baseline = plain["generation"] + 2 * plain["no_grad_forward"] + plain["update"]
    overhead = ppo["iteration"] - baseline
    print(
        json.dumps(
            {
                "measurement": "overhead",
                "seconds": round(overhead, 4),
                "relative": round(overhead / baseline, 3),
                "ppo_iteration": round(ppo["iteration"], 4),
                "plain_total": round(baseline, 4),
                **setup,
            }
        )
    )


if __name__ == "__main__":
    main()
