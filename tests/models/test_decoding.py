"""Decoding that drops ended rows (``generation.hf.decoding``): the same draws as ``generate`` while no row has ended,
the same greedy responses and stops, logits that are the model's own after rows are dropped, and ``generate``
for models without a plain KV cache, on a matrix of real architectures."""

from __future__ import annotations

import pytest
import torch
from architectures import HYBRID, MATRIX, names, spec
from transformers import StoppingCriteriaList

import aitraining_pl.generation.hf.decoding as decoding
from aitraining_pl.generation.backend import StopRule
from aitraining_pl.generation.hf.decoding import decode, sample_responses
from aitraining_pl.generation.hf.generate import ResponseStoppingCriteria, hf_generate, hf_generation_config
from aitraining_pl.models import build_causal_lm, load_tokenizer
from aitraining_pl.rollout import GenerationConfig, RolloutEngine

PLAIN = names(MATRIX, without=(HYBRID,))  # falcon_h1: a hybrid state-space cache
ENDS = [5, 9, 11, 13, 17, 19, 23, 29]  # frequent enough that rows end at different steps


def _model(model_type: str, scale: float = 1.0):
    model = build_causal_lm({"model_type": model_type, **spec(model_type)}, seed=0).eval()
    with torch.no_grad():  # sharper logits, so that greedy ties and near-ties are rare
        model.get_output_embeddings().weight.mul_(scale)
    return model


def _prompts(n: int = 6, width: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths."""
    ids = torch.randint(3, 90, (n, width), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[1, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _config(ends: list[int], do_sample: bool = True, max_new_tokens: int = 16):
    settings = GenerationConfig(
        max_new_tokens=max_new_tokens, temperature=0.8, top_k=12, top_p=0.9, do_sample=do_sample
    )
    return hf_generation_config(settings, ends, pad_token_id=0, with_logprobs=True)


def _seeded(fn, *args, seed: int = 1):
    torch.manual_seed(seed)
    return fn(*args)


@pytest.mark.parametrize("model_type", PLAIN)
def test_decode_draws_what_generate_draws_while_no_row_has_ended(model_type):
    """No end ids: nothing is dropped, so the same seed gives the same tokens, logits and warped scores."""
    model, (ids, mask) = _model(model_type), _prompts()
    want = _seeded(hf_generate, model, ids, mask, _config([]))
    got = _seeded(decode, model, ids, mask, _config([]))
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(got.scores, want.scores)


@pytest.mark.parametrize("model_type", PLAIN)
def test_greedy_decode_equals_generate_when_rows_end(model_type):
    """Greedy with end ids: rows end at different steps and are dropped; the responses (padded after the end)
    are generate's, and so are the logits of every step a row was decoded at."""
    model, (ids, mask) = _model(model_type, scale=4.0), _prompts()
    free = hf_generate(model, ids, mask, _config([], do_sample=False)).response_ids
    ends = sorted(set(free[[0, 3], 2].tolist()))  # rows 0 and 3 end by their third token
    config = _config(ends, do_sample=False)
    want, got = hf_generate(model, ids, mask, config), decode(model, ids, mask, config)
    assert torch.equal(got.response_ids, want.response_ids)
    ended = torch.isin(got.response_ids, torch.tensor(ends))
    decoded = (ended.cumsum(1) - ended.long()) == 0  # up to and including the end token
    assert len(set(decoded.sum(1).tolist())) >= 2, "rows must end at different steps"
    torch.testing.assert_close(got.logits[decoded], want.logits[decoded], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt2", "qwen2_moe", "phi"])
def test_after_rows_are_dropped_the_logits_are_the_models_own(model_type):
    """Sampled with frequent ends: the logits ``decode`` sampled each token from equal the full model's logits
    over prompt + response (so the cache rows, positions and mask stay right after every drop)."""
    model, (ids, mask) = _model(model_type), _prompts()
    out = _seeded(decode, model, ids, mask, _config(ENDS, max_new_tokens=24))
    lengths = []
    for row in range(ids.shape[0]):
        response = out.response_ids[row]
        hits = torch.isin(response, torch.tensor(ENDS)).nonzero()
        n = int(hits[0]) + 1 if len(hits) else response.shape[0]
        lengths.append(n)
        real = mask[row].bool()
        sequence = torch.cat([ids[row, real], response[:n]])[None]
        with torch.no_grad():
            logits = model(sequence).logits[0, int(real.sum()) - 1 : -1].float()
        torch.testing.assert_close(out.logits[row, :n], logits, atol=1e-4, rtol=1e-4)
    assert len(set(lengths)) > 2, "rows must end at different steps"


def test_ended_rows_leave_the_batch():
    """The decoder's batch shrinks as rows end: every row costs only its own tokens."""
    model, (ids, mask) = _model("llama"), _prompts(n=8)
    sizes = []
    model.model.register_forward_pre_hook(lambda m, a, k: sizes.append(k["input_ids"].shape[0]), with_kwargs=True)
    out = _seeded(decode, model, ids, mask, _config(ENDS, max_new_tokens=32))
    assert sizes[0] == 8 and sizes[-1] < 8 and sizes == sorted(sizes, reverse=True)
    ended = torch.isin(out.response_ids, torch.tensor(ENDS))
    steps = out.response_ids.shape[1]
    lengths = torch.where(ended.any(1), ended.long().argmax(1) + 1, steps)
    assert sum(sizes) == 8 + int((lengths - 1).sum())  # the prompts, then each row until its last token


def test_decoding_writes_the_cache_in_place(monkeypatch):
    """After the prefill each full-attention layer writes its new position into a preallocated buffer
    (``_PreallocatedLayer``): no step concatenates (``DynamicLayer.update``), also after rows are dropped."""
    model, (ids, mask) = _model("llama"), _prompts(n=8)
    calls = {"concatenated": 0, "in_place": 0}
    for cls, key in ((decoding.DynamicLayer, "concatenated"), (decoding._PreallocatedLayer, "in_place")):
        update = cls.update

        def counted(self, *args, _update=update, _key=key, _cls=cls, **kwargs):
            calls[_key] += type(self) is _cls
            return _update(self, *args, **kwargs)

        monkeypatch.setattr(cls, "update", counted)
    out = _seeded(decode, model, ids, mask, _config(ENDS, max_new_tokens=32))
    layers = model.config.num_hidden_layers
    assert calls["concatenated"] == layers  # the prompt
    assert calls["in_place"] == layers * (out.response_ids.shape[1] - 1) > 0


def test_stops_end_rows_as_in_generate(byte_tokenizer):
    """A stop string ends a row (greedy) exactly where generate's stopping criterion ends it; its later
    tokens are padding (``generate`` without end ids leaves them as sampled, for the mask to cut)."""
    model = build_causal_lm({"model_type": "llama", **spec("llama"), "vocab_size": 384}, seed=3).eval()
    enc = load_tokenizer("byte", padding_side="left")(["ab", "xyz q", "m"], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    free = hf_generate(model, ids, mask, _config([], do_sample=False, max_new_tokens=12)).response_ids
    stop = byte_tokenizer.decode(free[1, 3:5])  # a string the second row produces
    rule = StopRule(byte_tokenizer, [stop])
    config = _config([], do_sample=False, max_new_tokens=12)
    criteria = StoppingCriteriaList([ResponseStoppingCriteria(rule, ids.shape[1], [])])
    want = hf_generate(model, ids, mask, config, criteria).response_ids
    got = decode(model, ids, mask, config, rule).response_ids
    stops = rule.ends(want)
    assert stops.tolist()[1] == 4 and torch.equal(rule.ends(got), stops) and got.shape == want.shape
    upto = torch.arange(got.shape[1]) <= torch.where(stops >= 0, stops, got.shape[1])[:, None]
    assert torch.equal(got[upto], want[upto]) and (got[~upto] == 0).all()  # padding after the stop


def test_models_without_a_plain_cache_use_generate():
    """falcon_h1 keeps state-space layers in its cache: ``decode`` declines (and remembers), and the rollout
    engine's sampler gives generate's responses."""
    model, (ids, mask) = _model("falcon_h1"), _prompts(n=3)
    config = _config(ENDS)
    assert decode(model, ids, mask, config) is None
    assert model in decoding._UNSUPPORTED
    want = _seeded(hf_generate, model, ids, mask, config)
    got = _seeded(sample_responses, model, ids, mask, config)
    assert torch.equal(got.response_ids, want.response_ids)


def test_drop_ended_false_uses_generate(monkeypatch, byte_tokenizer, tiny_config):
    calls = []
    monkeypatch.setattr(decoding, "decode", lambda *a, **k: calls.append("decode"))
    real = decoding.hf_generate
    monkeypatch.setattr(decoding, "hf_generate", lambda *a, **k: calls.append("generate") or real(*a, **k))
    model = build_causal_lm(tiny_config, seed=0)
    ids, mask = torch.tensor([[70, 71]]), torch.ones(1, 2, dtype=torch.long)
    RolloutEngine(byte_tokenizer, GenerationConfig(max_new_tokens=3, drop_ended=False)).sample(model, ids, mask)
    RolloutEngine(byte_tokenizer, GenerationConfig(max_new_tokens=3)).sample(model, ids, mask)
    assert calls == ["generate", "decode", "generate"]  # the stub decode declines, so generate runs


def test_lora_policy_decodes_as_generate(tiny_config):
    """A peft-wrapped policy passes the cache through to the base model."""
    from aitraining_pl.models.lora import LoRAConfig, apply_lora

    model = apply_lora(build_causal_lm(tiny_config, seed=0), LoRAConfig(r=4)).eval()
    with torch.no_grad():  # adapters that change the outputs (lora_B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids, mask = _prompts(n=3)
    want = _seeded(hf_generate, model, ids, mask, _config([]))
    got = _seeded(decode, model, ids, mask, _config([]))
    assert torch.equal(got.response_ids, want.response_ids)


@pytest.mark.parametrize("model_type", PLAIN)
def test_samples_of_a_prompt_start_from_its_one_cache(model_type):
    """``num_samples`` = 3: each prompt runs through the model once and its cache is repeated; the draws are
    those of ``generate`` on the repeated prompts."""
    model, (ids, mask) = _model(model_type), _prompts(n=3)
    want = _seeded(hf_generate, model, ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0), _config([]))
    got = _seeded(decode, model, ids, mask, _config([]), None, 3)
    assert torch.equal(got.response_ids, want.response_ids)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)


def test_stop_strings_read_the_tokens_once_per_step_not_once_per_row(monkeypatch, byte_tokenizer):
    """Each host read of a tensor (``tolist``, ``item``, ``bool``) is a device sync on a GPU: with a stop string the
    decoder reads the step's tokens once for all rows, so 8 rows cost the reads of 2."""
    model = build_causal_lm({"model_type": "llama", **spec("llama"), "vocab_size": 384}, seed=3).eval()
    rule = StopRule(byte_tokenizer, ["a stop string no row reaches in 6 tokens"])
    config = _config([], do_sample=False, max_new_tokens=6)
    reads = {"n": 0}
    for name in ("tolist", "item", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _real=real: reads.update(n=reads["n"] + 1) or _real(self, *a)
        )
    counts = []
    for rows in (2, 8):
        ids, mask = _prompts(rows)
        reads["n"] = 0
        assert decode(model, ids, mask, config, rule).response_ids.shape == (rows, 6)
        counts.append(reads["n"])
    assert counts[0] == counts[1]
