"""Run by tests/vllm_backend/test_vllm_server.py: 2-process CPU GRPO (gloo; ``ddp`` or ``fsdp``: FSDP2) sampling from a
generation server (``generation.vllm.mode: server``) on 127.0.0.1:PORT. Each rank records, for each of its
rollouts, the step count, its prompts, how many requests the server's ``generate`` served with it, and the
largest |logp_server - logp_policy| over the response tokens (the server's log-probs of the tokens it sampled
against this rank's policy, conditioned on this rank's prompts), in OUT/rank<r>.pt. CHANNEL (default tcp) is
``generation.vllm.weight_channel``: how rank 0 pushes the weights.

    python tests/helpers/vllm_server_ddp_script.py OUT PORT ddp|fsdp [tcp|gloo]
"""

import os
import sys

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402

from aitraining_pl.datamodules.prompt import PromptDataModule  # noqa: E402
from aitraining_pl.models.rollout_scoring import response_logps  # noqa: E402
from aitraining_pl.models.sharding import is_sharded  # noqa: E402
from aitraining_pl.modules.critic_free import GRPOModule  # noqa: E402
from aitraining_pl.rollout import GenerationConfig  # noqa: E402

#: tiny-llama with two heads of 32 (vLLM's CPU attention has no kernel for heads of 16)
SPEC = {"preset": "tiny-llama", "num_attention_heads": 2, "num_key_value_heads": 1}


class Recorded(GRPOModule):
    """GRPO that records each rollout's step, prompts and sampler/policy log-prob gap on this rank."""

    records: list

    def rollout(self, batch, samples):
        rollout = super().rollout(batch, samples)
        with torch.no_grad():
            policy = self.policy.eval()
            ours = response_logps(policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_length, 1.0)
        gap = float(((rollout.sampling_logprobs - ours.logprobs).abs() * rollout.mask).max())
        prompts = self.tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
        batched = self.backend.batched  # the ranks' requests the server's generate served together
        record = {"step": self.global_step, "gap": gap, "prompts": prompts, "rows": len(rollout.texts)}
        self.records.append({**record, "batched": batched})
        return rollout


def main(out: str, port: str, strategy: str, channel: str = "tcp") -> None:
    pl.seed_everything(0)
    vllm = {
        "mode": "server",
        "server_port": int(port),
        "server_timeout": 120,
        "weight_channel": channel,
        "protocol": "tcp",
    }
    module = Recorded(
        model_config=SPEC,
        tokenizer_name="byte",
        reward=lambda prompts, responses, metadata: [float(sum(map(ord, r)) % 7) for r in responses],
        num_generations=4,
        generation=GenerationConfig(max_new_tokens=6, temperature=1.0, backend="vllm", vllm=vllm),
        learning_rate=1e-2,
        mini_batch_size=4,
        kl_coef=0.0,
    )
    module.records = []
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
    )
    trainer.fit(module, data)
    state = {k: v.detach().clone() for k, v in module.policy.state_dict().items()} if strategy == "ddp" else {}
    result = {"records": module.records, "global_step": trainer.global_step, "state": state}
    result["sharded"] = is_sharded(module.policy)
    torch.save(result, os.path.join(out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
