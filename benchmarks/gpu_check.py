"""The GPU check of issue 41: one command, one GPU, at most 10 minutes, no network. It prints one table and writes
JSON (``--out``, default ``gpu_check.json``):

- (a) ``clip``: the gradient norm the online update clips, under ``32-true``, ``bf16-mixed`` and ``16-mixed`` (the
  loss scaler's), on the same fixed rollouts: equal within tolerance (the clip runs after the one ``unscale_``);
- (b) ``master``: one full-fine-tune DPO step in ``bf16-mixed`` from a bf16 checkpoint changes >= 99% of the weights
  (float32 master weights; the input embedding, whose absent tokens get no gradient, left out);
- (c) ``fsdp2``: FSDP2 and FSDP2 with CPU offload each fit one DPO step and export a model that loads;
- (d) ``head``: the fused head against a plain log-softmax at V = 152k: equal log-probs and gradients, the time and
  peak memory of each, at two chunk budgets (the CPU's 96 MiB and ``losses.fused_head``'s default for the device);
- (e) ``grpo``: GRPO on the HF backend in ``bf16-mixed`` for 20 optimizer steps, with the reward rising;
- (f) ``vllm``: with vLLM installed, colocated rollouts (GRPO steps) and the weight push time; skipped without it.

``--dry-run`` runs every check's code path on the CPU in well under a minute (tiny shapes, a step or two; CI runs it,
``tests/test_gpu_check.py``): only what needs the device is stubbed: ``16-mixed``'s scaler is a CPU ``GradScaler``
through Lightning's ``MixedPrecision`` plugin, FSDP2's CPU offload (which needs an accelerator) runs as plain FSDP2,
peak memory is not measured, and the reward need not rise in two steps.

On the lent GPU machine (Python 3.12, torch, lightning, transformers, peft, torchmetrics; no registry) the few other
packages the imported code needs come in a wheel folder made here and carried along (``benchmarks/gpu_wheels.txt``)::

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \\
        -d gpu-wheels -r benchmarks/gpu_wheels.txt
    # there:
    pip install --no-index --no-deps gpu-wheels/*.whl && python benchmarks/gpu_check.py --out gpu_check.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("WANDB_MODE", "offline"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_key, _value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "aitraining_pl" / "data" / "quickstart_prompts.jsonl"
#: a ~100M-parameter Llama on the GPU (byte vocabulary), the 2-layer test model in the dry run
GPU_MODEL = {"preset": "tiny-llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
             "num_attention_heads": 16, "num_key_value_heads": 8}  # fmt: skip
DRY_MODEL = {"preset": "tiny-llama", "hidden_size": 32, "intermediate_size": 64}
TINY = {"preset": "tiny-llama"}  #: GRPO's learner (it learns the quickstart task in seconds)
VLLM_TINY = {**TINY, "num_attention_heads": 2, "num_key_value_heads": 2}  #: head size 32 (vLLM's CPU attention)
TOLERANCE = 0.1  #: relative difference allowed between the precisions' clip norms (bf16 and fp16 rounding)


class Setup:
    """The sizes and device of a run: the GPU's, or the dry run's on the CPU."""

    def __init__(self, dry: bool, folder: Path):
        self.dry, self.folder = dry, folder
        self.cuda = torch.cuda.is_available() and not dry
        self.accelerator = "gpu" if self.cuda else "cpu"
        self.model = DRY_MODEL if dry else GPU_MODEL
        self.head = (256, 64, 1000) if dry else (8192, 3584, 152064)  # positions, hidden, vocabulary
        self.grpo_steps = 2 if dry else 20

    def trainer(self, name: str, **options) -> pl.Trainer:
        defaults = dict(accelerator=self.accelerator, devices=1, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(self.folder / name))  # fmt: skip
        return pl.Trainer(**{**defaults, **options})

    def precision(self, precision: str) -> dict:
        """Trainer options for ``precision``; on the CPU ``16-mixed`` keeps its loss scaler (Lightning would turn it
        into bf16 there)."""
        if precision == "16-mixed" and not self.cuda:
            from lightning.pytorch.plugins.precision import MixedPrecision

            return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
        return {"precision": precision}

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@contextlib.contextmanager
def patched(owner, name: str, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


# ---------------------------------------------------------------------------------------------- (a) clip norm
def clip_norms(setup: Setup, precision: str) -> list[float]:
    """The total norms ``clip_grad_norm_`` saw in one GRPO batch whose rollouts are fixed tokens."""
    import aitraining_pl.generation.hf.backend as backend
    from aitraining_pl.datamodules import PromptDataModule
    from aitraining_pl.generation.backend import SampledTokens
    from aitraining_pl.models import load_tokenizer
    from aitraining_pl.modules import GRPOModule
    from aitraining_pl.rollout import GenerationConfig

    fixed = torch.tensor([[40, 41, 1, 0], [1, 0, 0, 0], [50, 51, 52, 53], [60, 1, 70, 71]])
    norms: list[float] = []
    clip = torch.nn.utils.clip_grad_norm_

    def spy(parameters, max_norm, *args, **kwargs):
        norms.append(float(clip(parameters, max_norm, *args, **kwargs)))
        return torch.tensor(norms[-1])

    module = GRPOModule(
        model_config=setup.model, tokenizer_name="byte", reward=lambda p, r, m: [1.0, 0.0, 0.25, 0.5],
        generation=GenerationConfig(max_new_tokens=4, temperature=1.0, top_p=1.0), num_generations=2, kl_coef=0.0,
        mini_batch_size=2, learning_rate=1e-5, max_grad_norm=1e-3,
    )  # fmt: skip
    data = PromptDataModule(prompts=["hello", "a longer prompt"], tokenizer=load_tokenizer("byte"), batch_size=2)
    sampled = lambda *a, **k: SampledTokens(fixed.clone().to(a[1].device))  # noqa: E731
    with patched(backend, "sample_responses", sampled), patched(torch.nn.utils, "clip_grad_norm_", spy):
        setup.trainer(f"clip-{precision}", limit_train_batches=1, **setup.precision(precision)).fit(module, data)
    return norms


def check_clip(setup: Setup) -> dict:
    norms = {p: clip_norms(setup, p) for p in ("32-true", "bf16-mixed", "16-mixed")}
    plain = norms["32-true"]
    worst = max(abs(n - r) / r for p in ("bf16-mixed", "16-mixed") for n, r in zip(norms[p], plain))
    same = all(len(n) == len(plain) for n in norms.values())
    detail = {p: [round(x, 5) for x in n] for p, n in norms.items()}
    return {"ok": same and worst < TOLERANCE, "max_rel_diff": round(worst, 5), **detail}


# ---------------------------------------------------------------------------------------------- (b) master weights
def preference_data(batch_size: int = 4):
    from aitraining_pl.datamodules import PreferenceDataModule
    from aitraining_pl.models import load_tokenizer

    topics = ["gravity", "an atom", "a volcano", "the moon", "a battery", "friction", "a glacier", "a neuron"]
    prompts = [f"Q{i}: what is {t}?" for i, t in enumerate(topics)]
    chosen = [f"Sure! {t} is a fine thing." for t in topics]
    rejected = ["idk lol", "meh", "no idea", "ask someone else"] * 2
    return PreferenceDataModule(prompts=prompts, chosen=chosen, rejected=rejected, tokenizer=load_tokenizer("byte"),
                                batch_size=batch_size, max_length=64, max_prompt_length=24, val_split=0)  # fmt: skip


def changed_fraction(model: torch.nn.Module, before: list[torch.Tensor]) -> float:
    embedding = model.get_input_embeddings().weight
    pairs = [(p, b) for p, b in zip(model.parameters(), before) if p is not embedding]
    changed = sum(int((p.detach().float().cpu() != b).sum()) for p, b in pairs)
    return changed / sum(p.numel() for p, _ in pairs)


def check_master(setup: Setup) -> dict:
    from aitraining_pl.models import build_causal_lm
    from aitraining_pl.modules import DPOModule

    folder = setup.folder / "bf16-checkpoint"
    build_causal_lm(setup.model, dtype="bfloat16").save_pretrained(str(folder))
    module = DPOModule(model_name=str(folder), tokenizer_name="byte", learning_rate=1e-5)
    before = [p.detach().float().cpu().clone() for p in module.policy.parameters()]
    setup.trainer("master", max_steps=1, precision="bf16-mixed").fit(module, preference_data())
    fraction = changed_fraction(module.policy, before)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.policy.parameters()})
    return {"ok": fraction >= 0.99 and dtypes == ["float32"], "changed": round(fraction, 4), "dtypes": dtypes}


# ---------------------------------------------------------------------------------------------- (c) FSDP2
def fsdp2_step(setup: Setup, offload: bool) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from aitraining_pl.callbacks.export import HFExportCallback
    from aitraining_pl.models.sharding import full_weights
    from aitraining_pl.modules import DPOModule
    from aitraining_pl.strategies import FSDP2Strategy

    name = "fsdp2_cpu_offload" if offload else "fsdp2"
    stubbed = offload and not setup.cuda  # CPU offload moves shards off an accelerator: plain FSDP2 on a CPU
    module = DPOModule(model_config=setup.model, tokenizer_name="byte", learning_rate=1e-5)
    export = setup.folder / name
    trainer = setup.trainer(name, max_steps=1, precision="bf16-mixed", strategy=FSDP2Strategy(cpu_offload=offload
                            and not stubbed), callbacks=[HFExportCallback(str(export))])  # fmt: skip
    start = time.perf_counter()
    try:
        trainer.fit(module, preference_data())
        with full_weights(module.policy):
            head = module.policy.get_output_embeddings().weight.detach().float().cpu().clone()
        backend = dist.get_backend() if dist.is_initialized() else None
    finally:
        if dist.is_initialized():  # the next check starts its own process group (another backend)
            dist.destroy_process_group()
    loaded = AutoModelForCausalLM.from_pretrained(str(export / "last"), dtype=torch.float32)
    same = torch.allclose(loaded.get_output_embeddings().weight, head)
    seconds = round(time.perf_counter() - start, 2)
    return {
        "ok": same,
        "backend": backend,
        "seconds": seconds,
        **({"stubbed": "plain fsdp2 on CPU"} if stubbed else {}),
    }


def check_fsdp2(setup: Setup) -> dict:
    runs = {"fsdp2": fsdp2_step(setup, False), "fsdp2_cpu_offload": fsdp2_step(setup, True)}
    return {"ok": all(r["ok"] for r in runs.values()), **runs}


# ---------------------------------------------------------------------------------------------- (d) fused head
def fused_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, budget: int | None):
    """The one call into ``losses.fused_head`` (its chunk budget in bytes; None: its default)."""
    from aitraining_pl.losses.fused_head import fused_head_logps

    options = {} if budget is None else {"memory_budget": budget}
    return fused_head_logps(hidden, weight, targets, **options).logps


def plain_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.T).float()
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


def timed_head(setup: Setup, fn, hidden, weight, targets) -> dict:
    """One forward and backward of ``fn``: seconds, peak extra device memory (MiB; None on the CPU), log-probs and
    gradients."""
    hidden.grad = weight.grad = None
    if setup.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if setup.cuda else 0
    setup.synchronize()
    start = time.perf_counter()
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        logps = fn(hidden, weight, targets)
    logps.sum().backward()
    setup.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if setup.cuda else None
    return {"seconds": seconds, "peak_mib": peak, "logps": logps.detach(), "grads": (hidden.grad, weight.grad)}


def check_head(setup: Setup) -> dict:
    rows, size, vocab = setup.head
    device = "cuda" if setup.cuda else "cpu"
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(rows, size, generator=generator).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, size, generator=generator) * size**-0.5).to(device, torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=generator).to(device)
    plain = timed_head(setup, plain_logps, hidden, weight, targets)
    timed_head(setup, plain_logps, hidden, weight, targets)  # warm-up done: the figures below are steady
    plain = timed_head(setup, plain_logps, hidden, weight, targets)
    result = {"plain": {"seconds": round(plain["seconds"], 4), "peak_mib": plain["peak_mib"]}}
    ok = True
    for label, budget in (("96MiB", 96 * 2**20), ("default", None)):  # the CPU's budget, the device's default
        fused = timed_head(setup, lambda h, w, t, b=budget: fused_logps(h, w, t, b), hidden, weight, targets)
        diff = float((fused["logps"] - plain["logps"]).abs().max())
        grad = max(float((f.float() - p.float()).abs().max() / p.float().abs().max().clamp_min(1e-12))
                   for f, p in zip(fused["grads"], plain["grads"]))  # fmt: skip
        ok = ok and diff < 0.05 and grad < 0.05
        result[label] = {"seconds": round(fused["seconds"], 4), "peak_mib": fused["peak_mib"],
                         "max_logp_diff": round(diff, 5), "max_rel_grad_diff": round(grad, 5)}  # fmt: skip
    return {"ok": ok, "shape": {"positions": rows, "hidden": size, "vocab": vocab}, **result}


# ---------------------------------------------------------------------------------------------- (e) GRPO learns
class RewardLog(pl.Callback):
    """Each batch's mean reward, and the seconds of the backend's last weight push (a vLLM engine's or server's)."""

    def __init__(self):
        self.rewards: list[float] = []
        self.push_seconds: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.rewards.append(float(trainer.callback_metrics["train/reward_mean"]))
        seconds = getattr(pl_module.backend, "sync_seconds", None)
        if seconds is not None:
            self.push_seconds.append(round(float(seconds), 4))


def grpo(setup: Setup, steps: int, model: dict = TINY, **generation) -> RewardLog:
    """GRPO on the quickstart task (reward: the share of lowercase vowels) for ``steps`` optimizer steps."""
    from aitraining_pl.datamodules import PromptDataModule
    from aitraining_pl.models import load_tokenizer
    from aitraining_pl.modules import GRPOModule
    from aitraining_pl.rollout import GenerationConfig

    pl.seed_everything(0)
    module = GRPOModule(
        model_config=model, tokenizer_name="byte", reward="aitraining_pl.rewards:char_fraction_reward",
        generation=GenerationConfig(max_new_tokens=8, temperature=1.0, top_p=1.0, **generation),
        learning_rate=1e-2, mini_batch_size=16, num_generations=4,
    )  # fmt: skip
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]  # no ``datasets`` needed
    prompts, metadata = [r.pop("prompt") for r in rows], rows
    data = PromptDataModule(prompts=prompts, metadata=metadata, tokenizer=load_tokenizer("byte"), batch_size=8)
    log = RewardLog()
    setup.trainer("grpo", max_steps=steps, max_epochs=-1, precision="bf16-mixed", callbacks=[log]).fit(module, data)
    return log


def check_grpo(setup: Setup) -> dict:
    rewards = grpo(setup, setup.grpo_steps).rewards
    third = max(1, len(rewards) // 3)
    first, last = sum(rewards[:third]) / third, sum(rewards[-third:]) / third
    rising = last > first + 0.05
    return {"ok": bool(rewards) and (rising or setup.dry), "first": round(first, 4), "last": round(last, 4),
            "batches": len(rewards), **({"stubbed": "rise not required in 2 steps"} if setup.dry else {})}  # fmt: skip


# ---------------------------------------------------------------------------------------------- (f) vLLM
def vllm_rollouts(setup: Setup, **generation) -> dict:
    """GRPO steps sampled by vLLM: the batches trained and the last weight push's seconds."""
    start = time.perf_counter()
    log = grpo(setup, 2 if setup.dry else 6, VLLM_TINY, **generation)
    return {
        "batches": len(log.rewards),
        "push_seconds": log.push_seconds,
        "seconds": round(time.perf_counter() - start, 2),
    }


def check_vllm(setup: Setup) -> dict:
    if importlib.util.find_spec("vllm") is None:
        return {"ok": None, "skipped": "vLLM is not installed"}
    from aitraining_pl.generation.config import VLLMConfig

    options = VLLMConfig(gpu_memory_utilization=0.2) if setup.cuda else VLLMConfig()
    result = {"colocated": vllm_rollouts(setup, backend="vllm", vllm=options)}
    try:  # a launched server (rank 0 starts it on this machine)
        result["server"] = vllm_rollouts(setup, backend="vllm", server="launch", vllm=options)
    except Exception as error:  # noqa: BLE001 - reported in the table; the colocated figures stand
        result["server"] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    return {"ok": all("error" not in r and r["batches"] for r in result.values()), **result}


CHECKS = {"clip": check_clip, "master": check_master, "fsdp2": check_fsdp2, "head": check_head,
          "grpo": check_grpo, "vllm": check_vllm}  # fmt: skip


def table(results: dict) -> str:
    """One row per check: its verdict, seconds and figures."""
    lines = [f"{'check':<8} {'result':<8} {'seconds':>8}  figures", "-" * 100]
    for name, result in results.items():
        verdict = {True: "ok", False: "FAIL", None: "skipped"}[result.get("ok")]
        figures = {k: v for k, v in result.items() if k not in ("ok", "seconds_total", "error")}
        text = result.get("error") or json.dumps(figures, default=str)
        lines.append(f"{name:<8} {verdict:<8} {result.get('seconds_total', 0):>8.1f}  {text[:300]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="every check's code path on the CPU, tiny shapes")
    parser.add_argument("--out", default="gpu_check.json", help="the JSON file written")
    parser.add_argument(
        "--only", default=",".join(CHECKS), help=f"checks to run, comma-separated ({', '.join(CHECKS)})"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - set(CHECKS))
    if unknown:
        parser.error(f"--only: unknown checks {unknown}; known: {', '.join(CHECKS)}")
    torch.set_float32_matmul_precision("high")
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        setup = Setup(args.dry_run, Path(folder))
        for name in args.only.split(","):
            start = time.perf_counter()
            try:
                results[name] = CHECKS[name](setup)
            except Exception as error:  # noqa: BLE001 - one check's failure is reported, the others still run
                traceback.print_exc()
                results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            results[name]["seconds_total"] = round(time.perf_counter() - start, 2)
    header = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": args.dry_run,
              "device": torch.cuda.get_device_name() if setup.cuda else "cpu", "torch": torch.__version__}  # fmt: skip
    Path(args.out).write_text(json.dumps({**header, "checks": results}, indent=2, default=str) + "\n")
    print(json.dumps(header))
    print(table(results))
    return 0 if all(r.get("ok") is not False for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
