"""Scoring through the chunked head (``models.lm_head``): equal to the model's own forward on an architecture
matrix, LoRA on the head, and one DPO step that saves no (tokens x vocabulary) tensor for backward."""

from __future__ import annotations

import pytest
import torch
from architectures import HEAD, model_config, names
from conftest import TINY_LLAMA, saved_for_backward
from transformers import AutoConfig

from aitraining_pl.losses import sequence_logps
from aitraining_pl.models import LoRAConfig, apply_lora, build_causal_lm
from aitraining_pl.models.lm_head import (
    chunked_head_logps,
    head_parameters,
    logit_postprocessing,
)
from aitraining_pl.models.scoring import (
    _decoder_and_head,
    completion_logps,
    scoring_path,
)
from aitraining_pl.modules.dpo import DPOModule

BATCH = {  # pair: prompt [5, 6], chosen [7, 1], rejected [8, 9, 1]; pair: prompt [4], chosen [3], rejected [2]
    "input_ids": torch.tensor([[5, 6, 7, 1, 0], [4, 3, 0, 0, 0], [5, 6, 8, 9, 1], [4, 2, 0, 0, 0]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]),
    "completion_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]),
}


def _own_forward(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return sequence_logps(logits, batch["input_ids"], batch["completion_mask"]).logps


def _grads(model, logps):
    model.zero_grad()
    logps.sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.requires_grad and p.grad is not None]


@pytest.mark.parametrize("arch", names(HEAD))  # each post-processing of the head's output
def test_fused_head_equals_the_models_own_forward(arch):
    model = build_causal_lm(model_config(arch), seed=0)
    assert head_parameters(model.get_output_embeddings()) is not None
    _, head, config = _decoder_and_head(model)
    assert scoring_path(model).head  # the decoder + head path, which runs chunked for this head and config:
    assert chunked_head_logps(head, config, torch.zeros(3, config.hidden_size), torch.zeros(3, dtype=torch.long))
    fast, slow = completion_logps(model, BATCH).logps, _own_forward(model, BATCH)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    for got, want in zip(
        _grads(model, completion_logps(model, BATCH).logps), _grads(model, _own_forward(model, BATCH))
    ):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if arch == "gemma2_softcap":  # the cap is active: without it the log-probs differ
        logits = model(input_ids=BATCH["input_ids"]).logits
        assert logits.abs().max() > 0.5 * 0.05


def test_logit_postprocessing_from_config():
    def config(**kw):
        return AutoConfig.for_model(**kw)

    assert logit_postprocessing(config(model_type="granite", logits_scaling=4.0)) == (0.25, None)
    assert logit_postprocessing(config(model_type="cohere", logit_scale=0.0625)) == (0.0625, None)
    assert logit_postprocessing(config(model_type="falcon_h1", lm_head_multiplier=2.5))[0] == 2.5
    assert logit_postprocessing(config(model_type="gemma2", final_logit_softcapping=30.0)) == (1.0, 30.0)
    assert logit_postprocessing(config(model_type="llama")) == (1.0, None)
    unknown = config(model_type="llama")
    unknown.output_multiplier = 2.0  # a scale this project does not know: the model's own forward runs
    assert logit_postprocessing(unknown) is None
    model = build_causal_lm(TINY_LLAMA, seed=0)
    model.config.output_multiplier = 2.0
    hidden, targets = torch.zeros(3, 32), torch.zeros(3, dtype=torch.long)
    assert chunked_head_logps(model.get_output_embeddings(), model.config, hidden, targets) is None


def test_lora_on_the_head_merges_and_trains():
    model = apply_lora(
        build_causal_lm(TINY_LLAMA, seed=0), LoRAConfig(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "lm_head"])
    )
    head = model.get_base_model().get_output_embeddings()
    with torch.no_grad():  # peft starts B at zero: make the adapter change the logits
        head.lora_B["default"].weight.normal_(0, 0.5)
    weight, _ = head_parameters(head)
    assert not weight.is_leaf
    fast, slow = completion_logps(model, BATCH).logps, _own_forward(model, BATCH)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    grads, want = _grads(model, completion_logps(model, BATCH).logps), _grads(model, _own_forward(model, BATCH))
    assert len(grads) == len(want) == 6  # A and B of q_proj in 2 layers and of lm_head
    assert head.lora_A["default"].weight.grad.abs().sum() > 0  # the head's adapter trains
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    with model.disable_adapter():
        assert head_parameters(head)[0] is head.base_layer.weight
        torch.testing.assert_close(completion_logps(model, BATCH).logps, _own_forward(model, BATCH))
    dropped = apply_lora(
        build_causal_lm(TINY_LLAMA, seed=0), LoRAConfig(r=4, alpha=8, dropout=0.1, target_modules=["lm_head"])
    )
    assert head_parameters(dropped.get_base_model().get_output_embeddings()) is None  # training dropout: own forward


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_dpo_step_saves_no_vocabulary_sized_tensor(layout):
    """Structural memory test (times nothing): one DPOModule training step (forward + backward) at a 32,000-token
    vocabulary; the only saved-for-backward tensors with a vocabulary-sized dimension are parameters."""
    vocab = 32000
    flags = {} if layout == "packed" else {"padding_free": False, "share_prompt": False}
    module = DPOModule(model_config={**TINY_LLAMA, "vocab_size": vocab}, tokenizer_name="byte", **flags)
    saved = saved_for_backward(module, lambda: module.shared_step(BATCH, "train"))
    assert module.policy.get_output_embeddings().weight.grad.abs().sum() > 0
    assert [shape for shape in saved if vocab in shape] == []
