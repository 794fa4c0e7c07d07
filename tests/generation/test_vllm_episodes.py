"""Multi-turn episodes on the vLLM backend: each turn sends every unfinished episode's whole token sequence to vLLM
as ``prompt_token_ids`` (its prefix cache keeps the earlier turns). Greedy episodes equal the HF backend's (tokens,
masks, rewards) on the guessing game and on a tool environment, the rollout carries vLLM's log-probs of the sampled
tokens, and a short GRPO run on the game with ``backend: vllm`` trains. Skipped where vLLM is not installed."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from architectures import sharpen  # noqa: E402
from chat_templates import template_tokenizer  # noqa: E402
from episode_fixtures import SECRETS, assert_same_episodes, fit_on_the_game, held_out_success, prompt_tensors  # noqa: E402
from vllm_fixtures import vllm_spec  # noqa: E402

from aitraining_pl.environments.episode import AssistantTurn, EpisodeStep  # noqa: E402
from aitraining_pl.environments.episode_rollout import sample_episodes  # noqa: E402
from aitraining_pl.environments.multiturn import GuessingGame, ToolEnvironment, calculator  # noqa: E402
from aitraining_pl.environments.tools import ToolCall, run_calls  # noqa: E402
from aitraining_pl.generation.config import VLLMConfig  # noqa: E402
from aitraining_pl.generation.vllm import VLLMEngine  # noqa: E402
from aitraining_pl.models import build_causal_lm, load_tokenizer  # noqa: E402
from aitraining_pl.models.rollout_scoring import response_logps  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

pytestmark = pytest.mark.vllm
#: the vLLM-servable tiny llama (two heads of 32) with room for whole episodes
LLAMA = {**vllm_spec("llama"), "max_position_embeddings": 2048}


class CalculatorTurns(ToolEnvironment):
    """A tool environment whose first two turns each call ``calculator`` (a random model writes no calls), run by
    the tool runner and answered with ``tool`` messages; the third turn is the answer."""

    def step(self, turn: AssistantTurn) -> EpisodeStep:
        if turn.index >= 2:
            return super().step(turn)
        call = ToolCall("calculator", {"expression": f"{turn.index} + {len(turn.token_ids)}"})
        messages, errors = run_calls([call], self.functions, self.tool_limits, self.tool_format)
        return EpisodeStep(messages, metrics={"tool_calls": 1.0, "tool_errors": float(errors)})


def _both_backends(tokenizer, environment, samples: int):
    model = sharpen(build_causal_lm({**LLAMA, "vocab_size": len(tokenizer)}, seed=0), 4.0).eval()
    texts = ["Guess 1-7:", "Go", "Guess a digit!"]
    ids, mask = prompt_tensors(tokenizer, texts)
    generation = GenerationConfig(max_new_tokens=6, do_sample=False)
    hf = sample_episodes(RolloutEngine(tokenizer, generation), model, environment, texts, SECRETS, ids, mask, samples)
    vllm = VLLMEngine(model, tokenizer, VLLMConfig(), max_length=2048)
    try:
        vllm.sync(model)
        engine = RolloutEngine(tokenizer, generation, backend=vllm)
        got = sample_episodes(engine, model, environment, texts, SECRETS, ids, mask, samples)
    finally:
        vllm.close()
    return model, hf, got


def _assert_vllm_logprobs(model, got):
    """vLLM's log-probs of the sampled tokens: the trainer's (float32 noise) on the model's tokens, 0 on the
    environment's."""
    mask = got.response_mask.bool()
    assert got.sampling_logprobs is not None and (got.sampling_logprobs[~mask] == 0).all()
    trainer = response_logps(model, got.input_ids, got.attention_mask, got.prompt_ids.shape[1]).logprobs
    assert (trainer - got.sampling_logprobs)[mask].abs().max() < 1e-3


def test_greedy_guessing_game_episodes_equal_the_hf_backend():
    tokenizer = load_tokenizer("byte", padding_side="left")
    model, hf, got = _both_backends(tokenizer, GuessingGame(max_turns=4), samples=2)
    assert max(hf.episodes.metrics["turns"]) >= 3  # several turns, with holes in the mask
    assert ((hf.episodes.response_attention == 1) & (hf.response_mask == 0)).any()
    assert_same_episodes(hf, got)
    _assert_vllm_logprobs(model, got)
    print("guessing game, tokens prefilled per turn: hf", hf.episodes.prefilled, "vllm", got.episodes.prefilled)


def test_greedy_tool_episodes_equal_the_hf_backend():
    tokenizer, _ = template_tokenizer("qwen2.5")
    tokenizer.padding_side = "left"
    env = CalculatorTurns([calculator], reward=lambda p, r, m: [float(len(x)) for x in r], max_turns=4)
    model, hf, got = _both_backends(tokenizer, env, samples=1)
    assert hf.episodes.metrics["tool_calls"] == [2.0] * 3 and hf.episodes.metrics["turns"] == [3.0] * 3
    assert "<tool_response>" in tokenizer.decode(hf.response_ids[0])  # the tool messages, rendered by the template
    assert_same_episodes(hf, got)
    _assert_vllm_logprobs(model, got)
    # vLLM's prefix cache (whole blocks: 128 tokens on a CPU) holds the prompts' shared tool list: less prefilled
    print("tool episodes, tokens prefilled per turn: hf", hf.episodes.prefilled, "vllm", got.episodes.prefilled)
    assert got.episodes.prefilled[0] < hf.episodes.prefilled[0]


@pytest.mark.slow
def test_grpo_on_the_guessing_game_trains_with_the_vllm_backend(tmp_path):
    """GRPO with ``backend: vllm`` plays the game's episodes on vLLM: the engine's log-probs equal the trainer's at
    every rollout (weights synced after each iteration) and held-out success rises."""
    import lightning.pytorch as pl

    from aitraining_pl.modules.critic_free import GRPOModule

    class Gaps(pl.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            gaps.append(float(trainer.callback_metrics["train/sampling/logp_gap/max"]))

    torch.manual_seed(0)
    gaps: list[float] = []
    module = GRPOModule(
        model_config=dict(LLAMA),
        tokenizer_name="byte",
        reward=GuessingGame(max_turns=3),
        generation=GenerationConfig(max_new_tokens=2, temperature=1.0, backend="vllm"),
        num_generations=8,
        learning_rate=0.01,
        mini_batch_size=32,
        kl_coef=0.0,
        seed=0,
    )
    before = held_out_success(module)
    fit_on_the_game(module, tmp_path, epochs=2, callbacks=[Gaps()])
    after = held_out_success(module)
    print("GRPO on vLLM, held-out success:", before, "->", after, "logp gaps:", max(gaps))
    assert len(gaps) == 16 and max(gaps) < 1e-3, gaps
    assert after >= before + 0.07, (before, after)
