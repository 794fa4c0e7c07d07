"""The helpers shared across layers: BOS prepending, positions from a mask, eval mode with restore, model
presets, and the renamed length rewards."""

from __future__ import annotations

import pytest
import torch

from aitraining_pl.losses import positions_from_mask
from aitraining_pl.models import MODEL_PRESETS, build_causal_lm, resolve_model_config
from aitraining_pl.models.tokens import with_bos
from aitraining_pl.models.training import eval_mode


class _Tok:
    """A stand-in tokenizer: ``bos`` its declared BOS token; ``adds`` whether it puts it first itself when it encodes
    with special tokens (Llama 3 does; SmolLM2 declares one and never adds it)."""

    def __init__(self, bos, adds=True):
        self.bos_token_id, self.eos_token_id, self.pad_token_id, self.adds = bos, 1, 0, adds

    def __call__(self, text, add_special_tokens=True):
        first = [self.bos_token_id] if add_special_tokens and self.adds and self.bos_token_id is not None else []
        return {"input_ids": first + [ord(c) for c in text]}


def test_with_bos_prepends_once_and_only_when_the_tokenizer_adds_it():
    assert with_bos([5, 6], _Tok(2)) == [2, 5, 6]
    assert with_bos([2, 5, 6], _Tok(2)) == [2, 5, 6]  # a template that writes BOS itself
    assert with_bos([], _Tok(2)) == [2]
    assert with_bos([5, 6], _Tok(2, adds=False)) == [5, 6]  # declared but never added (SmolLM2)
    assert with_bos([5, 6], _Tok(None)) == [5, 6]
    assert with_bos((5,), object()) == [5]  # no bos_token_id attribute at all


@pytest.mark.parametrize("adds", [True, False], ids=["adds-bos", "declares-bos-only"])
def test_the_data_modules_and_the_reward_encoder_lay_out_bos_alike(byte_tokenizer, adds):
    from aitraining_pl.datamodules.prompt import PromptDataset
    from aitraining_pl.models.reward import encode_for_reward

    tok, first = _Tok(2, adds=adds), [2] if adds else []
    assert PromptDataset(["ab"], tok).input_ids == [first + [97, 98]]
    assert encode_for_reward(tok, "ab") == first + [97, 98, 1]
    assert encode_for_reward(byte_tokenizer, "ab") == byte_tokenizer("ab", add_special_tokens=False)["input_ids"] + [1]


def test_one_position_helper():
    from aitraining_pl import rollout

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]
    assert not hasattr(rollout, "position_ids_from_mask")  # one name (issue 25)


def test_eval_mode_restores_each_submodules_own_mode(tiny_config):
    model = build_causal_lm(tiny_config)
    model.train()
    model.model.layers[0].eval()  # a mixed state, e.g. a frozen block
    before = {name: m.training for name, m in model.named_modules()}
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert {name: m.training for name, m in model.named_modules()} == before


def test_the_tiny_llama_preset_builds_and_takes_overrides():
    config = resolve_model_config("tiny-llama")
    assert config == MODEL_PRESETS["tiny-llama"] and config is not MODEL_PRESETS["tiny-llama"]
    assert resolve_model_config({"preset": "tiny-llama", "num_hidden_layers": 1})["num_hidden_layers"] == 1
    assert resolve_model_config({"model_type": "llama", "hidden_size": 8}) == {"model_type": "llama", "hidden_size": 8}
    model = build_causal_lm("tiny-llama")
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2 and model.config.vocab_size == 384
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 150_000  # "about 0.12M parameters" (docs/cli.md)
    with pytest.raises(ValueError, match="unknown model preset 'huge'; must be one of tiny-llama"):
        resolve_model_config("huge")


def test_a_module_accepts_a_preset():
    from aitraining_pl import DPOModule

    module = DPOModule(model_config={"preset": "tiny-llama"}, tokenizer_name="byte")
    policy, reference = module.load_policy_from_hparams(with_reference=True)
    assert policy.config.hidden_size == 64 and reference.model.config.hidden_size == 64


def test_the_two_length_rewards_have_distinct_names_and_the_old_ones_warn():
    from aitraining_pl import environments, rewards

    assert rewards.char_length_reward(["p"], ["x" * 50], [{}]) == [0.5]
    assert environments.word_count_reward("p", "one two", "") == pytest.approx(2 / 50)
    with pytest.warns(DeprecationWarning, match="use aitraining_pl.rewards.char_length_reward"):
        assert rewards.length_reward is rewards.char_length_reward
    with pytest.warns(DeprecationWarning, match="use aitraining_pl.environments.word_count_reward"):
        assert environments.length_reward is environments.word_count_reward


def test_padded_stacks_rows_on_either_side_with_their_mask():
    """``models.tokens.padded``: the one padding of variable-length rows (prompts left, responses right)."""
    from aitraining_pl.models.tokens import padded

    ids, mask = padded([[1, 2, 3], [4], []], 0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    ids, mask = padded([torch.tensor([1, 2]), torch.tensor([3])], 9, "left", width=3)
    assert ids.tolist() == [[9, 1, 2], [9, 9, 3]] and mask.tolist() == [[0, 1, 1], [0, 0, 1]]
    values, _ = padded([[0.5], []], 0.0, width=1, dtype=torch.float32)
    assert values.dtype == torch.float32 and values.tolist() == [[0.5], [0.0]]
    with pytest.raises(ValueError, match="side must be 'right' or 'left'"):
        padded([[1]], 0, "middle")
