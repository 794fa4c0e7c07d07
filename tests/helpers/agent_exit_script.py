"""Run as a script by ``test_agent_exits.py``: one agent episode whose agent starts a thread that calls
``os._exit(0)`` (``argv[1]``: ``sync`` or ``async`` agent); prints what ``play_episodes`` did and exits 3 on an
error, 0 after ``done``."""

import asyncio
import os
import sys
import threading

import torch
from conftest import TINY_LLAMA

from aitraining_pl.agents import AgentEnvironment
from aitraining_pl.models import build_causal_lm, load_tokenizer
from aitraining_pl.rollout import GenerationConfig, RolloutEngine


def _exits() -> None:
    thread = threading.Thread(target=os._exit, args=(0,), name="agent-helper")
    thread.start()
    thread.join()


def sync_agent(client, prompt, metadata):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=2)
    _exits()
    return 1.0


async def async_agent(client, prompt, metadata):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=2)
    await asyncio.to_thread(_exits)
    return 1.0


tokenizer = load_tokenizer("byte", padding_side="left")
model = build_causal_lm(dict(TINY_LLAMA), seed=0).eval()
engine = RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=2))
env = AgentEnvironment(sync_agent if sys.argv[1] == "sync" else async_agent, max_sequences=1)
ids = torch.tensor([tokenizer("a", add_special_tokens=False)["input_ids"]])
try:
    env.play_episodes(engine, model, ["a"], [{}], ids, torch.ones_like(ids), 1, timeout=60)
except Exception as err:  # noqa: BLE001 - what the test reads
    print(f"{type(err).__name__}: {err}", flush=True)
    sys.exit(3)
finally:
    env.close()
print("done", flush=True)
