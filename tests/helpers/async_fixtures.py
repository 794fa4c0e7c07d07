"""Shared by the asynchronous-training tests (issue 31): an HF generation server in a thread of the test process, the
options that connect to it, and the small GRPO run they train."""

from __future__ import annotations

import contextlib

from conftest import TINY_LLAMA
from http_fixtures import http_hf_server

from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.generation.config import GenerationConfig, VLLMConfig
from aitraining_pl.modules.critic_free import GRPOModule

TOY_REWARD = "aitraining_pl.rewards:char_length_reward"  # varies within a group: something to learn


@contextlib.contextmanager
def hf_server_port(model_config, seed: int = 0):
    """An HF generation server over HTTP (``generation.servers.hf_routes``) for ``model_config``'s architecture, served
    from a thread on a free loopback port (yielded) until the block ends."""
    with http_hf_server(model_config, seed) as port:
        yield port


def served(port: int, **options) -> dict:
    """``generation`` options that connect to the server on ``port``."""
    vllm = VLLMConfig(server_port=port, server_timeout=60)
    return {"server": "connect", "vllm": vllm, **options}


def grpo(generation: dict, prompts: list[str] | None = None, **kw) -> tuple[GRPOModule, PromptDataModule]:
    """GRPO on the half-width tiny Llama (2 samples per prompt, one optimizer step per batch of 2 prompts) with
    ``generation`` options (4 new tokens, temperature 1), and a data module over ``prompts``."""
    generation = {"max_new_tokens": 4, **generation}
    module = GRPOModule(
        reward=TOY_REWARD,
        model_config=TINY_LLAMA,
        tokenizer_name="byte",
        learning_rate=1e-3,
        num_generations=2,
        mini_batch_size=4,
        kl_coef=0.05,
        generation=GenerationConfig(temperature=1.0, top_p=1.0, **generation),
        **kw,
    )
    prompts = prompts or ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]
    return module, PromptDataModule(prompts=prompts, tokenizer=module.tokenizer, batch_size=2)
