"""A real chat model (SmolLM2-135M-Instruct, tests marked ``real``) plays an agent's episode through the endpoint
and in process: the recorded tokens are what the model's own chat template renders for the conversation, and the
two paths record the same episode."""

from __future__ import annotations

import pytest
import torch
from agent_fixtures import CalculatorTurns, answer_length_reward, calculator_agent, row_sequence

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from aitraining_pl.agents import AgentEnvironment  # noqa: E402
from aitraining_pl.environments.episode_rollout import ChatFormat, sample_episodes  # noqa: E402
from aitraining_pl.environments.multiturn import calculator  # noqa: E402
from aitraining_pl.models import load_causal_lm, load_tokenizer  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]

PROMPT = "What is 6 + 7? Reply with just the number."


def _segments(tokens: list[int], sampled: list[int]) -> list[list[int]]:
    """The runs of sampled tokens in a row (one per assistant turn)."""
    runs: list[list[int]] = []
    for i, (token, s) in enumerate(zip(tokens, sampled)):
        if s and (i == 0 or not sampled[i - 1]):
            runs.append([])
        if s:
            runs[-1].append(token)
    return runs


def test_a_real_chat_models_episode_is_what_its_template_renders(smollm2):
    tokenizer = load_tokenizer(smollm2, padding_side="left")
    model = load_causal_lm(smollm2).eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=12, do_sample=False), end_token_ids=[end])
    prompt = ChatFormat(tokenizer, []).prompt_ids([{"role": "user", "content": PROMPT}])
    ids, mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
    # two assistant turns with a tool message between them (the calculator run on "0 + <tokens of turn 1>")
    environment = CalculatorTurns([calculator], reward=answer_length_reward, max_turns=2)
    environment.forced = 1
    local = sample_episodes(engine, model, environment, [PROMPT], [{}], ids, mask, 1)
    endpoint = AgentEnvironment(lambda c, p, m: calculator_agent(c, p, m, forced=1, max_turns=2), max_sequences=1)
    try:
        remote = endpoint.play_episodes(engine, model, [PROMPT], [{}], ids, mask, 1, timeout=300)
    finally:
        endpoint.close()
    tokens, sampled = row_sequence(remote, 0)
    assert (tokens, sampled) == row_sequence(local, 0)  # the endpoint records the in-process episode
    first, second = _segments(tokens, sampled)
    assert first[-1] == end and second[-1] == end  # each turn ended at the template's <|im_end|>
    conversation = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": tokenizer.decode(first[:-1])},
        {"role": "tool", "content": calculator(f"0 + {len(first)}")},
        {"role": "assistant", "content": tokenizer.decode(second[:-1])},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
    # the template closes the last turn with "<|im_end|>\n"; the episode stops at the sampled <|im_end|>
    assert rendered == tokens + tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert remote.texts == local.texts
    print(f"real episode: {len(tokens)} tokens; turns {tokenizer.decode(first)!r} / {tokenizer.decode(second)!r}")
