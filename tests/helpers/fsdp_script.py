"""Run by tests/test_fsdp.py: the modules under 2-process CPU FSDP2 (``FSDP2Strategy``, gloo) or DDP.

``python fsdp_script.py OUT STRATEGY CASE...`` runs each case in the same two processes; rank 0 writes
``OUT/<case>-<strategy>.pt`` with the full weights after training (gathered by ``models.sharding.full_weights``)
and what the case measured. The same cases run in one process (``STRATEGY`` = ``single``, no launch) give the
reference a sharded run is compared with.
"""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)
HELPERS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HELPERS, os.path.dirname(HELPERS)]  # the helpers and tests/ (conftest)

import lightning.pytorch as pl  # noqa: E402
from conftest import TINY_LLAMA  # noqa: E402
from dpo_utils import preference_data, preference_rows  # noqa: E402

from aitraining_pl.callbacks.export import HFExportCallback  # noqa: E402
from aitraining_pl.datamodules.preference import PreferenceDataModule  # noqa: E402
from aitraining_pl.datamodules.prompt import PromptDataModule  # noqa: E402
from aitraining_pl.datamodules.sft import SFTDataModule  # noqa: E402
from aitraining_pl.models.sharding import full_weights, is_sharded  # noqa: E402
from aitraining_pl.modules.critic_free import GRPOModule, RLOOModule  # noqa: E402
from aitraining_pl.modules.dpo import DPOModule  # noqa: E402
from aitraining_pl.modules.ppo import PPOModule  # noqa: E402
from aitraining_pl.modules.reward import RewardModule  # noqa: E402
from aitraining_pl.modules.sft import SFTModule  # noqa: E402
from aitraining_pl.rollout import GenerationConfig  # noqa: E402
from aitraining_pl.strategies import FSDP2Strategy  # noqa: E402

PROBE = torch.tensor([[5, 17, 42, 99, 7, 3]])  # token ids whose logits an export must reproduce
GLOBAL_BATCH = 4  # pairs (DPO, reward) or prompts (PPO, GRPO) per optimizer step, over all ranks


def trainer(strategy: str, out: str, **overrides) -> pl.Trainer:
    devices = 1 if strategy == "single" else 2
    kinds = {"single": "auto", "ddp": "ddp", "fsdp": FSDP2Strategy(), "sp": FSDP2Strategy(sequence_parallel_size=2)}
    options = dict(
        accelerator="cpu", devices=devices, strategy=kinds[strategy], max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=out,
    )  # fmt: skip
    return pl.Trainer(**{**options, **overrides})


def data_ranks(strategy: str) -> int:
    """Data-parallel ranks: 1 in one process and under sequence parallelism 2 (both ranks read the same batches)."""
    return 1 if strategy in ("single", "sp") else 2


def pairs_data(module, devices: int, pairs: int = 6) -> PreferenceDataModule:
    """``pairs`` rows, a third held out: with the default, 4 training pairs make one global batch (in any order, so
    a 1-process run and a 2-process one take the same first step)."""
    rows = preference_rows(pairs, seed=1)
    options = dict(val_split=1 / 3, max_length=64, max_prompt_length=32, shuffle=False)
    return preference_data(rows, module.tokenizer, batch_size=GLOBAL_BATCH // devices, **options)


def prompt_data(devices: int) -> PromptDataModule:
    prompts = [f"prompt {i}" for i in range(GLOBAL_BATCH)]  # one global batch, in any order
    return PromptDataModule(prompts=prompts, tokenizer="byte", batch_size=GLOBAL_BATCH // devices)


def full_state(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """The weights (float32 masters under mixed precision, full tensors under FSDP2)."""
    with full_weights(module):
        return {k: v.detach().clone() for k, v in module.state_dict().items() if not k.startswith("_")}


def dpo(strategy: str, out: str, precision: str = "32-true", steps: int = 1, pairs: int = 6, options=None, **fit):
    options = {"learning_rate": 1e-3, "warmup_ratio": 0.0, **(options or {})}
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", **options)
    devices = data_ranks(strategy)
    run = trainer(strategy, out, max_steps=steps, max_epochs=None, precision=precision, **fit.pop("trainer", {}))
    data = pairs_data(module, devices, pairs)
    initial = full_state(module)
    run.fit(module, datamodule=data, **fit)
    metrics = run.validate(module, datamodule=data, verbose=False)[0]
    return {"module": module, "trainer": run, "initial": initial, "metrics": {k: float(v) for k, v in metrics.items()}}


def probe_logits(module: pl.LightningModule) -> torch.Tensor:
    """The policy's logits on ``PROBE`` (full weights)."""
    with full_weights(module), torch.no_grad():
        return module.policy.eval()(PROBE).logits


def case_dpo_step(strategy: str, out: str, trainer_options=None, **options) -> dict:
    result = dpo(strategy, out, options=options, trainer=trainer_options or {})
    state, sharded = full_state(result["module"]), is_sharded(result["module"])
    return {
        "state": state, "initial": result["initial"], "metrics": result["metrics"], "sharded": sharded,
        "logits": probe_logits(result["module"]),
    }  # fmt: skip


def case_dpo_lora(strategy: str, out: str) -> dict:
    """LoRA: frozen base weights and trainable adapters in the same FSDP units; the reference is the policy with
    its adapters off (no second copy). The export holds the adapters only (and the base beside them)."""
    export = HFExportCallback(dirpath=os.path.join(out, "export"))
    lora = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
    result = case_dpo_step(strategy, out, {"callbacks": [export]}, lora=lora, learning_rate=1e-2)
    return {**result, "export": os.path.join(out, "export", "last")}


def case_dpo_checkpointing(strategy: str, out: str) -> dict:
    """Activation checkpointing per transformer block under FSDP2 (the blocks are gathered again to recompute)."""
    return case_dpo_step(strategy, out, gradient_checkpointing=True)


def case_dpo_bf16(strategy: str, out: str) -> dict:
    result = dpo(strategy, out, precision="bf16-mixed", steps=2)
    state, initial = full_state(result["module"]), result["initial"]
    dtypes = sorted({str(v.dtype) for v in state.values()})
    return {"state": state, "initial": initial, "metrics": result["metrics"], "dtypes": dtypes}


def case_dpo_resume(strategy: str, out: str) -> dict:
    """3 steps straight (8 training pairs: 2 steps per epoch); 1 step (mid-epoch) ending in a sharded checkpoint,
    then a new run resumed from it to step 3; the export of the resumed run."""
    straight = dpo(strategy, os.path.join(out, "straight"), steps=3, pairs=12)
    from lightning.pytorch.callbacks import ModelCheckpoint

    folder = os.path.join(out, "resumed")
    checkpoint = ModelCheckpoint(dirpath=os.path.join(folder, "ckpt"), save_last=True, every_n_train_steps=1)
    callbacks = [checkpoint, StopAt(1)]  # the same 3-step run (learning-rate schedule), stopped after step 1
    dpo(strategy, folder, steps=3, pairs=12, trainer={"enable_checkpointing": True, "callbacks": callbacks})
    path = checkpoint.last_model_path
    export = HFExportCallback(dirpath=os.path.join(folder, "export"))
    resumed = dpo(strategy, folder, steps=3, pairs=12, ckpt_path=path, trainer={"callbacks": [export]})
    return {
        "straight": full_state(straight["module"]),
        "resumed": full_state(resumed["module"]),
        "checkpoint": path,
        "checkpoint_is_dir": os.path.isdir(path),
        "export": os.path.join(folder, "export", "last"),
        "logits": probe_logits(resumed["module"]),
        "steps": resumed["trainer"].global_step,
    }


class CountUlysses:
    """Within the block, counts the calls of the sequence-parallel attention (a split forward really ran)."""

    def __enter__(self):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from aitraining_pl.models.sequence_parallel import ULYSSES_ATTENTION

        self.calls, self.table, self.inner = 0, ALL_ATTENTION_FUNCTIONS, ALL_ATTENTION_FUNCTIONS[ULYSSES_ATTENTION]
        self.table[ULYSSES_ATTENTION] = self
        return self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __exit__(self, *exc):
        from aitraining_pl.models.sequence_parallel import ULYSSES_ATTENTION

        self.table[ULYSSES_ATTENTION] = self.inner


class StopAt(pl.Callback):
    """Stop training after optimizer step ``step`` (an interrupted run)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        trainer.should_stop = trainer.should_stop or trainer.global_step >= self.step


def case_reward_step(strategy: str, out: str) -> dict:
    module = RewardModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-3, warmup_ratio=0.0)
    devices = data_ranks(strategy)
    run, initial = trainer(strategy, out, max_steps=1), full_state(module)
    run.fit(module, datamodule=pairs_data(module, devices))
    return {"state": full_state(module), "initial": initial}


def distinct_bytes(prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
    """A reward that varies between any two random responses: the share of distinct characters."""
    return [len(set(r)) / (1 + len(r)) for r in responses]


def online(kind, strategy: str, out: str, do_sample: bool = False, **kwargs) -> dict:
    devices = data_ranks(strategy)
    module = kind(
        model_config=TINY_LLAMA, tokenizer_name="byte", reward=distinct_bytes,
        generation=GenerationConfig(max_new_tokens=6, do_sample=do_sample), learning_rate=1e-3, warmup_ratio=0.0,
        **kwargs,
    )  # fmt: skip
    run, initial = trainer(strategy, out, max_steps=1), full_state(module)
    run.fit(module, datamodule=prompt_data(devices))
    history = [float(h["loss"]) for h in module.update_history]
    return {"state": full_state(module), "initial": initial, "history": history}


def case_ppo_step(strategy: str, out: str) -> dict:
    return online(PPOModule, strategy, out, mini_batch_size=2, num_iterations=1, kl_coef=0.05)


def case_rloo_step(strategy: str, out: str) -> dict:
    return online(RLOOModule, strategy, out, do_sample=True, num_generations=4, mini_batch_size=4)


def case_sft_step(strategy: str, out: str) -> dict:
    """SFT averages the loss over each rank's completion tokens, as under DDP."""
    module = SFTModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-3)
    rows = [{"prompt": f"Q{i}: say {w}", "completion": f" {w} " * (1 + i % 3)} for i, w in enumerate("abcdef")]
    data = SFTDataModule(rows=rows, tokenizer=module.tokenizer, batch_size=2, val_split=1 / 3, shuffle=False)
    run, initial = trainer(strategy, out, max_steps=1), full_state(module)
    run.fit(module, datamodule=data)
    return {"state": full_state(module), "initial": initial, "history": []}


def case_grpo_step(strategy: str, out: str) -> dict:
    return online(GRPOModule, strategy, out, do_sample=True, num_generations=4, mini_batch_size=4)


def case_grpo_budget_step(strategy: str, out: str) -> dict:
    """``grpo_step`` with a ``token_budget`` below every row's length (about 14 tokens): under sequence parallelism 2
    each row goes alone into a micro-batch (within twice the budget) for the group to split."""
    return online(GRPOModule, strategy, out, do_sample=True, num_generations=4, mini_batch_size=4, token_budget=10)


def case_file_order(strategy: str, out: str) -> dict:
    """The training batches each rank reads from an unshuffled preference file (``shuffle=False``)."""
    module = DPOModule(model_config=TINY_LLAMA, tokenizer_name="byte", learning_rate=1e-3, warmup_ratio=0.0)
    rows = preference_rows(8, seed=1)
    data = preference_data(rows, module.tokenizer, batch_size=2, val_split=0.0, shuffle=False)
    seen = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch["index"].tolist())

    trainer(strategy, out, max_steps=2, callbacks=[Record()]).fit(module, datamodule=data)
    per_rank = [None] * torch.distributed.get_world_size() if torch.distributed.is_initialized() else [seen]
    if torch.distributed.is_initialized():
        torch.distributed.all_gather_object(per_rank, seen)
    return {"batches": per_rank}


def main(out: str, strategy: str, *cases: str) -> None:
    for case in cases:
        pl.seed_everything(0)
        with CountUlysses() as counter:
            result = globals()[f"case_{case}"](strategy, os.path.join(out, f"{case}-{strategy}"))
        result["ulysses_calls"] = counter.calls
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            torch.save(result, os.path.join(out, f"{case}-{strategy}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
    if torch.distributed.is_initialized():  # gloo's threads joined before the interpreter exits
        torch.distributed.destroy_process_group()  # (a rare 'terminate called' abort at exit otherwise)
