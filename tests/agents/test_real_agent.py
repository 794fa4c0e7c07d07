"""A real chat model (SmolLM2-135M-Instruct, tests marked ``real``) plays an agent's episode through the endpoint
and in process (a two-guess game): the recorded tokens are what the model's own chat template renders for the
conversation, and the two paths record the same episode."""

from __future__ import annotations

import pytest
import torch
from agent_fixtures import row_sequence

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from aitraining_pl.agents import AgentEnvironment  # noqa: E402
from aitraining_pl.environments.episode import AssistantTurn  # noqa: E402
from aitraining_pl.environments.episode_rollout import ChatFormat, sample_episodes  # noqa: E402
from aitraining_pl.environments.multiturn import GuessingGame  # noqa: E402
from aitraining_pl.models import load_causal_lm, load_tokenizer  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]

PROMPT = "I picked a whole number from 1 to 7. Guess it: reply with just the number."
SECRET = {"secret": 6}


def _replay(texts: list[str]) -> list[dict]:
    """The conversation of a guessing game whose assistant turns were ``texts``: the game's replies between them."""
    game, conversation = GuessingGame(max_turns=2), [{"role": "user", "content": PROMPT}]
    game.reset(PROMPT, SECRET)
    for i, text in enumerate(texts):
        conversation.append({"role": "assistant", "content": text})
        step = game.step(AssistantTurn(text=text, raw_text=text, token_ids=[], ended=True, index=i))
        conversation += step.messages if i < len(texts) - 1 else []
    return conversation


def guessing_agent(client, prompt, metadata):
    """The guessing game written with the ``openai`` client: two guesses, the game's answer between them."""
    messages, total = [{"role": "user", "content": prompt}], 0.0
    game = GuessingGame(max_turns=2)
    game.reset(prompt, metadata)
    for i in range(2):
        text = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        step = game.step(AssistantTurn(text=text, raw_text=text, token_ids=[], ended=True, index=i))
        messages += [{"role": "assistant", "content": text}, *step.messages]
        total += step.reward
        if step.done:
            break
    return total


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
    """A two-guess game (``GuessingGame``) played in process and by an agent through the endpoint, greedy: one
    sequence each, the same tokens, and those are the chat template's rendering of the conversation."""
    tokenizer = load_tokenizer(smollm2, padding_side="left")
    model = load_causal_lm(smollm2).eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=24, do_sample=False), end_token_ids=[end])
    prompt = ChatFormat(tokenizer, []).prompt_ids([{"role": "user", "content": PROMPT}])
    ids, mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
    local = sample_episodes(engine, model, GuessingGame(max_turns=2), [PROMPT], [SECRET], ids, mask, 1)
    endpoint = AgentEnvironment(guessing_agent, max_sequences=1)
    try:
        remote = endpoint.play_episodes(engine, model, [PROMPT], [SECRET], ids, mask, 1, timeout=300)
    finally:
        endpoint.close()
    tokens, sampled = row_sequence(remote, 0)
    assert (tokens, sampled) == row_sequence(local, 0)  # the endpoint records the in-process episode
    assert torch.equal(remote.episodes.returns, local.episodes.returns)
    turns = _segments(tokens, sampled)
    # a turn that ended carries the sampled <|im_end|>; one cut at max_new_tokens is closed by the template's
    texts = [tokenizer.decode(turn[:-1] if turn[-1] == end else turn) for turn in turns]
    rendered = tokenizer.apply_chat_template(_replay(texts), return_dict=True)["input_ids"]
    closing = "\n" if turns[-1][-1] == end else "<|im_end|>\n"  # what the template adds after the last turn
    assert rendered == tokens + tokenizer(closing, add_special_tokens=False)["input_ids"]
    print(f"real episode: {len(tokens)} tokens, {len(turns)} turns: {[tokenizer.decode(t) for t in turns]}")
