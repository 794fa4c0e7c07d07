"""The agent endpoint's overhead: the same tool episodes played by an agent through the OpenAI-compatible endpoint
(``AgentEnvironment``, the ``openai`` client over loopback HTTP) and in-process (``sample_episodes`` on a
``ToolEnvironment``), on the same randomly initialised Llama (``3m`` or ``25m``, byte-level tokenizer, the compact
tool template of the agent quickstart).

    python benchmarks/agent_endpoint.py --sizes 25m --episodes 8 --max-new-tokens 32 --rounds 3 --threads 1

Each episode is three calls: the model's first two turns are each answered with a calculator result (run by the
tool worker on both sides, whatever the model wrote: a random model writes no calls), the third is the answer.
Greedy decoding, so every mode plays the same tokens (``same_tokens``). Episodes run one at a time (one agent
thread; ``max_concurrency: 1``, a batch of one in process), so the figure is the cost per episode, not batching.
Modes, alternated round by round so that all see the same machine load: ``endpoint``, ``in_process_reprefill``
(each turn prefills the whole history, as the endpoint's calls do) and ``in_process_kv_cache`` (the default: the KV
cache kept across turns). One JSON line per mode and size after the header: ``seconds`` (median over the rounds
after the first, a warm-up), ``episodes_per_s``, ``cpu_seconds``, and on the endpoint's line ``overhead`` (its
seconds over each in-process mode's, minus 1) and ``overhead_per_call_ms`` (the extra milliseconds per call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _common import print_header
from dpo_vs_trl import SIZES, _model_config

from aitraining_pl.agents import AgentEnvironment
from aitraining_pl.data.calculator_agent import COMPACT_TOOL_TEMPLATE, TOOLS
from aitraining_pl.environments.episode import AssistantTurn, EpisodeStep
from aitraining_pl.environments.episode_rollout import sample_episodes
from aitraining_pl.environments.multiturn import ToolEnvironment, calculator
from aitraining_pl.environments.tools import ToolCall, ToolLimits, run_calls
from aitraining_pl.models import build_causal_lm, load_tokenizer
from aitraining_pl.rollout import GenerationConfig, RolloutEngine

MODES = ("endpoint", "in_process_reprefill", "in_process_kv_cache")
CALLS = 3


def _answer_length(prompts, responses, metadata):
    return [float(len(r)) for r in responses]


class ForcedCalculator(ToolEnvironment):
    """The in-process side: turns 0 and 1 are answered with ``calculator("<turn> + <tokens>")``, turn 2 ends."""

    def step(self, turn: AssistantTurn) -> EpisodeStep:
        if turn.index + 1 >= CALLS:
            return EpisodeStep(done=True, reward=float(len(turn.text)))
        call = ToolCall("calculator", {"expression": f"{turn.index} + {len(turn.token_ids)}"})
        messages, _ = run_calls([call], self.functions, self.tool_limits, self.tool_format)
        return EpisodeStep(messages)


def forced_calculator_agent(client, prompt, metadata):
    """The endpoint's side, written with the ``openai`` client: the same three calls and tool results."""
    messages = [{"role": "user", "content": prompt}]
    for turn in range(CALLS):
        choice = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, logprobs=True)
        message = choice.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if turn + 1 < CALLS:
            call = ToolCall("calculator", {"expression": f"{turn} + {len(choice.choices[0].logprobs.content)}"})
            (tool,), _ = run_calls([call], {"calculator": calculator}, ToolLimits(), "hermes")
            messages.append({"role": "tool", "content": tool["content"], "tool_call_id": tool["tool_call_id"]})
    return float(len(message.content or ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["25m"], choices=list(SIZES))
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode; the first is a warm-up")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print_header(args.threads)
    tokenizer = load_tokenizer("byte", padding_side="left")
    tokenizer.chat_template = COMPACT_TOOL_TEMPLATE
    prompts = [f"Episode {i}: what is {i} + {i + 1}?" for i in range(args.episodes)]
    ids = [tokenizer(p, add_special_tokens=False, return_tensors="pt")["input_ids"] for p in prompts]
    engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False))
    environment = ForcedCalculator([calculator], reward=_answer_length, max_turns=CALLS, max_total_tokens=1 << 20)
    agents = AgentEnvironment(forced_calculator_agent, max_sequences=1, max_concurrency=1)

    def play(mode: str, model):
        if mode == "endpoint":  # one call of play_episodes: the agent threads run one episode at a time
            batch_ids = torch.nn.utils.rnn.pad_sequence([i[0] for i in ids], batch_first=True, padding_side="left")
            mask = torch.nn.utils.rnn.pad_sequence(
                [torch.ones_like(i[0]) for i in ids], batch_first=True, padding_side="left"
            )
            return [agents.play_episodes(engine, model, prompts, [{}] * len(prompts), batch_ids, mask, 1, timeout=None)]
        reprefill = mode == "in_process_reprefill"
        return [
            sample_episodes(engine, model, environment, [p], [{}], i, torch.ones_like(i), 1, reprefill=reprefill)
            for p, i in zip(prompts, ids)
        ]

    try:
        for size in args.sizes:
            model = build_causal_lm(_model_config(size), seed=0).eval()
            seconds, cpu, outs = {m: [] for m in MODES}, {m: [] for m in MODES}, {}
            for round_ in range(args.rounds):
                for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                    start, clock = time.perf_counter(), time.process_time()
                    outs[mode] = play(mode, model)
                    seconds[mode].append(time.perf_counter() - start)
                    cpu[mode].append(time.process_time() - clock)
            texts = {m: [t for out in outs[m] for t in out.texts] for m in MODES}
            lines = {}
            for mode in MODES:
                median = statistics.median(seconds[mode][1:] or seconds[mode])
                lines[mode] = {
                    "size": size,
                    "mode": mode,
                    "episodes": args.episodes,
                    "calls_per_episode": CALLS,
                    "max_new_tokens": args.max_new_tokens,
                    "rounds": len(seconds[mode]) - 1,
                    "seconds": median,
                    "seconds_all": [round(x, 3) for x in seconds[mode]],
                    "cpu_seconds": statistics.median(cpu[mode][1:] or cpu[mode]),
                    "episodes_per_s": args.episodes / median,
                }
            remote = lines["endpoint"]
            remote["same_tokens"] = texts["endpoint"] == texts["in_process_reprefill"] == texts["in_process_kv_cache"]
            calls = args.episodes * CALLS
            for mode in MODES[1:]:
                local = lines[mode]["seconds"]
                remote[f"overhead_vs_{mode}"] = remote["seconds"] / local - 1
                remote[f"overhead_per_call_ms_vs_{mode}"] = 1000 * (remote["seconds"] - local) / calls
            for mode in MODES:
                print(json.dumps(lines[mode]), flush=True)
    finally:
        agents.close()


if __name__ == "__main__":
    main()
