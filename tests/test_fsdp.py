"""FSDP2 (``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``) on 2
CPU processes with gloo, against a 1-process run and 2-process DDP (``tests/helpers/fsdp_script.py`` runs the cases)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(TESTS, "helpers", "fsdp_script.py")
ROOT = os.path.dirname(TESTS)
SAME_AS_ONE_PROCESS = ["dpo_step", "dpo_lora", "dpo_checkpointing", "reward_step"]
RUNS = {
    "fsdp": [*SAME_AS_ONE_PROCESS, "dpo_bf16", "dpo_resume", "ppo_step", "grpo_step", "rloo_step", "sft_step"],
    "ddp": ["ppo_step", "grpo_step", "rloo_step", "sft_step", "file_order"],
    "single": [*SAME_AS_ONE_PROCESS, "dpo_bf16"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for strategy, cases in RUNS.items():
        proc = subprocess.run(
            [sys.executable, SCRIPT, str(out), strategy, *cases], env=env, capture_output=True, text=True, timeout=900
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
    return lambda name: torch.load(out / f"{name}.pt", weights_only=False)


def max_difference(a: dict, b: dict, skip: tuple[str, ...] = ()) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a if not k.endswith(skip))


def assert_export_reproduces(auto_class, result: dict) -> None:
    """The export loads with ``auto_class`` and gives the trained module's logits on the script's probe."""
    from fsdp_script import PROBE

    model = auto_class.from_pretrained(result["export"]).eval()
    with torch.no_grad():
        assert torch.allclose(model(PROBE).logits, result["logits"], atol=1e-5)


def moved(result: dict) -> float:
    """The largest change of a weight in training (lr 1e-3: Adam's first step moves weights by about that)."""
    return max_difference(result["state"], result["initial"])


@pytest.mark.ddp
@pytest.mark.parametrize("case", ["dpo_step", "dpo_lora", "dpo_checkpointing"])
def test_dpo_first_step_equals_one_process(results, case):
    sharded, single = results(f"{case}-fsdp"), results(f"{case}-single")
    assert sharded["sharded"] and not single["sharded"]
    assert max_difference(sharded["state"], single["state"]) < 1e-5
    assert moved(single) > 5e-4
    for name, value in single["metrics"].items():  # validation metrics reduced over the ranks' halves
        assert sharded["metrics"][name] == pytest.approx(value, abs=1e-5), name


@pytest.mark.ddp
def test_reward_model_first_step_equals_one_process(results):
    sharded, single = results("reward_step-fsdp"), results("reward_step-single")
    # the head bias cancels in r_chosen - r_rejected: its exact gradient is 0, so Adam's first step on it is rounding
    # noise divided by itself, in either run
    assert max_difference(sharded["state"], single["state"], skip=("head.bias",)) < 1e-5
    assert moved(single) > 5e-4


@pytest.mark.ddp
@pytest.mark.parametrize("case", ["ppo_step", "grpo_step", "rloo_step", "sft_step"])
def test_first_step_equals_ddp(results, case):
    """Each rank samples its own rollouts (PPO greedy, GRPO / RLOO sampled with the rank's seed) and whitens its
    own advantages, SFT averages over its own tokens, as under DDP; FSDP2 must take DDP's step exactly."""
    sharded, ddp = results(f"{case}-fsdp"), results(f"{case}-ddp")
    assert max_difference(sharded["state"], ddp["state"]) < 1e-5
    assert moved(sharded) > 5e-4
    assert sharded["history"] == pytest.approx(ddp["history"], abs=1e-6)


@pytest.mark.ddp
def test_bf16_mixed_precision_keeps_float32_masters(results):
    sharded, single = results("dpo_bf16-fsdp"), results("dpo_bf16-single")
    assert sharded["dtypes"] == ["torch.float32"]  # bf16 compute, float32 sharded parameters and optimizer
    assert moved(sharded) > 5e-4
    assert sharded["metrics"]["val/loss"] == pytest.approx(single["metrics"]["val/loss"], abs=5e-3)


@pytest.mark.ddp
def test_sharded_checkpoint_resumes_to_the_uninterrupted_weights_and_exports(results):
    from transformers import AutoModelForCausalLM

    result = results("dpo_resume-fsdp")
    assert os.path.isdir(result["checkpoint"])  # a distributed checkpoint: one shard file per rank
    assert sorted(f for f in os.listdir(result["checkpoint"]) if f.endswith(".distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert result["steps"] == 3
    assert max_difference(result["straight"], result["resumed"]) == 0.0
    assert_export_reproduces(AutoModelForCausalLM, result)


@pytest.mark.ddp
def test_lora_export_under_fsdp2_is_the_adapters_and_loads_with_peft(results):
    from peft import AutoPeftModelForCausalLM

    result = results("dpo_lora-fsdp")
    assert os.path.isfile(os.path.join(result["export"], "adapter_config.json"))
    assert not os.path.isfile(os.path.join(result["export"], "model.safetensors"))  # the adapters, not merged
    assert_export_reproduces(AutoPeftModelForCausalLM, result)


@pytest.mark.ddp
def test_unshuffled_data_keeps_its_order_across_ranks(results):
    """``shuffle=False`` holds under DDP too (Lightning shuffles the training loaders it distributes)."""
    assert results("file_order-ddp")["batches"] == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
