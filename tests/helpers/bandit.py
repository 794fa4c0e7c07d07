"""The one-token KL-regularised bandit of the learning tests (issue 22): a tiny policy over an eight-word
vocabulary answers one prompt with one token, each token has a fixed reward, and RLOO / REINFORCE++ with the
k1 KL in the reward (``kl_in_reward``) should reach the optimum of ``E[r] - beta KL(pi || pi_ref)``,
``pi* = pi_ref exp(r / beta) / Z`` (the closed form of the reverse-KL-regularised objective; e.g. Rafailov et
al. 2023, eq. 4). Used by ``modules/test_online.py`` (``hf``) and ``generation/test_vllm_training.py`` (``vllm``)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from conftest import quiet_trainer

from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.models import load_tokenizer
from aitraining_pl.modules.critic_free import RLOOModule
from aitraining_pl.rollout import GenerationConfig

WORDS = ["</s>", "a", "b", "c", "d", "e", "f", "g"]
#: reward of each response text ("" is the end of sequence: a response that says nothing)
REWARDS = {"": 0.0, "a": 0.0, "b": 0.2, "c": 0.4, "d": 0.6, "e": 0.8, "f": 1.0, "g": -0.5}
BETA = 0.5
#: a Llama with two heads of 32 (vLLM's CPU attention needs 32 or more) over the eight words
POLICY = {
    "preset": "tiny-llama",
    "vocab_size": len(WORDS),
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    **dict.fromkeys(("eos_token_id", "pad_token_id", "bos_token_id"), 0),
}


def word_tokenizer(folder) -> str:
    """Save a word-level tokenizer over ``WORDS`` (EOS ``</s>``, also the padding) into ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>").save_pretrained(str(folder))
    return str(folder)


def word_reward(prompts, responses, metadata) -> list[float]:
    return [REWARDS[r.strip()] for r in responses]


@torch.no_grad()
def next_token_distribution(model, prompt_ids: torch.Tensor) -> torch.Tensor:
    return torch.softmax(model(input_ids=prompt_ids).logits[0, -1].double(), -1)


def train_bandit(
    tmp_path, advantage: str, backend: str, steps: int = 50, **generation
) -> tuple[torch.Tensor, torch.Tensor]:
    """Train on the bandit for ``steps`` iterations of 8 prompts x 8 samples (one AdamW step each, the learning
    rate decaying linearly to 0); returns the policy's final next-token distribution and ``pi*``, derived from
    the reference's logits. ``generation``: more ``GenerationConfig`` options (a server, ``max_staleness``)."""
    pl.seed_everything(0)
    folder = word_tokenizer(tmp_path / "tokenizer")
    module = RLOOModule(
        model_config=POLICY,
        tokenizer_name=folder,
        reward=word_reward,
        generation=GenerationConfig(max_new_tokens=1, temperature=1.0, top_p=1.0, backend=backend, **generation),
        advantage=advantage,
        num_generations=8,
        learning_rate=0.01,
        mini_batch_size=64,
        kl_coef=BETA,
    )
    tokenizer = load_tokenizer(folder)
    prompt = tokenizer("a", return_tensors="pt", add_special_tokens=False)["input_ids"]
    reference = next_token_distribution(module.reference.model, prompt)
    rewards = torch.tensor([REWARDS[tokenizer.decode([i], skip_special_tokens=True)] for i in range(len(WORDS))])
    optimum = reference * torch.exp(rewards.double() / BETA)
    dm = PromptDataModule(prompts=["a"] * (8 * steps), tokenizer=tokenizer, batch_size=8)
    quiet_trainer(tmp_path, max_epochs=1).fit(module, dm)
    return next_token_distribution(module.policy, prompt), optimum / optimum.sum()
