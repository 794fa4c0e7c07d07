"""RewardModule under 2-process CPU DDP: identical weights on both ranks, validation metrics reduced over
all ranks' pairs (equal to the single-process values)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(TESTS, "helpers", "reward_ddp_script.py")
ROOT = os.path.dirname(TESTS)


@pytest.mark.ddp
def test_reward_module_ddp_reduces_metrics_and_keeps_ranks_in_sync(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["steps"] == 3  # 48 training pairs / (8 per batch x 2 ranks)
    first, second = result["states"]
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name
    for name in ("val/rewards/accuracies", "val/rewards/margins"):  # 16 pairs = 8 per rank, so no padded duplicates
        assert result["reduced"][name] == pytest.approx(result["local"][name], abs=1e-5), name
