"""The colocated vLLM backend in several training processes: 2 CPU ranks on gloo under DDP and under FSDP2, one
vLLM engine per rank (vLLM's ``external_launcher``, in-process). After the optimizer steps of a GRPO run each
rank's engine samples with the policy's log-probs (fp32, 1e-4), and not without the sync, a LoRA policy under FSDP2
included (adapters merged as the gathered weights stream); the ranks draw different samples. Skipped where vLLM is
not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(TESTS, "helpers", "vllm_ddp_script.py")
ROOT = os.path.dirname(TESTS)
pytestmark = [pytest.mark.vllm, pytest.mark.ddp, pytest.mark.slow]


@pytest.mark.parametrize(
    ("strategy", "sync", "weights"),
    [
        ("ddp", "on", "full"),
        ("ddp", "off", "full"),
        ("fsdp", "on", "full"),
        ("fsdp", "off", "full"),
        ("fsdp", "on", "lora"),
    ],
)
def test_each_rank_engine_holds_the_policy_weights_after_optimizer_steps(tmp_path, strategy, sync, weights):
    """``tests/helpers/vllm_ddp_script.py``: 2 iterations of 4 optimizer steps; then every rank's engine log-probs
    equal the policy's within 1e-4 (FSDP2: gathered one parameter at a time while streaming into vLLM's
    ``reload_weights``, the policy sharded before and after; LoRA: each delta merged into its gathered base
    weight, and the trained adapters moved the engine away from the base model by more than 1e-2), or differ by
    more than 1e-2 with ``sync_weights: false``; the two ranks' unseeded samples differ."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": ROOT,
    }
    command = [sys.executable, SCRIPT, str(tmp_path), strategy, sync, weights]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for rank in ranks:
        assert rank["global_step"] == 4 and rank["sharded"] == (strategy == "fsdp")
        assert rank["gap"] < 1e-4 if sync == "on" else rank["gap"] > 1e-2, rank["gap"]
        if weights == "lora":  # the trained adapters moved the engine away from the base model
            assert rank["base_gap"] > 1e-2, rank["base_gap"]
    assert not torch.equal(ranks[0]["unseeded"], ranks[1]["unseeded"])
