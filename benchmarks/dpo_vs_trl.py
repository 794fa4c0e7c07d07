"""DPO training throughput and peak memory: ``DPOModule`` under ``Trainer.fit`` vs TRL's ``DPOTrainer``.

Same two randomly initialised Llama models (about 3M and 25M parameters, byte-level tokenizer), the same 512
synthetic pairs (prompt and completions of 20 to 400 characters), batch 8, max_length 512, fp32 on CPU.
Each measurement runs in its own process (TRL in its own virtual environment, never a dependency of this
project); sides alternate so load from other processes on a shared machine hits both alike.

    python benchmarks/dpo_vs_trl.py --trl-python PATH/TO/trl-venv/bin/python   # or TRL_PYTHON=... in the environment
    python benchmarks/dpo_vs_trl.py --vocab-size 32000 --sizes 3m --variants default --trl-variants fp32 --steps 6

``--vocab-size`` replaces the byte-level 384-token vocabulary of both models by a larger one (32000 as Llama 2,
152000 as Qwen) while the data stays bytes: the head and embeddings, not the blocks, then decide memory and much
of the time. The first line printed is a header: the command, the date, the thread count and the versions of
both sides.

Prints one JSON line per measurement (``pairs_per_s`` over steady-state steps after warm-up, ``pairs_per_cpu_s``
the same per second of the process's CPU time, ``peak_rss_mb`` of the whole process, ``step_split_s``) and one
``ratio`` line per model size and variant: the best rounds' ratio (``speedup``) and each alternated round's, by wall
and by CPU time. On a shared machine, ``--threads 1`` and the CPU-time ratio are the least moved by other
processes (a thread that is descheduled stalls a 2-thread step; CPU time counts only what the step ran).
``step_split_s`` is
the mean seconds of a steady-state step (from the step's start callback to its end callback, data loading
outside) spent in ``blocks`` (the decoder of the policy and of the reference: forward calls, and the policy's
backward from the gradient of its last hidden state to the gradient of its input embeddings' output),
``head`` (the chunked LM-head log-softmax autograd function of each side, ``losses.fused_head`` here and
``trl.kernels.ChunkedLogProbFunction`` in TRL 1.16: forward calls and the backward of its autograd node),
``optimizer`` (``Optimizer.step`` less the forward-backward closure Lightning runs inside it) and ``rest``
(the loss, packing, indexing, the embedding's backward, gradient clipping, zeroing, scheduler, callbacks).
Both sides are timed with the same hooks (``benchmarks/_common.py``). Every variant trains on the same batches
as TRL (file order; TRL with ``train_sampling_strategy="sequential"``). Variants of this project's
side: ``padded`` (the same work as TRL: 2B padded rows, a reference forward every step), ``default`` (the
module's defaults: the real tokens packed in one row with each pair's prompt held once, a reference forward
every step) and ``precomputed`` (the defaults plus reference log-probs computed in one pass before training;
the pass is reported as ``precompute_s`` and is not part of the steady state). TRL's variants: ``fp32``
(``gradient_checkpointing=False`` and fp32, where its defaults are checkpointing on and bf16, so that both
sides do the same arithmetic), ``precomputed`` (the same with ``precompute_ref_log_probs=True``, the like for
like of ours) and ``defaults``. Each of our variants gets a ratio against each TRL variant that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

from _common import (
    Split,
    add_trl_python,
    peak_rss_mb,
    print_header,
    quiet_trainer,
    require_trl_python,
    run_child,
    time_autograd_function,
    time_module,
    time_optimizer,
)

SIZES = {
    "3m": {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    },
    "25m": {
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
    },
}
BASE = {
    "model_type": "llama",
    "vocab_size": 384,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": None,
    "tie_word_embeddings": False,
}
BATCH, MAX_LENGTH, PAIRS, LR = 8, 512, 512, 1e-6
#: this project's variants: DPOModule arguments
VARIANTS = {
    "padded": {"padding_free": False, "share_prompt": False},
    "default": {},
    "precomputed": {"precompute_ref_log_probs": True},
}
#: TRL's variants: DPOConfig arguments
TRL_VARIANTS = {
    "fp32": {"bf16": False, "gradient_checkpointing": False},
    "precomputed": {"bf16": False, "gradient_checkpointing": False, "precompute_ref_log_probs": True},
    "defaults": {},
}
#: the timed parts of a step (``step_split_s``; the remainder is ``rest``)
PARTS = ("blocks", "head", "optimizer")
WORDS = (
    "the of and to in is was that for on as with by at from this be or an are not it have which one "
    "model data train loss reward policy value prompt answer token sample gradient step batch"
).split()


def _text(rng: random.Random, lo: int = 20, hi: int = 400) -> str:
    n = rng.randint(lo, hi)
    out = ""
    while len(out) < n:
        out += rng.choice(WORDS) + " "
    return out[:n].strip() or "x"


def make_pairs(path: str, n: int = PAIRS, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(n):
            handle.write(json.dumps({"prompt": _text(rng), "chosen": _text(rng), "rejected": _text(rng)}) + "\n")


def _model_config(size: str, vocab_size: int = BASE["vocab_size"]) -> dict:
    return {**BASE, **SIZES[size], "vocab_size": vocab_size}


def _peak_rss_mb() -> float:
    return peak_rss_mb()  # not ru_maxrss: a child inherits its parent's over exec (_common.peak_rss_mb)


class _Clock:
    """Step timestamps, wall and process CPU time; steady state = from the end of warm-up step ``warmup`` to the end
    of the last step."""

    def __init__(self, warmup: int):
        self.warmup, self.ends, self.cpu_ends = warmup, [], []

    def step_end(self) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())

    def pairs_per_s(self, cpu: bool = False) -> float:
        """Pairs per second of wall time, or (``cpu``) per second of the process's CPU time (all its threads)."""
        timed = (self.cpu_ends if cpu else self.ends)[self.warmup - 1 :]
        return BATCH * (len(timed) - 1) / (timed[-1] - timed[0])


def _instrument(split: Split, decoders, head_function) -> None:
    """The same hooks on both sides: decoders -> blocks, the head's autograd function -> head, steps -> optimizer."""
    for decoder in decoders:
        time_module(split, "blocks", decoder, until=decoder.get_input_embeddings())
    time_autograd_function(split, "head", head_function)
    time_optimizer(split)


def run_ours(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import lightning.pytorch as pl

    from aitraining_pl.datamodules.preference import PreferenceDataModule
    from aitraining_pl.losses.fused_head import _FusedHeadLogps
    from aitraining_pl.modules.dpo import DPOModule

    clock, split = _Clock(args.warmup), Split(args.warmup, PARTS)

    class Timer(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.start = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            split.step_start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.step_end()
            split.step_end()

    module = DPOModule(
        model_config=_model_config(args.size, args.vocab_size),
        tokenizer_name="byte",
        learning_rate=LR,
        warmup_ratio=0.0,
        **VARIANTS[args.variant],
    )
    models = [module.policy] + ([module.reference.model] if module.reference is not None else [])
    _instrument(split, [m.get_decoder() for m in models], _FusedHeadLogps)
    data = PreferenceDataModule(
        data_path=args.data,
        val_split=0.0,
        tokenizer=module.tokenizer,
        batch_size=BATCH,
        max_length=MAX_LENGTH,
        max_prompt_length=MAX_LENGTH - 1,
        shuffle=False,
        seed=0,
    )
    timer = Timer()
    trainer = quiet_trainer(max_steps=args.steps, callbacks=[timer])
    t0 = time.perf_counter()
    trainer.fit(module, data)
    n_params = sum(p.numel() for p in module.policy.parameters())
    return {
        "precompute_s": round(timer.start - t0, 2),
        "fit_s": round(time.perf_counter() - t0, 2),
        "params": n_params,
        "pairs_per_s": clock.pairs_per_s(),
        "pairs_per_cpu_s": clock.pairs_per_s(cpu=True),
        "step_split_s": split.step_split(),
    }


def run_trl(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from datasets import load_dataset
    from transformers import AutoConfig, AutoModelForCausalLM, ByT5Tokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer
    from trl.kernels import ChunkedLogProbFunction  # what TRL 1.16's fused LM head (add_fused_lm_head) applies

    clock, split = _Clock(args.warmup), Split(args.warmup, PARTS)

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            split.step_start()

        def on_step_end(self, *a, **k):
            clock.step_end()
            split.step_end()

    config = dict(_model_config(args.size, args.vocab_size))
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config)
    torch.manual_seed(0)  # the reference: the same weights, built again from the config (as on our side)
    ref_model = AutoModelForCausalLM.from_config(hf_config)
    _instrument(split, [model.get_decoder(), ref_model.get_decoder()], ChunkedLogProbFunction)
    tokenizer = ByT5Tokenizer()
    dataset = load_dataset("json", data_files=args.data, split="train")
    with tempfile.TemporaryDirectory() as out:
        cfg = DPOConfig(
            output_dir=out,
            per_device_train_batch_size=BATCH,
            max_length=MAX_LENGTH,
            max_steps=args.steps,
            learning_rate=LR,
            beta=0.1,
            logging_steps=10_000,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            **TRL_VARIANTS[args.variant],
            train_sampling_strategy="sequential",
            seed=0,
            disable_tqdm=True,
        )
        trainer = DPOTrainer(
            model=model,
            ref_model=ref_model,
            args=cfg,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Timer()],
        )
        t0 = time.perf_counter()
        trainer.train()
        fit_s = time.perf_counter() - t0
    return {
        "fit_s": round(fit_s, 2),
        "params": sum(p.numel() for p in model.parameters()),
        "pairs_per_s": clock.pairs_per_s(),
        "pairs_per_cpu_s": clock.pairs_per_s(cpu=True),
        "step_split_s": split.step_split(),
    }


def child(args) -> None:
    result = run_ours(args) if args.side == "ours" else run_trl(args)
    result.update(
        side=args.side,
        variant=args.variant,
        size=args.size,
        vocab_size=args.vocab_size,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        peak_rss_mb=round(_peak_rss_mb(), 1),
        pairs_per_s=round(result["pairs_per_s"], 3),
        pairs_per_cpu_s=round(result["pairs_per_cpu_s"], 3),
    )
    print("RESULT " + json.dumps(result), flush=True)


def _spawn(python: str, side: str, variant: str, size: str, data: str, args) -> dict:
    cmd = [
        python,
        os.path.abspath(__file__),
        "--side",
        side,
        "--variant",
        variant,
        "--size",
        size,
        "--data",
        data,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--vocab-size",
        str(args.vocab_size),
    ]
    return run_child(cmd, args.threads, f"{side}/{variant}/{size}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trl_python(parser)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=BASE["vocab_size"],
        help="vocabulary of both models (384: the byte tokenizer's; 32000, 152000: real models')",
    )
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--trl-variants", nargs="+", default=["fp32", "precomputed"], choices=list(TRL_VARIANTS))
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="steps excluded from the steady state")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="alternating rounds per size")
    # child-process arguments
    parser.add_argument("--side", choices=["ours", "trl"])
    parser.add_argument("--variant", default="default")
    parser.add_argument("--size", default="3m")
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.side:
        return child(args)
    require_trl_python(parser, args)
    print_header(args.threads, trl_python=None if args.skip_trl else args.trl_python, vocab_size=args.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "pairs.jsonl")
        make_pairs(data)
        for size in args.sizes:
            results: dict[str, list[dict]] = {}
            runs = [("trl", v) for v in ([] if args.skip_trl else args.trl_variants)] + [
                ("ours", v) for v in args.variants
            ]
            for _ in range(args.repeats):
                for side, variant in runs:
                    python = args.trl_python if side == "trl" else sys.executable
                    r = _spawn(python, side, variant, size, data, args)
                    results.setdefault(f"{side}/{variant}", []).append(r)
                    print(json.dumps(r), flush=True)
            if not args.skip_trl:
                for variant in args.variants:
                    for trl_variant in args.trl_variants:
                        print(json.dumps(_ratio(results[f"ours/{variant}"], results[f"trl/{trl_variant}"])), flush=True)


def _ratio(ours: list[dict], trl: list[dict]) -> dict:
    """One ``ratio`` line: ours over TRL per alternated round (wall time and process CPU time, the latter less moved
    by other processes on a shared machine), their spread, and the best round of each side."""

    def per_round(key: str) -> list[float]:
        return [round(a[key] / b[key], 3) for a, b in zip(ours, trl)]

    best_ours, best_trl = (max(runs, key=lambda r: r["pairs_per_s"]) for runs in (ours, trl))
    wall, cpu = per_round("pairs_per_s"), per_round("pairs_per_cpu_s")
    return {
        "ratio": True,
        **{k: ours[0][k] for k in ("size", "vocab_size", "variant", "threads")},
        "trl_variant": trl[0]["variant"],
        "speedup": round(best_ours["pairs_per_s"] / best_trl["pairs_per_s"], 3),
        "speedup_per_round": wall,
        "speedup_cpu_per_round": cpu,
        "speedup_cpu_range": [min(cpu), max(cpu)],
        "memory_ratio": round(best_ours["peak_rss_mb"] / best_trl["peak_rss_mb"], 3),
        "ours_pairs_per_s": best_ours["pairs_per_s"],
        "trl_pairs_per_s": best_trl["pairs_per_s"],
        "ours_peak_rss_mb": [r["peak_rss_mb"] for r in ours],
        "trl_peak_rss_mb": [r["peak_rss_mb"] for r in trl],
    }


if __name__ == "__main__":
    main()
