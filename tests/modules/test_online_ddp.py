"""GRPO under 2-process CPU DDP: each prompt's group on one rank, identical weights and steps at the end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(TESTS, "helpers", "online_ddp_script.py")
ROOT = os.path.dirname(TESTS)


@pytest.mark.ddp
def test_two_rank_grpo_keeps_groups_together_and_ends_with_identical_weights(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    G = 4
    for rank in (r0, r1):
        # 8 prompts / 2 ranks / 2 per batch = 2 iterations; the training calls of the reward saw each batch's
        # prompts G times in a row (validation is off: no other calls)
        assert len(rank["scored"]) == len(rank["batches"]) == 2
        for batch, scored in zip(rank["batches"], rank["scored"]):
            assert scored == [p for p in batch for _ in range(G)]
    prompts0 = {p for b in r0["batches"] for p in b}
    prompts1 = {p for b in r1["batches"] for p in b}
    assert prompts0.isdisjoint(prompts1) and len(prompts0 | prompts1) == 8
    # per iteration: 2 epochs x 8 rows / (4 per minibatch x 2 accumulated) = 2 optimizer steps, 2 iterations
    assert r0["global_step"] == r1["global_step"] == 4
    # metrics were reduced across ranks: both ranks log the same values
    for key in ("train/reward_mean", "train/completion_length", "train/completion_length/max", "train/kl"):
        assert r0["metrics"][key] == pytest.approx(r1["metrics"][key]), key
    assert r0["metrics"]["train/completion_length/max"] == 7  # rank 1's budget (3 + 4), reduced by max
    assert r0["state"].keys() == r1["state"].keys()
    for name, tensor in r0["state"].items():
        assert torch.equal(tensor, r1["state"][name]), name
    from conftest import TINY_LLAMA

    from aitraining_pl.models import build_causal_lm

    initial = build_causal_lm(TINY_LLAMA, seed=0).state_dict()
    assert not torch.equal(initial["lm_head.weight"], r0["state"]["model.lm_head.weight"])


@pytest.mark.ddp
def test_two_rank_grpo_on_multi_turn_episodes_ends_with_identical_weights(tmp_path):
    """Episodes of different lengths and turn counts on the two ranks: the same optimizer steps, metrics reduced
    across ranks (the episode metrics too) and identical weights at the end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    command = [sys.executable, SCRIPT, str(tmp_path), "episodes"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert r0["global_step"] == r1["global_step"] == 4
    for key in ("train/reward_mean", "train/episode/turns", "train/episode/success", "train/episode/truncated"):
        assert r0["metrics"][key] == pytest.approx(r1["metrics"][key]), key
    for name, tensor in r0["state"].items():
        assert torch.equal(tensor, r1["state"][name]), name


@pytest.mark.ddp
@pytest.mark.slow
def test_two_rank_async_grpo_on_a_launched_server_ends_with_identical_weights(tmp_path):
    """Asynchronous GRPO (issue 31) under two DDP ranks: rank 0 starts the HF generation server, both ranks connect
    and sample on it (rank 0 pushes; the server's load gate keeps the other rank's rollouts of a version until it
    moved on), each trains on rollouts one version old; identical weights and steps, the staleness logged."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    command = [sys.executable, SCRIPT, str(tmp_path), "async"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    # 2 epochs x 2 batches per rank, the first only submitted: 3 updates of 2 optimizer steps (num_iterations 2)
    assert r0["global_step"] == r1["global_step"] == 6
    assert r0["metrics"]["train/async/staleness/max"] == r1["metrics"]["train/async/staleness/max"] == 1.0
    for name, tensor in r0["state"].items():
        assert torch.equal(tensor, r1["state"][name]), name


@pytest.mark.ddp
def test_two_rank_grpo_with_a_token_budget_ends_with_identical_weights(tmp_path):
    """``token_budget`` under two DDP ranks whose responses differ in length (3 and 7 tokens at most): the ranks agree
    on one micro-batch count per minibatch (an all-reduce of the most either needs), make the same optimizer steps,
    and end with identical weights."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    command = [sys.executable, SCRIPT, str(tmp_path), "budget"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert r0["global_step"] == r1["global_step"] == 4
    for name, tensor in r0["state"].items():
        assert torch.equal(tensor, r1["state"][name]), name


@pytest.mark.ddp
@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_two_rank_grpo_with_balanced_ranks_trains_as_without(tmp_path, aggregation):
    """``balance_ranks`` under two DDP ranks whose responses differ in length (3 and 7 tokens at most): each rank's
    prompt groups are dealt by real tokens after sampling, so the ranks' token counts even out, and the weights end
    as without balancing, to float32 rounding; the two ranks end identical. Every optimizer step takes all 8 rows of
    a rank (2 accumulated minibatches of 4), and each minibatch's loss is weighted by its normaliser over the mean of
    its step's over the ranks (``step_share``), so the step's loss is that of all 16 rows with one normaliser
    wherever the rows are and however the minibatches are drawn: GRPO's ``sequence`` mean and DAPO's ``token`` mean.
    With ``step_share`` returning 1 (a mean of per-minibatch, per-rank token means), the ``token`` case fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    runs = {}
    for mode in ("responses", "balance"):
        out = tmp_path / mode
        out.mkdir()
        proc = subprocess.run(
            [sys.executable, SCRIPT, str(out), mode, aggregation], env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[mode] = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    r0, r1 = runs["balance"]
    before, after = (
        r0["metrics"]["train/rank_tokens/imbalance_before"],
        r0["metrics"]["train/rank_tokens/imbalance_after"],
    )
    assert before > 0.05 and after < before / 2, (before, after)
    assert r0["global_step"] == r1["global_step"] == 4
    for name, tensor in r0["state"].items():
        assert torch.equal(tensor, r1["state"][name]), name
        torch.testing.assert_close(tensor, runs["responses"][0]["state"][name], rtol=1e-4, atol=1e-5, msg=name)
    # the same responses were sampled and scored: the logged reward is the same
    assert r0["metrics"]["train/reward_mean"] == pytest.approx(runs["responses"][0]["metrics"]["train/reward_mean"])
