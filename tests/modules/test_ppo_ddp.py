"""PPO under 2-process CPU DDP: ragged rollouts across ranks, identical weights at the end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(TESTS, "helpers", "ppo_ddp_script.py")
ROOT = os.path.dirname(TESTS)


@pytest.mark.ddp
def test_two_rank_ddp_ends_with_identical_weights(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    # each rank sampled its own prompts, with different response lengths
    assert r0["max_new_tokens"] != r1["max_new_tokens"]
    assert set(map(tuple, r0["prompts"])).isdisjoint(map(tuple, r1["prompts"]))
    # 8 prompts / 2 ranks = 1 iteration of 4 prompts per rank; 2 epochs x (4 / (2 per minibatch x 2
    # accumulated)) = 2 optimizer steps
    assert r0["global_step"] == r1["global_step"] == 2
    assert r0["kl_coef"] == r1["kl_coef"]
    assert r0["state"].keys() == r1["state"].keys()
    for name, tensor in r0["state"].items():
        assert torch.equal(tensor, r1["state"][name]), name
    # and training moved the weights
    from conftest import TINY_LLAMA

    from aitraining_pl.models import build_causal_lm

    initial = build_causal_lm(TINY_LLAMA, seed=0).state_dict()
    assert not torch.equal(initial["lm_head.weight"], r0["state"]["model.base_model.lm_head.weight"])
