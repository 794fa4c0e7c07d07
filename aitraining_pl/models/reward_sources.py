"""Reward models as reward sources (``aitraining_pl.rewards``' protocol): a folder saved by the reward module
(``RewardModelSource``) or any one-label ``AutoModelForSequenceClassification`` (``SequenceClassifierReward``,
``models.sequence_classifier``); ``load_reward_source`` picks the one a folder or hub id holds. Each is held by
the online module outside its state (never trained or checkpointed) and moved to its device in ``on_fit_start``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from aitraining_pl.models.lora import is_peft_model
from aitraining_pl.models.quantization import QuantizationConfig, as_quantization_config, load_quantized
from aitraining_pl.models.reward import REWARD_CONFIG_FILE, load_reward_model
from aitraining_pl.models.sequence_classifier import SequenceClassifierReward
from aitraining_pl.models.tokens import closed_turn

__all__ = ["RewardModelSource", "SequenceClassifierReward", "load_reward_source"]


class RewardModelSource:
    """Scores ``prompt + separator + response`` with a reward-model folder saved by the reward module
    (``aitraining_pl.models.reward``; its own tokenizer is in the folder), in eval mode (dropout off). A prompt
    rendered by that tokenizer's chat template with the generation prompt has the response's turn closed by the
    template (``models.tokens.closed_turn``), as the conversational pairs it was trained on were.

    The model is held by this object, not by the LightningModule, so it never lands in a checkpoint;
    ``PPOModule`` moves it to its device in ``on_fit_start``.

    Args:
        path: folder with the reward model and its tokenizer.
        batch_size: texts scored per forward pass.
        separator: put between prompt and response.
        max_length: keep at most this many tokens of each text (its end); no limit when ``None``.
        trust_remote_code: allow remote code for a tokenizer the folder names but does not hold (off unless
            set here; the folder's own ``reward_config.json`` cannot set it).
        quantization: hold the trunk's linear layers in 4 bits (``QuantizationConfig``, bitsandbytes; the head
            stays in full precision): less memory beside the policy, rewards up to the 4-bit rounding.
    """

    def __init__(
        self,
        path: str,
        batch_size: int = 16,
        separator: str = "",
        max_length: int | None = None,
        trust_remote_code: bool = False,
        quantization: QuantizationConfig | dict | None = None,
    ):
        self.path, self.batch_size, self.separator, self.max_length = path, batch_size, separator, max_length
        self.model = load_reward_model(path, trust_remote_code=trust_remote_code).eval()
        quantized = as_quantization_config(quantization)
        if quantized is not None:  # the loaded (merged, full-precision) trunk reloaded with 4-bit linear layers
            trunk = self.model.trunk
            plain = trunk.merge_and_unload() if is_peft_model(trunk) else trunk  # zeroed adapters: no change
            self.model.trunk = load_quantized(lambda: plain, None, quantized, "AutoModel").eval()
        self.model.get_tokenizer()  # a missing or refused tokenizer fails here, before training starts
        self.model.requires_grad_(False)

    def to(self, device=None, dtype=None) -> RewardModelSource:
        self.model.to(device=device, dtype=dtype)
        return self

    def __call__(self, prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
        tokenizer = self.model.get_tokenizer()
        texts = [closed_turn(tokenizer, p, r, self.separator) for p, r in zip(prompts, responses)]
        return [float(x) for x in self.model.predict_rewards(texts, None, self.batch_size, self.max_length)]


def load_reward_source(name_or_path: str, **kwargs: Any) -> Callable:
    """A reward-model source from a folder or hub id: this project's format when the folder holds
    ``reward_config.json`` (``RewardModelSource``), else any one-label ``AutoModelForSequenceClassification``
    (``SequenceClassifierReward``). ``kwargs`` are the chosen class's arguments."""
    folder = os.path.expanduser(name_or_path)
    if os.path.isdir(folder):
        if os.path.isfile(os.path.join(folder, REWARD_CONFIG_FILE)):
            return RewardModelSource(folder, **kwargs)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(f"reward model folder {folder}: neither {REWARD_CONFIG_FILE} nor config.json is in it")
        return SequenceClassifierReward(folder, **kwargs)
    from transformers.utils import cached_file

    own = cached_file(
        name_or_path, REWARD_CONFIG_FILE, _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )  # fmt: skip
    if own is not None:  # this project's format on the hub: fetch its JSON, safetensors and tokenizer files
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
        return RewardModelSource(snapshot_download(name_or_path, allow_patterns=patterns), **kwargs)
    return SequenceClassifierReward(name_or_path, **kwargs)
