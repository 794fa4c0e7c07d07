"""Vision-language GRPO and DPO against TRL 1.16: completions/s, pairs/s and peak memory on a tiny random Qwen2-VL.

Both sides train the same randomly initialised Qwen2-VL (the colour task's preset ``tiny-qwen2-vl-colours`` of
``models/vision_presets.py``, or with ``--sizes small`` the same with a larger text model; built once with seed 0,
saved to a temporary folder with its tokenizer, its image processor and a chat template, and loaded from that
folder by both sides) on the same generated images (``datamodules/colours.py``: a red, green or blue square on
black, 56 x 56 pixels, 4 image tokens after the 2 x 2 merge; written once as PNG files that both sides read):

- **GRPO**: ``GRPOModule`` under ``Trainer.fit`` against ``GRPOTrainer``. ``--num-prompts`` (4) prompts
  ``colour?`` per step, each with its image, ``--num-generations`` G (8) samples each, up to ``--max-new-tokens``
  (16) new tokens at temperature 1 with no nucleus truncation, the colour task's reward (1 for the colour's first
  letter), the GRPO loss (group-normalised advantages, ``beta`` = 0.04 k3 KL to a frozen reference, one optimizer
  step per generation), learning rate 1e-6, max grad norm 1. ``completions_per_s`` over the steady-state steps.
- **DPO**: ``DPOModule`` against ``DPOTrainer`` on image preference pairs in RLAIF-V's layout (an ``image``
  column, ``question`` = ``colour?``, ``chosen`` = the square's colour, ``rejected`` another one; a Parquet file
  both sides read; TRL gets the same rows as conversational ``prompt`` / ``chosen`` / ``rejected``), batch
  ``--batch-size`` (8) pairs, ``beta`` 0.1, learning rate 1e-6, max length 64, a reference forward every step (no
  precomputed reference log-probs on either side), file order. ``pairs_per_s`` over the steady-state steps.

On both sides the vision tower is frozen (this project's default; on TRL's side its parameters are set to
``requires_grad=False`` before the trainer is built) and the language model trains in full, fp32 on CPU with
``--threads`` threads (1 by default: the least moved by other processes on a shared machine). Both sides see the
same prompt tokens: the chat template renders an image part as Qwen's ``<|vision_start|><|image_pad|><|vision_end|>``
and a text part as its text, with nothing around them, which is what this project makes of the plain prompt
``colour?`` with one image; an assistant turn ends with the end token, as this project's DPO completions do.

TRL runs in its own virtual environment (never a dependency of this project): pass its interpreter with
``--trl-python`` or ``TRL_PYTHON``. TRL 1.16's Qwen2-VL path needs no torchvision: TRL's side builds the
``Qwen2VLProcessor`` from the saved tokenizer and the PIL image processor with no video processor, as
``vision_presets`` does. Each measurement is its own process; the sides alternate (TRL first in even rounds, this
project first in odd ones) so that load from other processes hits both alike; each side's figures are the medians
over ``--repeats`` rounds and the ratios are ours over TRL's, per round and of the medians.

    TRL_PYTHON=/path/to/trl-venv/bin/python python benchmarks/vlm_vs_trl.py --repeats 3
    python benchmarks/vlm_vs_trl.py --dry-run     # this project's side only, 2 steps, in this process (CI)

A rate counts the steady-state steps from the end of step ``--warmup`` to the end of the last step, so that it
includes what happens between steps too: the loading and collation of a batch (TRL runs its processor on the images
there; this project runs it once before training, in ``prepare_data``, which is outside the rate) and every callback.

Memory is the **peak RSS** of each side's process (Linux's ``VmHWM``, ``_common.peak_rss_mb``: the whole process,
the Python imports included; not ``ru_maxrss``, which a child inherits from the process that started it), with
``import_rss_mb`` the peak after the imports and before any model or data is built, so that ``peak_rss_mb -
import_rss_mb`` is what the run itself added. Prints the command, date and versions, one JSON line
per measurement (with ``*_per_cpu_s``: the same rate per second of the process's CPU time, the least moved by other
processes), one ``ratio`` line per task, and a table.
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
from _common import add_trl_python, peak_rss_mb, print_header, quiet_trainer, require_trl_python, run_child  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = "tiny-qwen2-vl-colours"
#: text-model overrides of the preset by size (``tiny``: the preset as it is: 2 layers, hidden size 32)
SIZES = {
    "tiny": {},
    "small": {
        "text_config": {
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12]},
        },
        "vision_config": {"hidden_size": 256},  # Qwen2-VL's merger writes the language model's width
    },
}
#: the chat template of both sides (see the module docstring): image parts as Qwen's placeholder, text parts as text
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)
COLOURS = ("red", "green", "blue")
LR, GRPO_BETA, DPO_BETA, MAX_LENGTH = 1e-6, 0.04, 0.1, 64
TASKS = {"grpo": "completions_per_s", "dpo": "pairs_per_s"}


# ---------------------------------------------------------------------------------------------- shared inputs
def save_model(size: str, folder: str) -> str:
    """The preset's model (seed 0) with the ``size`` overrides, its tokenizer (with ``CHAT_TEMPLATE``) and image
    processor, saved to ``folder/size``; both sides load the weights from there."""
    from aitraining_pl.models.vision import load_processor, load_vision_lm

    path = os.path.join(folder, size)
    model = load_vision_lm(model_config={"preset": PRESET, **SIZES[size]}, seed=0)
    model.save_pretrained(path)
    processor = load_processor(PRESET)
    processor.tokenizer.chat_template = CHAT_TEMPLATE
    processor.tokenizer.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    return path


def save_data(folder: str, num_rows: int) -> dict[str, str]:
    """The colour squares (``colour_rows``, seed 0) as PNG files, the prompt rows (``prompts.jsonl``: image path,
    colour) and the preference pairs in RLAIF-V's layout (``pairs.parquet``)."""
    import io
    import random

    import datasets

    from aitraining_pl.datamodules.colours import colour_rows

    rng, rows, pairs = random.Random(0), [], []
    for i, row in enumerate(colour_rows(num_rows, seed=0)):
        path = os.path.join(folder, f"square_{i:04d}.png")
        row["images"][0].save(path)
        rows.append({"image": path, "colour": row["colour"]})
        buffer = io.BytesIO()
        row["images"][0].save(buffer, format="PNG")
        wrong = rng.choice([c for c in COLOURS if c != row["colour"]])
        pairs.append({"image": {"bytes": buffer.getvalue(), "path": None}, "question": "colour?",
                      "chosen": row["colour"], "rejected": wrong})  # fmt: skip
    prompts, parquet = os.path.join(folder, "prompts.jsonl"), os.path.join(folder, "pairs.parquet")
    with open(prompts, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
    datasets.Dataset.from_list(pairs).to_parquet(parquet)
    return {"prompts": prompts, "pairs": parquet}


def read_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def colour_reward_of(texts: list[str], colours: list[str]) -> list[float]:
    """The colour task's reward (``datamodules.colours.colour_reward``): 1 for the colour's first letter."""
    return [float(t.strip()[:1] == c[0]) for t, c in zip(texts, colours)]


class Steps:
    """Wall and process CPU time at the end of each step; a rate is over the steady-state steps, from the end of
    step ``warmup`` to the end of the last one, so that it counts everything between two steps as well (the
    batch's loading and collation, where TRL runs its processor, and every callback)."""

    def __init__(self, warmup: int):
        self.warmup, self.wall, self.cpu = max(1, warmup), [], []

    def end(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def rate(self, units: int, cpu: bool = False) -> float:
        ends = (self.cpu if cpu else self.wall)[self.warmup - 1 :]
        return round(units * (len(ends) - 1) / (ends[-1] - ends[0]), 3)


def _peak_rss_mb() -> float:
    return round(peak_rss_mb(), 1)


def _params(model) -> dict:
    return {"params": sum(p.numel() for p in model.parameters()),
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}  # fmt: skip


# ---------------------------------------------------------------------------------------------- this project


def grpo_result(args, import_rss: float, model, steps, lengths: list) -> dict:
    """One GRPO side's figures: completions per second of wall and of CPU time, the mean completion length."""
    completions = args.num_prompts * args.num_generations
    return {
        "import_rss_mb": import_rss,
        **_params(model),
        "completions_per_s": steps.rate(completions),
        "completions_per_cpu_s": steps.rate(completions, cpu=True),
        "completion_tokens": round(sum(lengths) / max(1, len(lengths)), 2),
    }


def ours_grpo(args) -> dict:
    import lightning.pytorch as pl
    import torch

    from aitraining_pl.datamodules.prompt import PromptDataModule
    from aitraining_pl.modules.critic_free import GRPOModule
    from aitraining_pl.rollout import GenerationConfig

    import_rss, steps, lengths = _peak_rss_mb(), Steps(args.warmup), []

    class Timer(pl.Callback):
        def on_train_batch_end(self, trainer, *a):
            steps.end()
            lengths.append(float(trainer.callback_metrics["train/completion_length"]))

    pl.seed_everything(0)
    module = GRPOModule(
        model_name=args.model_path, tokenizer_name=PRESET,  # the saved processor: vision_presets builds the same
        reward=lambda p, r, m: colour_reward_of(r, [x["colour"] for x in m]), num_generations=args.num_generations,
        learning_rate=LR, kl_coef=GRPO_BETA, max_grad_norm=1.0, mini_batch_size=args.num_prompts * args.num_generations,
        generation=GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0),
    )  # fmt: skip
    rows = read_rows(args.data)[: args.num_prompts * args.steps]
    data = PromptDataModule(
        prompts=["colour?"] * len(rows), metadata=[{"images": [r["image"]], "colour": r["colour"]} for r in rows],
        metadata_columns=["colour"], tokenizer=module.tokenizer, batch_size=args.num_prompts,
        max_prompt_length=MAX_LENGTH,
    )  # fmt: skip
    data.setup("fit")
    data.train_dataloader = lambda: torch.utils.data.DataLoader(  # file order, as TRL's side
        data.train_dataset, args.num_prompts, shuffle=False, collate_fn=data.collate_fn
    )
    quiet_trainer(max_steps=args.steps, callbacks=[Timer()]).fit(module, data)
    return grpo_result(args, import_rss, module.policy, steps, lengths)


def ours_dpo(args) -> dict:
    import lightning.pytorch as pl

    from aitraining_pl.datamodules.preference import PreferenceDataModule
    from aitraining_pl.modules.dpo import DPOModule

    import_rss, steps = _peak_rss_mb(), Steps(args.warmup)

    class Timer(pl.Callback):
        def on_train_batch_end(self, *a):
            steps.end()

    pl.seed_everything(0)
    module = DPOModule(
        model_name=args.model_path, tokenizer_name=PRESET, beta=DPO_BETA, learning_rate=LR, warmup_ratio=0.0
    )
    data = PreferenceDataModule(
        data_path=args.data, val_split=0.0, prompt_column="question", tokenizer=module.tokenizer,
        batch_size=args.batch_size, max_length=MAX_LENGTH, max_prompt_length=MAX_LENGTH - 16, shuffle=False, seed=0,
    )  # fmt: skip
    quiet_trainer(max_steps=args.steps, callbacks=[Timer()]).fit(module, data)
    return {
        "import_rss_mb": import_rss,
        **_params(module.policy),
        "pairs_per_s": steps.rate(args.batch_size),
        "pairs_per_cpu_s": steps.rate(args.batch_size, cpu=True),
    }


# ---------------------------------------------------------------------------------------------- TRL
def trl_processor(path: str):
    """The saved tokenizer and PIL image processor as a ``Qwen2VLProcessor`` without a video processor (whose
    class needs torchvision), as ``vision_presets`` builds it."""
    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: (
        None if arg is None else check(self, name, arg)
    )
    try:
        return Qwen2VLProcessor(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
            tokenizer=AutoTokenizer.from_pretrained(path),
            video_processor=None,
            chat_template=CHAT_TEMPLATE,
        )
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def trl_model(path: str):
    """The saved model with its vision tower frozen (as this project's default)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype="float32")
    for param in model.model.visual.parameters():
        param.requires_grad_(False)
    return model


def trl_common(out: str, args) -> dict:
    return dict(
        output_dir=out, learning_rate=LR, max_grad_norm=1.0, max_steps=args.steps, logging_steps=10_000,
        save_strategy="no", report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
        dataloader_num_workers=0, seed=0, disable_tqdm=True, lr_scheduler_type="linear", warmup_steps=0,
    )  # fmt: skip


def trl_grpo(args) -> dict:
    from datasets import Dataset, Image
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import_rss, steps, lengths = _peak_rss_mb(), Steps(args.warmup), []

    class Timer(TrainerCallback):
        trainer = None

        def on_step_end(self, *a, **k):
            steps.end()  # the trainer's metrics are averaged and cleared when it logs, so read them here
            lengths.append(self.trainer._metrics["train"]["completions/mean_length"][-1])

    def reward(prompts, completions, colour, **kwargs):
        return colour_reward_of([c[-1]["content"] if isinstance(c, list) else c for c in completions], colour)

    rows = read_rows(args.data)[: args.num_prompts * args.steps]
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": "colour?"}]] * len(rows),  # TRL puts the image part in front
            "image": [r["image"] for r in rows],
            "colour": [r["colour"] for r in rows],
        }
    ).cast_column("image", Image())
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            **trl_common(out, args), per_device_train_batch_size=args.num_prompts * args.num_generations,
            num_generations=args.num_generations, steps_per_generation=1, max_completion_length=args.max_new_tokens,
            temperature=1.0, top_p=1.0, beta=GRPO_BETA, num_iterations=1, loss_type="grpo", scale_rewards="group",
            shuffle_dataset=False,
        )  # fmt: skip
        model = trl_model(args.model_path)
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=config, train_dataset=dataset,
            processing_class=trl_processor(args.model_path), callbacks=[timer := Timer()],
        )  # fmt: skip
        timer.trainer = trainer
        trainer.train()
    return grpo_result(args, import_rss, model, steps, lengths)


def trl_dpo(args) -> dict:
    from datasets import Image, load_dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    import_rss, steps = _peak_rss_mb(), Steps(args.warmup)

    class Timer(TrainerCallback):
        def on_step_end(self, *a, **k):
            steps.end()

    def conversational(row: dict) -> dict:
        return {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["question"]}]}],
            "chosen": [{"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "assistant", "content": row["rejected"]}],
        }

    dataset = load_dataset("parquet", data_files=args.data, split="train")
    # RLAIF-V's ``{"bytes", "path"}`` dicts as an ``Image`` column (TRL's collator wants PIL images)
    dataset = dataset.cast_column("image", Image()).map(conversational, remove_columns=["question"])
    with tempfile.TemporaryDirectory() as out:
        config = DPOConfig(
            **trl_common(out, args),
            per_device_train_batch_size=args.batch_size,
            max_length=MAX_LENGTH,
            beta=DPO_BETA,
            train_sampling_strategy="sequential",
        )
        model = trl_model(args.model_path)
        trainer = DPOTrainer(
            model=model,
            ref_model=trl_model(args.model_path),
            args=config,
            train_dataset=dataset,
            processing_class=trl_processor(args.model_path),
            callbacks=[Timer()],
        )
        trainer.train()
    return {
        "import_rss_mb": import_rss,
        **_params(model),
        "pairs_per_s": steps.rate(args.batch_size),
        "pairs_per_cpu_s": steps.rate(args.batch_size, cpu=True),
    }


RUNS = {("ours", "grpo"): ours_grpo, ("ours", "dpo"): ours_dpo, ("trl", "grpo"): trl_grpo, ("trl", "dpo"): trl_dpo}


# ---------------------------------------------------------------------------------------------- orchestration
def measure(args) -> dict:
    """One measurement (``args.side``, ``args.task``) in this process, as the JSON of its line."""
    import torch

    torch.set_num_threads(args.threads)
    result = RUNS[args.side, args.task](args)
    settings = ("size", "steps", "warmup", "threads")
    settings += ("num_prompts", "num_generations", "max_new_tokens") if args.task == "grpo" else ("batch_size",)
    return {
        "side": args.side,
        "task": args.task,
        **{k: getattr(args, k) for k in settings},
        **result,
        "peak_rss_mb": _peak_rss_mb(),
    }


def in_process(args) -> dict:
    """``measure`` in this process (``--dry-run``), its thread count restored after."""
    import torch

    threads = torch.get_num_threads()
    try:
        return measure(args)
    finally:
        torch.set_num_threads(threads)


def _spawn(python: str, side: str, task: str, model_path: str, data: str, args) -> dict:
    options = {"side": side, "task": task, "size": args.size, "model_path": model_path, "data": data}
    options.update({k: getattr(args, k) for k in ("steps", "warmup", "threads", "num_prompts", "num_generations")})
    options.update(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    command = [python, os.path.abspath(__file__)]
    for key, value in options.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    return run_child(command, args.threads, f"{side}/{task}", PYTHONPATH=ROOT if side == "ours" else "")


def ratio(task: str, ours: list[dict], trl: list[dict]) -> dict:
    """Ours over TRL: per alternated round and of the medians, by wall and by CPU time, and of the peak RSS."""
    key = TASKS[task]
    cpu_key = key.replace("_per_s", "_per_cpu_s")

    def median(runs: list[dict], k: str) -> float:
        return statistics.median(r[k] for r in runs)

    return {
        "ratio": True,
        "task": task,
        "size": ours[0]["size"],
        "threads": ours[0]["threads"],
        f"ours_{key}": median(ours, key),
        f"trl_{key}": median(trl, key),
        "speedup": round(median(ours, key) / median(trl, key), 3),
        "speedup_per_round": [round(a[key] / b[key], 3) for a, b in zip(ours, trl)],
        "speedup_cpu": round(median(ours, cpu_key) / median(trl, cpu_key), 3),
        "speedup_cpu_per_round": [round(a[cpu_key] / b[cpu_key], 3) for a, b in zip(ours, trl)],
        "ours_peak_rss_mb": median(ours, "peak_rss_mb"),
        "trl_peak_rss_mb": median(trl, "peak_rss_mb"),
        "memory_ratio": round(median(ours, "peak_rss_mb") / median(trl, "peak_rss_mb"), 3),
        "ours_run_rss_mb": median(ours, "run_rss_mb"),
        "trl_run_rss_mb": median(trl, "run_rss_mb"),
    }


def table(ratios: list[dict]) -> str:
    """The ratio lines as a Markdown table (rates and peaks: each side's median over the rounds)."""
    lines = [
        "| task | size | ours /s | TRL /s | speedup, wall | speedup, CPU time (rounds) | peak RSS MB, ours / TRL "
        "| memory ratio | MB the run added, ours / TRL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ratios:
        key = TASKS[r["task"]]
        rounds = " / ".join(f"{x:.2f}" for x in r["speedup_cpu_per_round"])
        lines.append(
            f"| {r['task']} ({key}) | {r['size']} | {r[f'ours_{key}']:.1f} | {r[f'trl_{key}']:.1f} "
            f"| {r['speedup']:.2f}x | {r['speedup_cpu']:.2f}x ({rounds}) "
            f"| {r['ours_peak_rss_mb']:.0f} / {r['trl_peak_rss_mb']:.0f} | {r['memory_ratio']:.2f} "
            f"| {r['ours_run_rss_mb']:.0f} / {r['trl_run_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trl_python(parser)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--sizes", nargs="+", default=["tiny"], choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps excluded from the steady state")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="alternated rounds (medians are reported)")
    parser.add_argument("--num-prompts", type=int, default=4, help="GRPO: prompts per step")
    parser.add_argument("--num-generations", type=int, default=8, help="GRPO: samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="GRPO: new tokens at most per sample")
    parser.add_argument("--batch-size", type=int, default=8, help="DPO: pairs per step")
    parser.add_argument(
        "--dry-run", action="store_true", help="this project's side only, 2 steps, 1 round, in this process (CI)"
    )
    # child-process arguments
    parser.add_argument("--side", choices=["ours", "trl"])
    parser.add_argument("--task", choices=list(TASKS))
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--model-path")
    parser.add_argument("--data")
    args = parser.parse_args(argv)
    if args.side:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return []
    if args.dry_run:
        args.skip_trl, args.steps, args.warmup, args.repeats = True, 2, 1, 1
    require_trl_python(parser, args)
    print_header(args.threads, trl_python=None if args.skip_trl else args.trl_python, preset=PRESET)
    lines, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        num_rows = max(args.num_prompts * args.steps, args.batch_size * args.steps)
        data = save_data(tmp, num_rows)
        for size in args.sizes:
            args.size, model_path = size, save_model(size, tmp)
            for task in args.tasks:
                results: dict[str, list[dict]] = {"ours": [], "trl": []}
                for round_ in range(args.repeats):
                    sides = ["ours"] if args.skip_trl else ["trl", "ours"] if round_ % 2 == 0 else ["ours", "trl"]
                    for side in sides:
                        source = data["prompts" if task == "grpo" else "pairs"]
                        if args.dry_run:
                            run = {**vars(args), "side": side, "task": task, "model_path": model_path, "data": source}
                            r = in_process(argparse.Namespace(**run))
                        else:
                            python = args.trl_python if side == "trl" else sys.executable
                            r = _spawn(python, side, task, model_path, source, args)
                        r["run_rss_mb"] = round(r["peak_rss_mb"] - r["import_rss_mb"], 1)
                        results[side].append(r)
                        lines.append(r)
                        print(json.dumps(r), flush=True)
                if not args.skip_trl:
                    ratios.append(ratio(task, results["ours"], results["trl"]))
                    print(json.dumps(ratios[-1]), flush=True)
    if ratios:
        print(table(ratios), flush=True)
    return lines + ratios


if __name__ == "__main__":
    main()
