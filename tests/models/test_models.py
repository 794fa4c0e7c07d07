"""Model loading, LoRA, the reference policy and the value head."""

from __future__ import annotations

import pytest
import torch

from aitraining_pl.models import (
    LoRAConfig,
    PPOModel,
    ReferencePolicy,
    ValueHead,
    build_causal_lm,
    load_causal_lm,
    load_policy,
    load_tokenizer,
    with_padding_side,
)


def _ids(seed=0, shape=(2, 12)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, shape, generator=g)


def test_inline_config_is_seeded_and_deterministic(tiny_config):
    a, b = build_causal_lm(tiny_config, seed=3), build_causal_lm(tiny_config, seed=3)
    c = build_causal_lm(tiny_config, seed=4)
    state_a, state_b, state_c = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)
    # the caller's RNG stream is not consumed
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    build_causal_lm(tiny_config)
    assert torch.equal(torch.rand(1), expected)


def test_saved_and_reloaded_model_gives_identical_logits(tiny_config, byte_tokenizer, tmp_path):
    model = load_causal_lm(model_config=tiny_config).eval()
    model.save_pretrained(tmp_path)
    byte_tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    reloaded = load_causal_lm(str(tmp_path)).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reloaded(ids).logits, rtol=0, atol=0)
    tok = load_tokenizer(str(tmp_path))
    assert (
        tok("abc", add_special_tokens=False)["input_ids"]
        == byte_tokenizer("abc", add_special_tokens=False)["input_ids"]
    )
    half = load_causal_lm(str(tmp_path), dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_model_source_errors(tiny_config):
    with pytest.raises(ValueError, match="exactly one"):
        load_causal_lm()
    with pytest.raises(ValueError, match="exactly one"):
        load_causal_lm("x", tiny_config)
    with pytest.raises(ValueError, match="model_type"):
        build_causal_lm({"hidden_size": 8})
    with pytest.raises(ValueError, match="known"):
        load_causal_lm(model_config=tiny_config, dtype="float8")


def test_byte_tokenizer_padding_and_side_copies():
    tok = load_tokenizer("byte")
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1 and tok.padding_side == "right"
    left = with_padding_side(tok, "left")
    assert left.padding_side == "left" and tok.padding_side == "right"
    batch = left(["a", "abcd"], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0][:3] == [0, 0, 0]
    assert with_padding_side(tok, "right") is tok


def test_missing_pad_token_is_set(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2, "<unk>": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token == "</s>"


def test_lora_reference_equals_base_while_policy_moves(tiny_config):
    base = load_causal_lm(model_config=tiny_config).eval()
    policy, reference = load_policy(model_config=tiny_config, lora=LoRAConfig(r=4, alpha=8, dropout=0.0))
    assert reference.shares_weights
    ids = _ids()
    with torch.no_grad():
        base_logits = base(ids).logits
    torch.testing.assert_close(reference(ids), base_logits)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n, p in policy.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    for _ in range(2):  # LoRA B starts at zero, so the first step only moves B
        policy(ids).logits.logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    policy.eval()
    with torch.no_grad():
        assert not torch.allclose(policy(ids).logits, base_logits)
    torch.testing.assert_close(reference(ids), base_logits)


def test_frozen_reference_is_built_from_source_and_kept_out_of_state_dict(tiny_config):
    policy, reference = load_policy(model_config=tiny_config)
    assert not reference.shares_weights
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)  # a "trained" or resumed policy
    fresh, _ = load_policy(model_config=tiny_config, with_reference=False)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(reference(ids), fresh.eval()(ids).logits)
    assert all(not p.requires_grad for p in reference.model.parameters())

    class Owner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.policy = policy
            self.reference = reference

    owner = Owner()
    assert set(owner.state_dict()) == {f"policy.{k}" for k in policy.state_dict()}
    assert sum(1 for _ in owner.parameters()) == sum(1 for _ in policy.parameters())
    reference.drop()
    with pytest.raises(RuntimeError, match="released"):
        reference(ids)


def test_reference_needs_a_source_without_lora(tiny_config):
    with pytest.raises(ValueError, match="build_reference"):
        ReferencePolicy(load_causal_lm(model_config=tiny_config))


def test_value_head_and_ppo_model(tiny_config):
    head = ValueHead(32)
    assert head(torch.randn(2, 5, 32)).shape == (2, 5)
    assert torch.count_nonzero(head(torch.randn(2, 5, 32))) == 0  # zero-initialised output
    model = PPOModel(load_causal_lm(model_config=tiny_config))
    ids = _ids()
    out = model(ids, torch.ones_like(ids))
    assert out.logits.shape == (2, 12, 384) and out.values.shape == (2, 12)
    (out.values.sum() + out.logits.mean()).backward()
    assert model.value_head.net[-1].weight.grad is not None
    critic = PPOModel(load_causal_lm(model_config=tiny_config), critic=load_causal_lm(model_config=tiny_config, seed=1))
    out = critic(ids)
    assert out.values.shape == (2, 12)
    generated = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 7)


def test_is_peft_model_does_not_import_peft(tiny_config):
    """A run without LoRA never imports ``peft`` to ask (it loads ``torch._dynamo`` and ``bitsandbytes``: about
    60 MB); a peft model is still recognised."""
    import subprocess
    import sys

    code = (
        "import sys, torch; from aitraining_pl.models.lora import is_peft_model; "
        "assert not is_peft_model(torch.nn.Linear(2, 2)); print('peft' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]
    from aitraining_pl.models import is_peft_model

    policy, _ = load_policy(model_config=tiny_config, lora=LoRAConfig(r=2))
    assert is_peft_model(policy)
