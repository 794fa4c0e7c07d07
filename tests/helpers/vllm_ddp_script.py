"""Run by tests/generation/test_vllm_distributed.py: GRPO on the colocated vLLM backend in 2 CPU processes (gloo),
one vLLM engine per process (``external_launcher``). ``python vllm_ddp_script.py OUT STRATEGY SYNC WEIGHTS``:
``STRATEGY`` is ``ddp`` or ``fsdp`` (``fsdp2``: the sync all-gathers one parameter at a time), ``SYNC`` ``on`` or
``off`` (``generation.vllm.sync_weights``), ``WEIGHTS`` ``full`` or ``lora`` (LoRA adapters on the policy, merged
into the engine's weights as they stream). After training each rank syncs its engine once more and writes
``OUT/rank<r>.pt``: the largest |logp_engine - logp_policy| over a sampled rollout (with LoRA also against the
policy with its adapters off), the optimizer steps made and the tokens its engine drew without a seed (the ranks'
engines are seeded differently)."""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)
HELPERS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HELPERS, os.path.dirname(HELPERS)]  # the helpers and tests/ (conftest)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import lightning.pytorch as pl  # noqa: E402

from aitraining_pl.datamodules.prompt import PromptDataModule  # noqa: E402
from aitraining_pl.generation.config import VLLMConfig  # noqa: E402
from aitraining_pl.models import LoRAConfig, is_peft_model  # noqa: E402
from aitraining_pl.models.sharding import is_sharded  # noqa: E402
from aitraining_pl.models.training import eval_mode  # noqa: E402
from aitraining_pl.modules.critic_free import GRPOModule  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

#: two heads of 32 (vLLM's CPU attention) over the byte tokenizer's vocabulary
POLICY = {"preset": "tiny-llama", "num_attention_heads": 2, "num_key_value_heads": 1}


class Probe(pl.Callback):
    """At the end of training: sync the engine (a collective under FSDP2: every rank does it), sample a rollout
    with it and compare its log-probs with the policy's; draw unseeded samples to compare across ranks."""

    def __init__(self, out: str):
        self.out = out

    @torch.no_grad()
    def on_train_end(self, trainer, module):
        engine = module.backend
        engine.sync(module.policy, version=trainer.global_step)
        tokenizer = module.tokenizer
        tokenizer.padding_side = "left"
        enc = tokenizer(["hello there", "what is two plus two"], padding=True, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        sampler = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=8, temperature=1.0), backend=engine)
        rollout = sampler.sample(module.policy, ids, mask, 4, seed=0)
        with eval_mode(module.policy):
            policy = module.response_scores(module.policy, rollout.input_ids, rollout.attention_mask, ids.shape[1])
        result = {
            "gap": self.gap(rollout, policy.logprobs),
            "global_step": trainer.global_step,
            "unseeded": sampler.sample(module.policy, ids, mask, 4).response_ids,
            "sharded": is_sharded(module.policy),  # FSDP2: the policy stays sharded through the sync
        }
        if is_peft_model(module.policy):  # the trained adapters changed the model: the engine is not the base
            with eval_mode(module.policy), module.policy.disable_adapter():
                base = module.response_scores(module.policy, rollout.input_ids, rollout.attention_mask, ids.shape[1])
            result["base_gap"] = self.gap(rollout, base.logprobs)
        torch.save(result, os.path.join(self.out, f"rank{trainer.global_rank}.pt"))

    @staticmethod
    def gap(rollout, logprobs: torch.Tensor) -> float:
        """Largest |logp_engine - logprobs| over the response tokens of ``rollout``."""
        return float(((rollout.sampling_logprobs - logprobs).abs() * rollout.response_mask).max())


def main(out: str, strategy: str, sync: str, weights: str) -> None:
    pl.seed_everything(0)
    module = GRPOModule(
        model_config=POLICY,
        tokenizer_name="byte",
        reward="aitraining_pl.rewards:char_fraction_reward",
        num_generations=4,
        generation=GenerationConfig(
            max_new_tokens=6, temperature=1.0, backend="vllm", vllm=VLLMConfig(sync_weights=sync == "on")
        ),
        learning_rate=0.02,
        mini_batch_size=4,
        kl_coef=0.0,
        lora=LoRAConfig(r=4, alpha=8, dropout=0.0) if weights == "lora" else None,
    )
    data = PromptDataModule(prompts=[f"prompt {i}" for i in range(8)], tokenizer="byte", batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy={"ddp": "ddp", "fsdp": "fsdp2"}[strategy],
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Probe(out)],
    )
    trainer.fit(module, data)


if __name__ == "__main__":
    main(*sys.argv[1:5])
