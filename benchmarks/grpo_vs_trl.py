"""GRPO throughput and peak memory: ``GRPOModule`` under ``Trainer.fit`` vs TRL's ``GRPOTrainer``.

Both sides: the same randomly initialised Llama (``3m`` or ``25m``, byte-level tokenizer; sizes as in
``dpo_vs_trl.py``; built once, saved, and loaded from that folder by both), the same 8 prompts per step (the first
rows of the package's quickstart prompts), G = 8 samples per prompt (64 completions per step), up to
``--max-new-tokens`` (128) new tokens at temperature 1 with no nucleus truncation, the same rule-based reward
(share of lowercase letters), the GRPO loss (group-normalised advantages, per-sequence mean, ``beta`` = 0.04 k3 KL
to a frozen reference, one optimizer step per generation, ``num_iterations`` = 1), fp32 on CPU with ``--threads``
threads. TRL runs in its own virtual environment (never a dependency of this project): pass its interpreter with
``--trl-python`` or ``TRL_PYTHON``. Each measurement is its own process; the sides alternate so load from other
processes on a shared machine hits both alike.

    TRL_PYTHON=/path/to/trl-venv/bin/python python benchmarks/grpo_vs_trl.py --sizes 3m 25m --steps 5 --warmup 1 \
        --end-rate 0.02 --repeats 2 --variants default padded

``--end-rate R`` gives the model a steady chance R of its end token at each step (``ending_policy``), so that
responses vary in length as a trained policy's do (R = 0.02: a mean of about 50 tokens, about 10% cut at 128).
Without it the random model ends by chance only (on the 3M model about 30% of responses end, mean length about
107), so most rows run to 128 tokens and neither side can skip much work. The reported ``completion_tokens`` (mean
completion length over all steps, end token included, as each side logs it) shows how long each side's responses
were.

``--vocab-size`` replaces the byte-level 384-token vocabulary of both models by a larger one (32000, 152000; the
sampled ids beyond 384 decode as bytes ``id % 256`` for the reward); ``--num-prompts`` and ``--num-generations``
shrink a step. Our peak memory at 152000 against 384 (``--skip-trl``) is the ratio issue 16 bounds by 1.5x:

    python benchmarks/grpo_vs_trl.py --skip-trl --vocab-size 152000 --num-prompts 4 --num-generations 4 \
        --max-new-tokens 32 --steps 3 --warmup 1

Prints the command, date and versions, one JSON line per measurement (``completions_per_s`` over the
steady-state steps after warm-up, ``peak_rss_mb`` of the whole process, and the mean seconds per step spent in
``generation``, ``scoring``, ``logprob_passes`` (reference / old log-probs, no gradient) and ``update`` (the
rest of the step: policy forward, backward, optimizer)) and one ``ratio`` line per size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Split, add_trl_python, print_header, quiet_trainer, require_trl_python, run_child  # noqa: E402
from dpo_vs_trl import BASE, SIZES, _model_config, _peak_rss_mb  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS_FILE = os.path.join(ROOT, "aitraining_pl", "data", "quickstart_prompts.jsonl")
NUM_PROMPTS, G, LR, BETA = 8, 8, 1e-6, 0.04  # defaults of --num-prompts, --num-generations


def prompts(n: int = NUM_PROMPTS) -> list[str]:
    with open(PROMPTS_FILE, encoding="utf-8") as handle:
        return [json.loads(line)["prompt"] for line in handle][:n]


def byte_decoding_of_any_id() -> None:
    """Let the byte-level tokenizer decode ids beyond its 384 (a ``--vocab-size`` model samples them): id ``i``
    decodes as byte ``i % 256``. Only the texts the reward reads change; the scored token ids are the sampled ones."""
    from transformers import ByT5Tokenizer

    to_token = ByT5Tokenizer._convert_id_to_token
    ByT5Tokenizer._convert_id_to_token = lambda self, i: to_token(self, self.offset + i % 256 if i >= 384 else i)


def lowercase_share(texts: list[str]) -> list[float]:
    """The reward of both sides: the share of a completion's characters that are lowercase ASCII letters."""
    return [sum("a" <= c <= "z" for c in t) / len(t) if t else 0.0 for t in texts]


def ending_policy(model, end_id: int, rate: float) -> None:
    """Give a Llama a steady chance ``rate`` of sampling ``end_id`` at every step (at temperature 1).

    Residual coordinate 0 is made a constant: every token embedding holds the embeddings' std there and no
    attention or MLP output writes to it. The head reads that coordinate for the end token only, scaled so that
    the end logit sits ``log(rate (V - 1) / (1 - rate))`` above the (nearly uniform) others at a random model's
    mean final-norm value of the coordinate. The rest of the model is left as initialised.
    """
    import torch

    with torch.no_grad():
        body, embeddings = model.model, model.model.embed_tokens.weight
        embeddings[:, 0] = embeddings.std()
        for layer in body.layers:
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        probe = torch.randint(0, embeddings.shape[0], (8, 64), generator=torch.Generator().manual_seed(0))
        coordinate = model(probe, output_hidden_states=True).hidden_states[-1][..., 0].mean()
        vocab = model.lm_head.weight.shape[0]
        model.lm_head.weight[:, 0] = 0
        model.lm_head.weight[end_id, 0] = math.log(rate * (vocab - 1) / (1 - rate)) / coordinate


def save_policy(size: str, args, folder: str) -> str:
    """Build the benchmark's model (seed 0), apply ``--end-rate``, save it to ``folder`` for both sides."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(_model_config(size, args.vocab_size))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    if args.end_rate > 0:
        ending_policy(model, BASE["eos_token_id"], args.end_rate)
    path = os.path.join(folder, size)
    model.save_pretrained(path)
    return path


PARTS = ("generation", "scoring", "logprob_passes")  # and the rest of a step, "update"


def summary(split: Split, completions: int, lengths: list[float]) -> dict:
    """``lengths``: each step's mean completion length in tokens, end token included (both sides log it)."""
    return {
        "completions_per_s": round(split.rate(completions), 3),
        "step_split_s": split.step_split(),
        "completion_tokens": round(sum(lengths) / max(1, len(lengths)), 1),
    }


def run_ours(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import lightning.pytorch as pl

    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.modules.critic_free import GRPOModule
    from aitraining_pl.rollout import GenerationConfig

    split, lengths = Split(args.warmup, PARTS, rest="update"), []

    class Timer(pl.Callback):
        def on_train_batch_start(self, *a):
            split.step_start()

        def on_train_batch_end(self, trainer, *a):
            split.step_end()
            lengths.append(float(trainer.callback_metrics["train/completion_length"]))

    pl.seed_everything(0)
    module = GRPOModule(
        model_name=args.model_path,
        tokenizer_name="byte",
        reward=lambda p, r, m: lowercase_share(r),
        num_generations=args.num_generations,
        learning_rate=LR,
        kl_coef=BETA,
        generation=GenerationConfig(
            max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, drop_ended=args.variant == "default"
        ),
        mini_batch_size=args.num_prompts * args.num_generations,
        max_grad_norm=1.0,
        padding_free=args.variant == "default",
    )
    module.generate = split.timed("generation", module.generate)
    module.score = split.timed("scoring", module.score)
    module.frozen_logprobs = split.timed("logprob_passes", module.frozen_logprobs)
    data = PromptDataModule(
        prompts=prompts(args.num_prompts) * args.steps, tokenizer=module.tokenizer, batch_size=args.num_prompts
    )
    trainer = quiet_trainer(max_steps=args.steps, callbacks=[Timer()])
    data.setup("fit")
    data.train_dataloader = lambda: torch.utils.data.DataLoader(  # the prompts in file order, as TRL's side
        data.train_dataset, args.num_prompts, shuffle=False, collate_fn=data.collate_fn
    )
    trainer.fit(module, data)
    return {
        "params": sum(p.numel() for p in module.policy.parameters()),
        **summary(split, args.num_prompts * args.num_generations, lengths),
    }


def run_trl(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import ByT5Tokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    split, lengths = Split(args.warmup, PARTS, rest="update"), []

    class Timer(TrainerCallback):
        trainer = None

        def on_step_begin(self, *a, **k):
            split.step_start()

        def on_step_end(self, *a, **k):
            split.step_end()  # the trainer's metrics are averaged and cleared when it logs, so read them here
            lengths.append(self.trainer._metrics["train"]["completions/mean_length"][-1])

    def reward(prompts, completions, **kwargs):
        return lowercase_share(completions)

    dataset = Dataset.from_dict({"prompt": prompts(args.num_prompts) * args.steps})
    # TRL tokenizes plain-text prompts with the tokenizer's special tokens, and ByT5 appends its end token: the
    # prompts would end in it. Ours are the prompt's bytes alone; give both sides the same prompt tokens.
    tokenizer = ByT5Tokenizer()
    tokenizer.build_inputs_with_special_tokens = lambda ids, pair=None: ids + (pair or [])
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.num_prompts * args.num_generations,
            num_generations=args.num_generations,
            steps_per_generation=1,
            max_completion_length=args.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            beta=BETA,
            num_iterations=1,
            loss_type="grpo",
            scale_rewards="group",
            learning_rate=LR,
            max_grad_norm=1.0,
            max_steps=args.steps,
            logging_steps=10_000,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            dataloader_num_workers=0,
            shuffle_dataset=False,
            seed=0,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=args.model_path,  # TRL builds its reference from the policy's path
            reward_funcs=reward,
            args=cfg,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer := Timer()],
        )
        timer.trainer = trainer
        trainer._generate = split.timed("generation", trainer._generate)
        trainer._calculate_rewards = split.timed("scoring", trainer._calculate_rewards)
        trainer._get_per_token_logps_and_entropies = split.timed(
            "logprob_passes",
            trainer._get_per_token_logps_and_entropies,
            when=lambda *a, **k: not torch.is_grad_enabled(),
        )
        trainer.train()
        params = sum(p.numel() for p in trainer.model.parameters())
    return {"params": params, **summary(split, args.num_prompts * args.num_generations, lengths)}


def child(args) -> None:
    if args.vocab_size > BASE["vocab_size"]:
        byte_decoding_of_any_id()
    result = run_ours(args) if args.side == "ours" else run_trl(args)
    result.update(
        side=args.side,
        variant=args.variant,
        size=args.size,
        vocab_size=args.vocab_size,
        num_prompts=args.num_prompts,
        num_generations=args.num_generations,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        max_new_tokens=args.max_new_tokens,
        end_rate=args.end_rate,
        peak_rss_mb=round(_peak_rss_mb(), 1),
    )
    print("RESULT " + json.dumps(result), flush=True)


def _spawn(python: str, side: str, variant: str, size: str, model_path: str, args) -> dict:
    cmd = [
        python,
        os.path.abspath(__file__),
        "--model-path",
        model_path,
        "--end-rate",
        str(args.end_rate),
        "--side",
        side,
        "--variant",
        variant,
        "--size",
        size,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--vocab-size",
        str(args.vocab_size),
        "--num-prompts",
        str(args.num_prompts),
        "--num-generations",
        str(args.num_generations),
    ]
    return run_child(cmd, args.threads, f"{side}/{variant}/{size}", PYTHONPATH=ROOT if side == "ours" else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trl_python(parser)
    parser.add_argument("--sizes", nargs="+", default=["3m"], choices=list(SIZES))
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["default"],
        choices=["default", "padded"],
        help="this project's side: ended rows dropped while decoding and packed log-prob passes (default), or "
        "transformers' generate and padded rows (padded)",
    )
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (= generations) per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps excluded from the steady state")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=BASE["vocab_size"],
        help="vocabulary of both models (384: the byte tokenizer's; 32000, 152000: real models')",
    )
    parser.add_argument("--num-prompts", type=int, default=NUM_PROMPTS, help="prompts per step")
    parser.add_argument("--num-generations", type=int, default=G, help="samples per prompt (G)")
    parser.add_argument(
        "--end-rate",
        type=float,
        default=0.0,
        help="chance of the end token at each step given to the model (ending_policy); 0: as initialised",
    )
    parser.add_argument("--repeats", type=int, default=1, help="alternating rounds per size")
    parser.add_argument("--side", choices=["ours", "trl"])
    parser.add_argument("--model-path", help="(child processes) the saved model")
    parser.add_argument("--variant", default="default")
    parser.add_argument("--size", default="3m")
    args = parser.parse_args()
    if args.side:
        return child(args)
    require_trl_python(parser, args)
    print_header(
        args.threads,
        trl_python=None if args.skip_trl else args.trl_python,
        vocab_size=args.vocab_size,
        end_rate=args.end_rate,
    )
    models = tempfile.TemporaryDirectory()
    for size in args.sizes:
        model_path = save_policy(size, args, models.name)
        results: dict[str, list[dict]] = {}
        runs = [("trl", "default")] * (not args.skip_trl) + [("ours", v) for v in args.variants]
        for _ in range(args.repeats):
            for side, variant in runs:
                r = _spawn(args.trl_python if side == "trl" else sys.executable, side, variant, size, model_path, args)
                results.setdefault(f"{side}/{variant}", []).append(r)
                print(json.dumps(r), flush=True)
        if args.skip_trl:
            continue
        best = {k: max(v, key=lambda r: r["completions_per_s"]) for k, v in results.items()}
        trl = best["trl/default"]
        for variant in args.variants:
            ours = best[f"ours/{variant}"]
            print(
                json.dumps(
                    {
                        "ratio": True,
                        "size": size,
                        "vocab_size": args.vocab_size,
                        "variant": variant,
                        "speedup": round(ours["completions_per_s"] / trl["completions_per_s"], 3),
                        "memory_ratio": round(ours["peak_rss_mb"] / trl["peak_rss_mb"], 3),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
