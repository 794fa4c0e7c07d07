"""Multi-turn episodes: the KV cache kept across turns against re-prefilling the whole history every turn (what a
loop around ``generate`` does), on the same randomly initialised Llama (``3m`` or ``25m``, byte-level tokenizer).

    python benchmarks/multiturn.py --sizes 25m --episodes 16 --max-new-tokens 32 --rounds 3 --threads 2

Each episode plays 3 to 5 turns (its ``turns`` metadata, cycling 3, 4, 5); after each turn but the last the
environment answers with a user message of ``--reply-chars`` characters (40; a tool's output is often hundreds),
rendered by the fallback chat template. The
random model rarely samples its end token, so turns mostly run to ``--max-new-tokens``. Both modes draw the same
tokens from the same seed (``models.episode_decoding``), so they do the same episodes.

Prints one JSON line per mode and size (after a header line): ``episodes_per_s`` (mean over the rounds after the
first, a warm-up), ``prefilled_per_turn`` (real tokens run through the model as prefill before each turn, summed
over the batch), ``episode_tokens`` (prompt and response tokens of the batch), ``model_tokens`` (prefilled plus
decoding steps, over ``episode_tokens``: 1.0 means every token of the episodes went through the model once) and,
on the ``kv_cache`` line, ``speedup`` over ``reprefill``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _common import print_header
from dpo_vs_trl import SIZES, _model_config

from aitraining_pl.environments.episode import EpisodeEnvironment, EpisodeLimits, EpisodeStep
from aitraining_pl.environments.episode_rollout import sample_episodes
from aitraining_pl.models import build_causal_lm, load_tokenizer
from aitraining_pl.rollout import GenerationConfig, RolloutEngine


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


def run(
    size: str, episodes: int, max_new_tokens: int, rounds: int, reprefill: bool, reply_chars: int
) -> tuple[dict, object]:
    tokenizer = load_tokenizer("byte")
    model = build_causal_lm(_model_config(size), seed=0).eval()
    prompts = [f"Episode {i}: tell me a story about the sea." for i in range(episodes)]
    metadata = [{"turns": 3 + i % 3} for i in range(episodes)]
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(map(len, rows))
    ids = torch.zeros(episodes, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0))
    seconds, out = [], None
    for _ in range(rounds):
        torch.manual_seed(0)
        start = time.perf_counter()
        out = sample_episodes(engine, model, Talk(reply_chars), prompts, metadata, ids, mask, 1, reprefill=reprefill)
        seconds.append(time.perf_counter() - start)
    info = out.episodes
    episode_tokens = int(out.attention_mask.sum())
    steady = seconds[1:] or seconds
    return {
        "size": size,
        "mode": "reprefill" if reprefill else "kv_cache",
        "episodes": episodes,
        "turns": statistics.mean(info.metrics["turns"]),
        "max_new_tokens": max_new_tokens,
        "reply_chars": reply_chars,
        "seconds": statistics.mean(steady),
        "episodes_per_s": episodes / statistics.mean(steady),
        "prefilled_per_turn": info.prefilled,
        "sampled_per_turn": info.sampled,
        "episode_tokens": episode_tokens,
        "prefilled_over_episode_tokens": sum(info.prefilled) / episode_tokens,
        "model_tokens_over_episode_tokens": (sum(info.prefilled) + sum(info.sampled)) / episode_tokens,
    }, out


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
    for size in args.sizes:
        again, slow = run(size, args.episodes, args.max_new_tokens, args.rounds, True, args.reply_chars)
        kept, fast = run(size, args.episodes, args.max_new_tokens, args.rounds, False, args.reply_chars)
        kept["speedup"] = kept["episodes_per_s"] / again["episodes_per_s"]
        kept["same_tokens"] = bool(torch.equal(fast.response_ids, slow.response_ids))
        for line in (again, kept):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
