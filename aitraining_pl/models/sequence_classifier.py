"""Reward models trained elsewhere: any ``AutoModelForSequenceClassification`` with one label.

The usual reward models on the hub (DeBERTa / RoBERTa cross-encoders, Llama / Qwen / Gemma reward models) are
sequence classifiers whose single logit is the reward. They come with their own tokenizer, which may differ
from the policy's, so ``SequenceClassifierReward`` scores *text*: the policy's decoded response is formatted
with the prompt and re-tokenized with the reward model's tokenizer.

Formatting (``text_format``):

- ``chat``: the tokenizer's chat template applied to ``[{"role": "user", "content": prompt},
  {"role": "assistant", "content": response}]`` and tokenized without adding special tokens again (the
  template writes them), as TRL does for reward models;
- ``pair``: ``tokenizer(prompt, response)``, the text-pair encoding cross-encoders were trained on
  (``[CLS] prompt [SEP] response [SEP]`` for BERT-style tokenizers);
- ``concat``: ``tokenizer(prompt + separator + response)``;
- ``auto`` (default): ``chat`` when the tokenizer has a chat template, else ``pair``.

Scoring is batched, right-padded (positions of real tokens are then those of the unpadded sequence for
every architecture), truncated to ``max_length`` (default: the tokenizer's ``model_max_length`` when it is
a real limit) with the tokenizer's own truncation side, under ``torch.no_grad`` in eval mode (dropout off).
A decoder reward model pools the last non-pad token, so its config needs a pad id: when it has none, the
tokenizer's pad token (or EOS) is used, as TRL does.

Remote code runs only when the caller passes ``trust_remote_code=True``; weights load through
``from_pretrained`` (safetensors preferred; ``.bin`` files are read with ``weights_only`` torch loading).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from aitraining_pl.models.loading import resolve_dtype

TEXT_FORMATS = ("auto", "chat", "pair", "concat")


class SequenceClassifierReward:
    """A one-label ``AutoModelForSequenceClassification`` (folder or hub id) that scores prompt/response texts;
    a reward source (``aitraining_pl.rewards``) as it is. Not an ``nn.Module``: held by PPO outside its
    state, so it is never trained or checkpointed.

    Args:
        name_or_path: folder or hub id of the classifier and its tokenizer.
        batch_size: texts scored per forward pass.
        max_length: most tokens per text (default: the tokenizer's ``model_max_length`` if it is a real limit).
        text_format: ``auto``, ``chat``, ``pair`` or ``concat`` (module docstring).
        separator: between prompt and response in the ``concat`` format.
        trust_remote_code: allow the folder's own modelling/tokenizer code (off unless set).
        dtype: load the model in this dtype (``bfloat16``, ...; default the checkpoint's).
    """

    def __init__(
        self,
        name_or_path: str,
        batch_size: int = 16,
        max_length: int | None = None,
        text_format: str = "auto",
        separator: str = "",
        trust_remote_code: bool = False,
        dtype: str | None = None,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if text_format not in TEXT_FORMATS:
            raise ValueError(f"unknown text_format {text_format!r}; known: {', '.join(TEXT_FORMATS)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        kwargs = {"trust_remote_code": trust_remote_code}
        if dtype is not None:
            kwargs["dtype"] = resolve_dtype(dtype) or "auto"
        self.model = AutoModelForSequenceClassification.from_pretrained(name_or_path, **kwargs).eval()
        self.model.requires_grad_(False)
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"{name_or_path}: a reward model needs one output label, "
                f"this classifier has {self.model.config.num_labels}"
            )
        tokenizer = copy.copy(AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code))
        tokenizer.padding_side = "right"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = tokenizer.pad_token_id
        self.tokenizer, self.name = tokenizer, name_or_path
        self.batch_size, self.separator = batch_size, separator
        limit = getattr(tokenizer, "model_max_length", 0) or 0
        self.max_length = max_length if max_length is not None else (int(limit) if 0 < limit < 1_000_000 else None)
        self.text_format = (
            ("chat" if getattr(tokenizer, "chat_template", None) else "pair") if text_format == "auto" else text_format
        )

    def to(self, device=None, dtype=None) -> SequenceClassifierReward:
        self.model.to(device=device, dtype=dtype)
        return self

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> dict[str, torch.Tensor]:
        """Padded model inputs for prompt/response pairs in this model's format."""
        common = {"truncation": self.max_length is not None, "max_length": self.max_length, "padding": True,
                  "return_tensors": "pt"}  # fmt: skip
        if self.text_format == "pair":
            return self.tokenizer(list(prompts), list(responses), **common)
        if self.text_format == "concat":
            return self.tokenizer([p + self.separator + r for p, r in zip(prompts, responses)], **common)
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False
            )
            for p, r in zip(prompts, responses)
        ]
        return self.tokenizer(texts, add_special_tokens=False, **common)

    def __call__(self, prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
        """The reward-source protocol of ``aitraining_pl.rewards`` (``metadata`` is not used)."""
        return self.score(prompts, responses)

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """One reward (the classifier's logit) per prompt/response pair."""
        self.model.eval()
        device, rewards = next(self.model.parameters()).device, []
        for start in range(0, len(prompts), self.batch_size):
            batch = self.encode(prompts[start : start + self.batch_size], responses[start : start + self.batch_size])
            logits = self.model(**{k: v.to(device) for k, v in batch.items()}).logits
            rewards += logits[:, 0].float().tolist()
        return rewards
