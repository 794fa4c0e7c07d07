"""Value head and the policy-with-value model used by PPO, and the loaders of a PPO export.

A PPO export (``PPOModule.save_pretrained`` / ``HFExportCallback``) is the policy's Hugging Face folder (or LoRA
adapters) with ``value_head.safetensors`` beside it: the ``ValueHead`` weights (``net.1.*``: hidden -> hidden,
``net.3.*``: hidden -> 1), which read the policy's last hidden state. ``load_value_head(folder)`` returns that
head; ``PPOModel.from_pretrained(folder)`` returns the policy with its head, ready to compute values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from aitraining_pl.losses import positions_from_mask
from aitraining_pl.models.loading import hidden_size_of
from aitraining_pl.models.rollout_scoring import response_logps
from aitraining_pl.models.vision import VisionInputs


class ValueHead(nn.Module):
    """Per-token scalar value: hidden -> Linear -> ReLU -> Linear -> scalar (the seed's architecture).

    The output layer starts at zero so that initial values are 0 and early advantages equal returns.
    """

    def __init__(self, hidden_size: int, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(hidden_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, 1)
        )
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T) values, computed in float32."""
        return self.net(hidden_states.to(self.net[1].weight.dtype)).squeeze(-1).float()


#: file of the value head inside a PPO export.
VALUE_HEAD_FILE = "value_head.safetensors"


def load_value_head(path: str | os.PathLike, device: str | torch.device | None = None) -> ValueHead:
    """The ``ValueHead`` saved in ``path`` (a PPO export folder, or the ``value_head.safetensors`` file itself),
    in eval mode; its hidden size is read from the weights. Reads safetensors only.

    Usage: ``values = head(policy(ids, output_hidden_states=True).hidden_states[-1])`` -> (B, T)."""
    from safetensors.torch import load_file

    path = Path(path)
    file = path / VALUE_HEAD_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no value head at {path}: {VALUE_HEAD_FILE} is missing")
    state = load_file(str(file))
    if "net.1.weight" not in state:
        raise ValueError(f"{file}: not a value head (keys {sorted(state)[:4]})")
    head = ValueHead(int(state["net.1.weight"].shape[1]))
    head.load_state_dict(state)
    return head.to(device).eval() if device is not None else head.eval()


class PolicyValueOutput(NamedTuple):
    logits: torch.Tensor  #: (B, T, V)
    values: torch.Tensor  #: (B, T), value of the state after reading token t


class PolicyValueScores(NamedTuple):
    logprobs: torch.Tensor  #: (B, R) log-probs of the response tokens, 0 outside the response mask
    entropy: torch.Tensor | None  #: (B, R) policy entropy at each response token, or None
    values: torch.Tensor  #: (B, R) value of the state before each response token, 0 outside the response mask


class PPOModel(nn.Module):
    """A causal LM with a value head. By default the head reads the policy's last hidden state (shared
    trunk); pass ``critic`` (a separate transformers model) to give the value function its own trunk.

    Args:
        base_model: the policy, a transformers causal LM (optionally wrapped by ``peft``).
        critic: optional separate trunk for the value function.
        value_head_dropout: dropout before the value head.
    """

    def __init__(self, base_model: nn.Module, critic: nn.Module | None = None, value_head_dropout: float = 0.0):
        super().__init__()
        self.base_model = base_model
        self.critic = critic
        self.value_head = ValueHead(hidden_size_of(critic if critic is not None else base_model), value_head_dropout)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> PolicyValueOutput:
        """``position_ids`` (optional, (B, T)) matter for left-padded sequences (as sampled by ``generate``)."""
        out = self.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=self.critic is None,
            use_cache=False,
        )
        if self.critic is None:
            hidden = out.hidden_states[-1]
        else:
            hidden = self.critic(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                output_hidden_states=True,
                use_cache=False,
            ).hidden_states[-1]
        return PolicyValueOutput(out.logits, self.value_head(hidden))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, trust_remote_code: bool = False, **kwargs) -> PPOModel:
        """A PPO export as a ``PPOModel`` (eval mode): the policy through ``AutoModelForCausalLM`` (or, for a
        LoRA export, ``peft.AutoPeftModelForCausalLM``, whose ``adapter_config.json`` names the base) and the
        value head from ``value_head.safetensors``. ``kwargs`` go to ``from_pretrained`` (``dtype``, ...)."""
        path = Path(path)
        if (path / "adapter_config.json").is_file():
            from peft import AutoPeftModelForCausalLM as auto_class
        else:
            from transformers import AutoModelForCausalLM as auto_class
        policy = auto_class.from_pretrained(str(path), trust_remote_code=trust_remote_code, **kwargs)
        model = cls(policy)
        model.value_head = load_value_head(path).to(next(policy.parameters()).device)
        return model.eval()

    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_length: int,
        temperature: float = 1.0,
        with_entropy: bool = False,
        padding_free: bool = True,
        vision: VisionInputs | None = None,
    ) -> PolicyValueScores:
        """Log-probs (and entropies) of the response tokens of rollout rows (N, P + R) and the values of the states
        that predict them, from one decoder pass: the value head and the fused LM head read the same hidden
        states (``models.rollout_scoring.response_logps``, packed or padded), so no (N, R, V) logits are built.
        With a separate ``critic`` its own trunk runs on the padded rows for the values. ``vision``: the rows'
        images for a vision-language policy (``models.vision.VisionInputs``): the head reads the language model's
        last hidden states of the pass that runs with them (a separate critic takes no images)."""
        if vision is not None and self.critic is not None:
            raise NotImplementedError("a separate critic trunk with images: the value head reads the policy's trunk")
        out = response_logps(
            self.base_model,
            input_ids,
            attention_mask,
            prompt_length,
            temperature,
            padding_free,
            with_entropy,
            with_hidden=self.critic is None,
            vision=vision,
        )
        response = attention_mask[:, prompt_length:].bool()
        if self.critic is None:
            values = out.logprobs.new_zeros(response.shape).masked_scatter(response, self.value_head(out.hidden))
        else:
            hidden = self.critic(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions_from_mask(attention_mask),
                output_hidden_states=True,
                use_cache=False,
            ).hidden_states[-1]
            values = self.value_head(hidden[:, prompt_length - 1 : -1]) * response
        return PolicyValueScores(out.logprobs, out.entropy, values)

    def generate(self, *args, **kwargs):
        """Sampling from the policy (the value head plays no part)."""
        return self.base_model.generate(*args, **kwargs)
