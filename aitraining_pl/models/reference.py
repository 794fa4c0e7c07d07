"""The frozen reference policy of KL-regularised RL and DPO.

With LoRA the reference is the policy itself with adapters disabled (no second copy of the weights).
Without LoRA it is a frozen copy built from the same *source* as the policy (model name or inline
config), never copied from the live policy, whose weights may already be trained or resumed.

The copy is held outside the ``nn.Module`` tree, so it is never in the owner's ``state_dict``,
checkpoints, optimizer or DDP/FSDP wrapping; ``to`` moves it explicitly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from aitraining_pl.models.lora import is_peft_model
from aitraining_pl.models.training import eval_mode


class ReferencePolicy:
    """Computes reference logits for a policy.

    Args:
        policy: the trained policy (a ``peft`` model when LoRA is on).
        build_reference: builds a fresh model from the policy's source; called only without LoRA.
    """

    def __init__(self, policy: nn.Module, build_reference: Callable[[], nn.Module] | None = None):
        self._policy = [policy]  # a list hides it from nn.Module registration by any owner
        self._frozen: list[nn.Module] = []
        self._lora = is_peft_model(policy)
        if not self._lora:
            if build_reference is None:
                raise ValueError("without LoRA the reference policy needs build_reference (a frozen copy's source)")
            model = build_reference().eval()
            model.requires_grad_(False)
            self._frozen.append(model)

    @property
    def shares_weights(self) -> bool:
        """True under LoRA: the reference is the policy with adapters disabled."""
        return self._lora

    @property
    def model(self) -> nn.Module:
        """The module that computes reference outputs (inside ``context()`` for LoRA)."""
        if self._lora:
            return self._policy[0]
        if self.frozen_copy is None:
            raise RuntimeError("the frozen reference copy was released (drop()); precomputed log-probs are needed")
        return self.frozen_copy

    @property
    def frozen_copy(self) -> nn.Module | None:
        """The frozen copy of the weights; None under LoRA or once released (``drop``)."""
        return self._frozen[0] if self._frozen else None

    def context(self):
        """Context manager under which ``model`` acts as the reference (adapters off under LoRA)."""
        return self._policy[0].disable_adapter() if self._lora else contextlib.nullcontext()

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ReferencePolicy:
        """Move the frozen copy (no-op under LoRA, where the policy's own placement applies)."""
        if self._frozen:
            self._frozen[0].to(device=device, dtype=dtype)
        return self

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Reference logits (B, T, V) for ``input_ids``."""
        with eval_mode(self.model) as model, self.context():
            return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits

    @torch.no_grad()
    def mix_in_policy(self, alpha: float) -> None:
        """TR-DPO's soft update (Gorbatovski et al. 2024, eq. 4): ``ref <- alpha * policy + (1 - alpha) * ref`` for
        every parameter of the frozen copy (``alpha = 1``: the hard update, a copy of the policy). Needs the frozen
        copy: under LoRA the reference is the policy itself with adapters off, so it cannot move on its own."""
        if self._lora or self.frozen_copy is None:
            raise RuntimeError(
                "the reference can only be updated towards the policy when it is a separate frozen copy "
                "(not under LoRA, not after precomputed reference log-probs released it)"
            )
        policy = dict(self._policy[0].named_parameters())
        for name, param in self.frozen_copy.named_parameters():
            source = policy.get(name)
            if source is None or source.shape != param.shape:
                raise RuntimeError(f"the policy has no parameter {name!r} shaped like the reference's")
            param.lerp_(source.detach().to(param.dtype), alpha)

    def drop(self) -> None:
        """Release the frozen copy (e.g. after reference log-probs were precomputed)."""
        self._frozen.clear()
