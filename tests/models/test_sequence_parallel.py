"""Ulysses sequence parallelism (``models.sequence_parallel``, ``FSDP2Strategy(sequence_parallel_size=2)``).

The pure pieces run here; the split forward runs on 2 gloo processes in two launches: ``tests/helpers/sp_script.py``
scores the architecture matrix whole and split, and ``tests/helpers/fsdp_script.py`` trains DPO, PPO and GRPO under
``fsdp2`` with sequence parallel 2 (and a sharded checkpoint resumed) against one process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from aitraining_pl.errors import ConfigError
from aitraining_pl.models import build_causal_lm
from aitraining_pl.models.packing import AttentionPlan, PackedBatch, pack_rows, packed_attention
from aitraining_pl.models.sequence_parallel import check_heads, check_model, local_scored, pad_packed, split_bounds
from aitraining_pl.strategies import FSDP2Strategy

HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
ROOT = os.path.dirname(os.path.dirname(HELPERS))
#: the matrix rows whose attention Ulysses wraps (``ulysses_calls`` > 0 in every case)
SPLIT = [
    "llama", "qwen2", "qwen3", "mistral", "gemma", "mixtral", "qwen2_moe", "phi", "phi3", "granite", "olmo2",
    "cohere", "gpt2", "opt", "gpt_neox", "starcoder2",
]  # fmt: skip
#: rows refused before scoring: sliding windows / soft-capping, hybrid state-space layers, attention bypassing
#: transformers' ``AttentionInterface``
REFUSED = {
    "gemma2": "cannot be wrapped",
    "gemma3_text": "cannot be wrapped",
    "falcon_h1": "cannot be wrapped",
    "falcon": "did not use the packed plan",
    "stablelm": "did not use the packed plan",
}
KINDS = ("rollout", "pairs", "rows")  # GRPO rows sharing prompts, DPO pairs sharing a prompt, rows packed by scoring


def test_split_bounds_cover_the_row_in_equal_slices():
    assert [split_bounds(12, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="does not split"):
        split_bounds(10, 3, 0)


def test_local_scored_partitions_the_scored_tokens():
    sources = torch.tensor([5, 0, 7, 3, 4, 6])
    pieces = [local_scored(sources, *split_bounds(8, 2, r)) for r in range(2)]
    assert pieces[0].tolist() == [1, 3] and pieces[1].tolist() == [0, 2, 4, 5]


def test_padding_the_packed_row_leaves_every_real_token_as_it_was():
    """The pad block attends to itself only: the decoder's hidden states of the real tokens do not change."""
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "vocab_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    model = build_causal_lm(config).eval()
    ids = torch.tensor([[0, 5, 6, 7, 8], [9, 10, 11, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    packed = pack_rows({"input_ids": ids, "attention_mask": mask, "completion_mask": mask})
    padded = pad_packed(packed, 4)
    assert packed.input_ids.shape[1] == 7 and padded.input_ids.shape[1] == 8
    assert padded.plan.blocks[:-1] == packed.plan.blocks and padded.plan.blocks[-1] == (((7, 8),), 1)
    assert pad_packed(padded, 4) is padded

    def hidden(batch: PackedBatch) -> torch.Tensor:
        with torch.no_grad(), packed_attention(model.config, batch.plan):
            out = model.model(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_plan=batch.plan)
        return out.last_hidden_state[0, :7]

    assert torch.allclose(hidden(packed), hidden(padded), atol=1e-6, rtol=0)  # one more row in each matmul
    assert isinstance(padded.plan, AttentionPlan)


def test_heads_that_do_not_divide_are_refused_before_training():
    check_heads(4, 2, 2)
    with pytest.raises(ConfigError, match="3 attention heads, not divisible by the sequence parallel size 2"):
        check_heads(3, 3, 2)
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "vocab_size": 96,
              "num_hidden_layers": 1, "num_attention_heads": 4}  # fmt: skip
    model = build_causal_lm({**config, "num_key_value_heads": 1})
    with pytest.raises(ConfigError, match="sequence_parallel_size: LlamaForCausalLM has 1 key/value heads"):
        check_model(model, 2)
    check_model(model, 1)  # off: nothing to check
    with pytest.raises(ConfigError, match="must be at least 1"):
        FSDP2Strategy(sequence_parallel_size=0)


def run(*args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp_parity")
    run(os.path.join(HELPERS, "sp_script.py"), str(out), "parity", *SPLIT, *REFUSED)
    return torch.load(out / "parity.pt", weights_only=False)


@pytest.mark.ddp
@pytest.mark.parametrize("name", SPLIT)
def test_split_scores_and_gradients_equal_one_rank(parity, name):
    """Log-probs, entropies, values (a value head on the gathered hidden states) and every gradient of a loss on
    all three equal the whole row's on one rank (fp32), for GRPO rollout rows, DPO pairs and rows packed by
    ``token_scores`` itself; the Ulysses attention ran in every case."""
    result = parity[name]
    for kind in KINDS + (("checkpointed",) if name == "llama" else ()):  # llama: also with activation checkpointing
        calls = 4 if kind == "checkpointed" else 2  # one call per layer of the 2-layer model (and its recomputation)
        assert result[f"{kind}/ulysses_calls"] == calls, kind
        for key in ("logps", "entropy", "values"):
            assert result[f"{kind}/{key}"] < 1e-5, (kind, key, result[f"{kind}/{key}"])
        assert result[f"{kind}/grads"] < 2e-6 * max(1.0, result[f"{kind}/grad_scale"]), (kind, result)


@pytest.mark.ddp
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_attention_that_cannot_be_wrapped_is_refused(parity, name):
    assert REFUSED[name] in parity[name]["error"]
    assert "sequence_parallel_size" in parity[name]["error"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp_train")
    script = os.path.join(HELPERS, "fsdp_script.py")
    run(script, str(out), "sp", "dpo_step", "ppo_step", "grpo_step", "grpo_budget_step", "dpo_resume")
    run(script, str(out), "single", "dpo_step", "ppo_step", "grpo_step")
    return lambda name: torch.load(out / f"{name}.pt", weights_only=False)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.ddp
@pytest.mark.parametrize("case", ["dpo_step", "ppo_step", "grpo_step"])
def test_training_with_sequence_parallel_2_equals_one_process(trained, case):
    """DPO (packed pairs), PPO (greedy rollouts, a value head on the gathered hidden states) and GRPO (sampled
    rollouts: the group's first rank reads the batch in one process's order and samples from the same random state,
    so its rollout is one process's token for token): the first step with both ranks splitting every row equals one
    process's step on the same global batch."""
    split, single = trained(f"{case}-sp"), trained(f"{case}-single")
    assert split["ulysses_calls"] > 0 and single["ulysses_calls"] == 0
    assert max_difference(split["state"], single["state"]) < 1e-5
    assert max_difference(single["state"], single["initial"]) > 5e-4
    assert split.get("history") == pytest.approx(single.get("history"), abs=1e-5)
    for name, value in single.get("metrics", {}).items():
        assert split["metrics"][name] == pytest.approx(value, abs=1e-5), name


@pytest.mark.ddp
def test_grpo_trains_with_sequence_parallel_2(trained):
    """Sampled GRPO rollouts (the group's first rank samples, ``from_group_leader``): 4 updates on split rows."""
    result = trained("grpo_step-sp")
    assert result["ulysses_calls"] > 0
    assert len(result["history"]) == 4 and all(torch.isfinite(torch.tensor(result["history"])))
    assert max_difference(result["state"], result["initial"]) > 5e-4


@pytest.mark.ddp
def test_sequence_parallel_checkpoint_resumes_exactly(trained):
    result = trained("dpo_resume-sp")
    assert result["ulysses_calls"] > 0 and result["steps"] == 3
    assert max_difference(result["straight"], result["resumed"]) == 0.0


@pytest.mark.ddp
def test_rows_longer_than_the_token_budget_are_split_by_the_group(trained):
    """``token_budget`` 10 below every row (about 14 tokens; one process refuses such a row): under sequence
    parallel 2 each row is a micro-batch of its own, split by the group, and the update equals the one-pass one."""
    budget, whole = trained("grpo_budget_step-sp"), trained("grpo_step-sp")
    assert budget["ulysses_calls"] > whole["ulysses_calls"]  # a split forward per row
    assert max_difference(budget["state"], whole["state"]) < 1e-5
    assert budget["history"] == pytest.approx(whole["history"], abs=1e-5)
