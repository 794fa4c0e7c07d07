"""The vLLM generation backend: a colocated vLLM engine behind the rollout engine (``generation.backend: vllm``),
built from the policy's weights, synced once per rollout, returning the same ``Rollout`` as the Hugging Face
decoder plus vLLM's own log-probs of the sampled tokens. ``vllm`` is imported only when an engine is built."""

from aitraining_pl.generation.config import EXTRA_CPU, EXTRA_GPU, VLLMConfig

__all__ = ["EXTRA_CPU", "EXTRA_GPU", "VLLMConfig"]
