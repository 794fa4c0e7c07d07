"""Shared by the agent tests (``tests/agents``) and the agent benchmark: the calculator's OpenAI tool schema, an
agent written with the ``openai`` client that plays the same conversation as an in-process ``ToolEnvironment``, a
tool environment that calls the calculator on its first turns whatever the model wrote (a random model writes no
calls), a scripted sampler (the "model" writes given texts, for tool calls and hand-checked masks), and the whole
token sequence of a rollout row."""

from __future__ import annotations

import json

import torch

import aitraining_pl.rollout as rollout_module
from aitraining_pl.environments.episode import AssistantTurn, EpisodeStep
from aitraining_pl.environments.multiturn import ToolEnvironment, calculator
from aitraining_pl.environments.tools import ToolCall, run_calls, tool_schemas

#: the calculator as an OpenAI ``tools`` entry
CALCULATOR_TOOL = {"type": "function", "function": tool_schemas([calculator])[0]["function"]}
#: where the samplers are looked up: the backend's (the endpoint) and the episode decoder's (``reprefill``)
SAMPLERS = (
    "aitraining_pl.generation.hf.backend.sample_responses",
    "aitraining_pl.generation.hf.episode_decoding.sample_responses",
)


def answer_length_reward(prompts, responses, metadata):
    """The reward of the final answer in the equality tests: its length."""
    return [float(len(r)) for r in responses]


class CalculatorTurns(ToolEnvironment):
    """A tool environment whose first ``forced`` turns each call ``calculator`` on ``"<turn> + <tokens>"`` whatever
    the model wrote; later turns are the ``ToolEnvironment``'s own (a call parsed from the text, or the answer)."""

    forced = 2

    def step(self, turn: AssistantTurn) -> EpisodeStep:
        if turn.index >= self.forced:
            return super().step(turn)
        call = ToolCall("calculator", {"expression": f"{turn.index} + {len(turn.token_ids)}"})
        messages, errors = run_calls([call], self.functions, self.tool_limits, self.tool_format)
        return EpisodeStep(messages, metrics={"tool_calls": 1.0, "tool_errors": float(errors)})


def calculator_agent(client, prompt, metadata, forced: int = 2, max_turns: int = 4):
    """The conversation of ``CalculatorTurns`` written with the ``openai`` client: the calculator tool offered; a
    reply's tool calls run and answered with ``tool`` messages (the first ``forced`` turns call it on
    ``"<turn> + <tokens>"`` whatever the model wrote); the first reply without a call is the answer, rewarded by
    its length."""
    messages = [{"role": "user", "content": prompt}]
    for turn in range(max_turns):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR_TOOL], logprobs=True
        ).choices[0]
        message = reply.message
        messages.append(message.model_dump(exclude_none=True))
        if turn < forced:
            tokens = len(reply.logprobs.content)
            messages.append({"role": "tool", "content": calculator(f"{turn} + {tokens}"), "tool_call_id": "abcdefghi"})
        elif message.tool_calls:
            for call in message.tool_calls:
                result = calculator(**json.loads(call.function.arguments))
                messages.append({"role": "tool", "content": result, "tool_call_id": call.id, "name": "calculator"})
        else:
            return answer_length_reward([prompt], [message.content or ""], [metadata])[0]
    return 0.0


def script_sampler(monkeypatch, tokenizer, write):
    """Make the policy "write" ``write(prompt_text) -> str`` (encoded, the chat's end token appended by the
    caller): every sampler call (the endpoint's and the in-process ``reprefill`` path) returns those tokens."""

    def sample(model, ids, mask, config, stop_rule=None, drop_ended=True, num_samples=1, record_routes=False):
        rows = []
        for row, m in zip(ids, mask):
            text = tokenizer.decode(row[m.bool()], skip_special_tokens=False)
            rows += [tokenizer(write(text), add_special_tokens=False)["input_ids"]] * num_samples
        width = max(map(len, rows))
        out = torch.full((len(rows), width), int(config.pad_token_id), dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r)
        return rollout_module.SampledTokens(out)

    for where in SAMPLERS:
        monkeypatch.setattr(where, sample)


def row_sequence(rollout, r: int) -> tuple[list[int], list[int]]:
    """Row ``r``'s real tokens (prompt and after) and which of them the model sampled."""
    prompt = rollout.prompt_ids[r][rollout.prompt_mask[r].bool()].tolist()
    attention = rollout.episodes.response_attention[r].bool()
    tokens = rollout.response_ids[r][attention].tolist()
    return prompt + tokens, [0] * len(prompt) + rollout.response_mask[r][attention].tolist()
