"""On-policy distillation step: ``DistillationModule`` (full-distribution mode) vs TRL 1.16's ``DistillationTrainer``.

The same student (the 3M-parameter body of ``dpo_vs_trl.py``) and teacher (the 25M body), randomly initialised and
saved once, at each vocabulary of ``--vocab-sizes`` (384: the byte tokenizer's; 32000: Llama 2's); the same batch
of prompts (16 tokens) and completions (64 to 112 tokens, right padded), the same ``beta`` and ``temperature``.
One step = the teacher's forward (no gradient), the student's forward, the generalized JSD over the full vocabulary
through each side's chunked heads, the backward and an AdamW step, in fp32 on CPU. Generation is left out of both
sides (the completions are given, as TRL's ``_compute_loss`` receives them after its sampling), so the figures
compare the training step itself. TRL's side calls ``DistillationTrainer._compute_loss`` (its
``trl.kernels.chunked_divergence`` path); ours ``DistillationModule.divergence`` on the teacher's hidden states
(``LocalTeacher.hidden``).

Each measurement runs in its own process (TRL in its own virtual environment, never a dependency of this project),
sides alternating (``--repeats`` rounds) so load from other processes hits both alike. Printed: a header line (the
command, the date, the thread count, both sides' versions), one JSON line per measurement (``samples_per_s`` over the
steps after ``--warmup``, ``peak_rss_mb`` of the process, ``step_peak_mb`` = peak RSS minus the RSS before the first
step: what the steps added), the loss of each side on the first batch before any update, and one ``ratio`` line per
vocabulary with ``loss_diff`` (|ours - TRL|; equal to 1e-5 expected).

    python benchmarks/distill_vs_trl.py --trl-python PATH/TO/trl-venv/bin/python   # or TRL_PYTHON=...
    python benchmarks/distill_vs_trl.py --vocab-sizes 32000 --beta 0.5 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from _common import add_trl_python, peak_rss_mb, print_header, require_trl_python, run_child
from dpo_vs_trl import BASE, SIZES

ROWS, PROMPT, SHORTEST, LONGEST, LR = 8, 16, 64, 112, 1e-4


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return peak_rss_mb()  # not ru_maxrss: a child inherits its parent's over exec (_common.peak_rss_mb)


def make_inputs(folder: str, vocab_size: int) -> None:
    """The student, the teacher (saved with the byte tokenizer) and the batch under ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from aitraining_pl.models import load_tokenizer

    tokenizer = load_tokenizer("byte")
    for name, size in (("student", "3m"), ("teacher", "25m")):
        config = {**BASE, **SIZES[size], "vocab_size": vocab_size}
        torch.manual_seed(0 if name == "student" else 1)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        model.save_pretrained(os.path.join(folder, name))
        tokenizer.save_pretrained(os.path.join(folder, name))
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(SHORTEST, LONGEST + 1, (ROWS,), generator=generator)
    ids = torch.randint(3, vocab_size, (ROWS, PROMPT + LONGEST), generator=generator)
    completion_mask = (torch.arange(LONGEST)[None, :] < lengths[:, None]).long()
    ids[:, PROMPT:] = ids[:, PROMPT:] * completion_mask  # padding: id 0
    torch.save({"ids": ids, "completion_mask": completion_mask}, os.path.join(folder, "batch.pt"))


def _timed_steps(step, optimizer, args) -> tuple[float, float, float]:
    """(loss of the first step before any update, samples/s after warm-up, MB the steps added to the peak RSS)."""
    base = _rss_mb()
    first, times = None, []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = step()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        first = float(loss) if first is None else first
    steady = times[args.warmup :]
    return first, ROWS * len(steady) / sum(steady), _peak_rss_mb() - base


def run_ours(args) -> dict:
    import torch

    from aitraining_pl.modules.distill import DistillationModule

    folder = args.data
    module = DistillationModule(
        model_name=os.path.join(folder, "student"), teacher_model_name=os.path.join(folder, "teacher"),
        beta=args.beta, temperature=args.temperature,
    )  # fmt: skip
    batch = torch.load(os.path.join(folder, "batch.pt"))
    ids, mask = batch["ids"], batch["completion_mask"]
    attention = torch.cat([torch.ones(ROWS, PROMPT, dtype=torch.long), mask], 1)
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=LR)
    module.policy.train()

    def step():
        teacher = module.teacher.hidden(ids, attention, PROMPT, mask)
        return module.divergence(ids, attention, PROMPT, mask, teacher).loss

    return dict(zip(("loss", "samples_per_s", "step_peak_mb"), _timed_steps(step, optimizer, args)))


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    folder = args.data
    student = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "student"))
    teacher = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "teacher"))
    config = DistillationConfig(
        output_dir=os.path.join(folder, "trl"), bf16=False, gradient_checkpointing=False, beta=args.beta,
        temperature=args.temperature, report_to=[], use_cpu=True, per_device_train_batch_size=ROWS,
    )  # fmt: skip
    trainer = DistillationTrainer(
        model=student, teacher_model=teacher, args=config, train_dataset=Dataset.from_list([{"prompt": "a"}] * ROWS),
        processing_class=AutoTokenizer.from_pretrained(os.path.join(folder, "student")),
    )  # fmt: skip
    batch = torch.load(os.path.join(folder, "batch.pt"))
    ids, mask = batch["ids"], batch["completion_mask"]
    inputs = {
        "prompt_ids": ids[:, :PROMPT], "prompt_mask": torch.ones(ROWS, PROMPT, dtype=torch.long),
        "completion_ids": ids[:, PROMPT:], "completion_mask": mask,
    }  # fmt: skip
    model = trainer.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    step = lambda: trainer._compute_loss(model, inputs, None)[0]  # noqa: E731
    return dict(zip(("loss", "samples_per_s", "step_peak_mb"), _timed_steps(step, optimizer, args)))


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    result = run_ours(args) if args.side == "ours" else run_trl(args)
    result.update(
        side=args.side, vocab_size=args.vocab_size, beta=args.beta, temperature=args.temperature, rows=ROWS,
        steps=args.steps, warmup=args.warmup, threads=args.threads, peak_rss_mb=round(_peak_rss_mb(), 1),
        samples_per_s=round(result["samples_per_s"], 3), step_peak_mb=round(result["step_peak_mb"], 1),
    )  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trl_python(parser)
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[384, 32000])
    parser.add_argument("--beta", type=float, default=0.5, help="the generalized JSD's beta (both sides)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the timed ones")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds per vocabulary")
    # child-process arguments
    parser.add_argument("--side", choices=["ours", "trl"])
    parser.add_argument("--vocab-size", type=int, default=384)
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.side:
        return child(args)
    require_trl_python(parser, args)
    print_header(args.threads, trl_python=None if args.skip_trl else args.trl_python, beta=args.beta)
    sides = ["ours"] + ([] if args.skip_trl else ["trl"])
    for vocab_size in args.vocab_sizes:
        with tempfile.TemporaryDirectory() as folder:
            make_inputs(folder, vocab_size)
            results: dict[str, list[dict]] = {side: [] for side in sides}
            for round_ in range(args.repeats):
                for side in sides if round_ % 2 == 0 else sides[::-1]:
                    python = args.trl_python if side == "trl" else sys.executable
                    command = [python, os.path.abspath(__file__), "--side", side, "--vocab-size", str(vocab_size)]
                    command += ["--data", folder, "--beta", str(args.beta), "--temperature", str(args.temperature)]
                    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                    command += ["--threads", str(args.threads)]
                    r = run_child(command, args.threads, f"{side}/{vocab_size}")
                    results[side].append(r)
                    print(json.dumps(r), flush=True)
            if args.skip_trl:
                continue
            ours, trl = (max(results[s], key=lambda r: r["samples_per_s"]) for s in ("ours", "trl"))
            print(json.dumps({
                "ratio": True, "vocab_size": vocab_size, "beta": args.beta,
                "speedup": round(ours["samples_per_s"] / trl["samples_per_s"], 3),
                "peak_rss_ratio": round(ours["peak_rss_mb"] / trl["peak_rss_mb"], 3),
                "step_peak_ratio": round(ours["step_peak_mb"] / max(trl["step_peak_mb"], 1e-9), 3),
                "loss_diff": abs(results["ours"][0]["loss"] - results["trl"][0]["loss"]),
                "ours_samples_per_s": ours["samples_per_s"], "trl_samples_per_s": trl["samples_per_s"],
                "ours_peak_rss_mb": ours["peak_rss_mb"], "trl_peak_rss_mb": trl["peak_rss_mb"],
                "ours_step_peak_mb": ours["step_peak_mb"], "trl_step_peak_mb": trl["step_peak_mb"],
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
