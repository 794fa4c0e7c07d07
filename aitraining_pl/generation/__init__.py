"""Generation: how responses are sampled (``GenerationConfig``) and by which backend (``backends``: the protocol
every backend implements, the registry and the factory). The rollout engine (``aitraining_pl.rollout``) sits on top
and returns the same ``Rollout`` whichever backend sampled."""

from aitraining_pl.generation.config import GenerationConfig, VLLMConfig

__all__ = ["GenerationConfig", "VLLMConfig"]
