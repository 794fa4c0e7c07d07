"""Multi-turn episodes: the KV cache kept across turns against re-prefilling the whole history every turn (what a
loop around ``generate`` does), on the same randomly initialised Llama (``3m`` or ``25m``, byte-level tokenizer).

    python benchmarks/multiturn.py --sizes 25m --episodes 16 --max-new-tokens 32 --rounds 3 --threads 2

Each episode plays 3 to 5 turns (its ``turns`` metadata, cycling 3, 4, 5); after each turn but the last the
environment answers with a user message of ``--reply-chars`` characters (40; a tool's output is often hundreds),
rendered by the fallback chat template. The
random model rarely samples its end token, so turns mostly run to ``--max-new-tokens``. Both modes draw the same
tokens from the same seed (``generation.hf.episode_decoding``), so they do the same episodes.

Both modes run on the same model, alternated round by round (re-prefill first in even rounds, the kept cache
first in odd ones) so that both see the same machine load. Prints one JSON line per mode and size (after a header
line): ``seconds`` (median over the rounds after the first, a warm-up; ``seconds_all`` lists them),
``episodes_per_s``, ``split_s`` (mean seconds per batch of episodes in the model's decoding steps, one new token
per row, in its prefill passes, and in everything else: parking and merging caches, sampling, the environment),
``prefilled_per_turn`` (real tokens run through the model as prefill before each turn, summed over the batch),
``episode_tokens`` (prompt and response tokens of the batch), ``model_tokens_over_episode_tokens`` (prefilled plus
decoding steps, over ``episode_tokens``: 1.0 means every token of the episodes went through the model once) and, on
the ``kv_cache`` line, ``speedup`` (median seconds of ``reprefill`` over those of ``kv_cache``). ``cpu_seconds`` and
``speedup_cpu``: the same from the process's CPU time, steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
from _common import Split, print_header
from dpo_vs_trl import SIZES, _model_config

from aitraining_pl.environments.episode import EpisodeEnvironment, EpisodeLimits, EpisodeStep
from aitraining_pl.environments.episode_rollout import sample_episodes
from aitraining_pl.models import build_causal_lm, load_tokenizer
from aitraining_pl.rollout import GenerationConfig, RolloutEngine

MODES = ("reprefill", "kv_cache")
PARTS = ("decode_steps", "prefill")


class Talk(EpisodeEnvironment):
    """Answers every turn with the same message (``reply_chars`` long) until the episode's ``turns``."""

    limits = EpisodeLimits(max_turns=5, max_total_tokens=1 << 20)

    def __init__(self, reply_chars: int = 40):
        base = "Thanks. Now tell me a little bit more. "
        self.reply = (base * (1 + reply_chars // len(base)))[:reply_chars]

    def reset(self, prompt, metadata):
        self.turns = int(metadata["turns"])
        return None

    def step(self, turn):
        if turn.index + 1 >= self.turns:
            return EpisodeStep(done=True, reward=1.0)
        return EpisodeStep([{"role": "user", "content": self.reply}])


def timed_forward(model, split: Split) -> None:
    """Charge ``model``'s forward calls to ``decode_steps`` (one new token per row, with a cache) or ``prefill``."""

    def step(*args, **kwargs) -> bool:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        return kwargs["input_ids"].shape[1] == 1 and cache is not None

    forward = model.forward
    wrapped = split.timed("decode_steps", split.timed("prefill", forward, lambda *a, **k: not step(*a, **k)), step)
    model.forward = functools.wraps(forward)(wrapped)  # the decoder reads forward's signature


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["25m"], choices=list(SIZES))
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode; the first is a warm-up")
    parser.add_argument("--reply-chars", type=int, default=40, help="length of each environment reply (a tool output)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_header(args.threads)
    tokenizer = load_tokenizer("byte")
    prompts = [f"Episode {i}: tell me a story about the sea." for i in range(args.episodes)]
    metadata = [{"turns": 3 + i % 3} for i in range(args.episodes)]
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(map(len, rows))
    ids = torch.zeros(args.episodes, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0))
    for size in args.sizes:
        model = build_causal_lm(_model_config(size), seed=0).eval()  # one model for both modes
        splits = {mode: Split(1, PARTS, rest="other") for mode in MODES}
        outs, seconds, cpu_seconds = {}, {mode: [] for mode in MODES}, {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:  # alternated: both see the same load
                split = splits[mode]
                timed_forward(model, split)
                torch.manual_seed(0)
                split.step_start()
                start, cpu = time.perf_counter(), time.process_time()
                outs[mode] = sample_episodes(
                    engine,
                    model,
                    Talk(args.reply_chars),
                    prompts,
                    metadata,
                    ids,
                    mask,
                    1,
                    reprefill=mode == "reprefill",
                )
                seconds[mode].append(time.perf_counter() - start)
                cpu_seconds[mode].append(time.process_time() - cpu)
                split.step_end()
                del model.forward
        lines = {
            mode: _line(size, mode, args, outs[mode], seconds[mode][1:] or seconds[mode], splits[mode])
            for mode in MODES
        }
        kept, again = lines["kv_cache"], lines["reprefill"]
        for mode in MODES:
            lines[mode]["cpu_seconds"] = statistics.median(cpu_seconds[mode][1:] or cpu_seconds[mode])
        kept["speedup"] = again["seconds"] / kept["seconds"]
        kept["speedup_cpu"] = again["cpu_seconds"] / kept["cpu_seconds"]
        kept["same_tokens"] = bool(torch.equal(outs["kv_cache"].response_ids, outs["reprefill"].response_ids))
        for line in (again, kept):
            print(json.dumps(line), flush=True)


def _line(size: str, mode: str, args, out, seconds: list[float], split: Split) -> dict:
    info, episode_tokens = out.episodes, int(out.attention_mask.sum())
    return {
        "size": size,
        "mode": mode,
        "episodes": args.episodes,
        "turns": statistics.mean(info.metrics["turns"]),
        "max_new_tokens": args.max_new_tokens,
        "reply_chars": args.reply_chars,
        "rounds": len(seconds),
        "seconds": statistics.median(seconds),
        "seconds_all": [round(x, 3) for x in seconds],
        "episodes_per_s": args.episodes / statistics.median(seconds),
        "split_s": split.step_split(),
        "prefilled_per_turn": info.prefilled,
        "sampled_per_turn": info.sampled,
        "episode_tokens": episode_tokens,
        "prefilled_over_episode_tokens": sum(info.prefilled) / episode_tokens,
        "model_tokens_over_episode_tokens": (sum(info.prefilled) + sum(info.sampled)) / episode_tokens,
    }


if __name__ == "__main__":
    main()
