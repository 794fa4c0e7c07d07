"""``HTTPReplica``: one generation server's client over the engine's own HTTP routes (``generation.servers.replica``'s
``Replica``), the same for a ``vllm serve`` and for this project's HF server (``hf_routes``), which speaks the subset
used here.

**Rollouts** go to ``/v1/completions`` with each prompt's token ids (unpadded), ``n`` samples, the sampling fields
of the colocated engine's ``SamplingParams`` (``temperature`` 0 when greedy, ``top_p``, ``top_k``, ``min_p`` 0, no
penalties, ``ignore_eos`` with the end ids as ``stop_token_ids``) and ``logprobs: 0`` with
``return_tokens_as_token_ids``: each choice's ``logprobs.tokens`` are ``token_id:<id>`` and ``token_logprobs`` the
sampled tokens' log-probs (under the processed distribution when the server runs with ``--logprobs-mode
processed_logprobs``, as the launcher starts it). One request per prompt, sent concurrently, so that prompt ``i`` of
a seeded call gets the seed ``seed + i * n`` exactly as the colocated engine gives it (vLLM gives a request's ``n``
samples the seeds that follow): greedy and seeded rollouts are the colocated engine's token for token. A greedy
prompt is asked once (vLLM refuses ``n > 1`` at temperature 0) and its answer repeated. The HF server
(``/v1/models`` owned by ``aitraining-pl``) gets one request with the list of prompts, which it decodes as one batch
with the same per-prompt seeds: the same tokens, and the same batch whatever the timing (bit-reproducible runs).
For an MoE policy with ``generation.routing_replay`` (the request's ``routes``) the body asks
``return_routed_experts`` and each choice's ``routed_experts`` (``answers.decoded_routes``: checked against the
policy's layers, top-k and experts) become ``SampledTokens.routes`` in the request's layout; a server that sends none
(a ``vllm serve`` without ``--enable-return-routed-experts``) is warned about once and its rollouts carry none.

**Weights** (``push``), chosen at the first push from where the first tensor lives (never in ``setup``, before
Lightning has moved the policy): CPU tensors go as one safetensors file in a private folder of shared memory that
the server's worker extension loads (``vllm_worker``: ``/collective_rpc`` ``aitraining_pl_load``; the server is on
this machine), then ``/reset_prefix_cache`` and ``/update_weight_version``; CUDA tensors go by vLLM's own NCCL
weight-transfer engine (``/init_weight_transfer_engine`` once, then ``/start_weight_update``, ``/update_weights``
with the names, dtypes and shapes while the tensors are broadcast, ``/finish_weight_update`` with the version;
the server started with ``--weight-transfer-config '{"backend": "nccl"}'``). Every push carries this client's owner
key (``checks.PushGuard``), which no one else has.

**Failures.** Nothing listening, a dropped connection or a passed deadline is ``ReplicaDown`` (a fleet re-sends the
request elsewhere); a refused push, a 401 or any other answer that is not a success is one
``GenerationServerError`` line naming the server's URL and what was being done (never the token or a run id). An
answer that cannot be the request's (``answers``: an HTML or non-JSON page, more log-probs than tokens, more tokens
than ``max_new_tokens``, ids outside the vocabulary, log-probs above 0, weights older than asked for) is
``answers.BadAnswer``, a ``ReplicaDown``: a fleet re-sends the request elsewhere. Every call of a rollout, the first
``/v1/models`` included, keeps to the rollout's deadline.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from aitraining_pl.errors import GenerationServerError
from aitraining_pl.generation.backend import SampledTokens
from aitraining_pl.generation.images import check_expanded, generate_body, generate_choices
from aitraining_pl.generation.servers.adapters import AdapterWeights, write_adapter
from aitraining_pl.generation.servers.answers import (
    BadAnswer,
    answer_object,
    checked_rows,
    choice_tokens,
    decoded_routes,
    padded_samples,
)
from aitraining_pl.generation.servers.replica import PushReport, ReplicaDown, ReplicaStats
from aitraining_pl.generation.servers.vllm_worker import PUSH_PREFIX
from aitraining_pl.generation.version import WeightsVersion

#: seconds to open a connection (apart from a request's deadline, which scales with its tokens)
CONNECT_TIMEOUT = 10.0
#: the name a pushed LoRA adapter is served under (``vllm serve`` with ``--enable-lora``)
LORA_NAME = "aitraining-pl-policy"
#: where pushed files are written: shared memory when the machine has it
SHARED_MEMORY = "/dev/shm"


def completion_body(model: str, prompt: list, request: Any, n: int, seed: int | None) -> dict[str, Any]:
    """The ``/v1/completions`` body of one prompt of ``request`` (a ``SampleRequest``; or a list of prompts, for the
    HF server) for ``n`` samples each."""
    generation, stop_rule = request.generation, request.stop_rule
    sampling = bool(generation.do_sample)
    body = {
        "model": model,
        "prompt": prompt,
        "n": n,
        "max_tokens": int(generation.max_new_tokens),
        "temperature": float(generation.temperature) if sampling else 0.0,
        "top_p": float(generation.top_p) if sampling else 1.0,
        "top_k": int(generation.top_k) if sampling and generation.top_k else -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
        "ignore_eos": True,
        "stop_token_ids": [int(t) for t in request.end_ids],
        "stop": list(stop_rule.stop_strings) or None,
        "include_stop_str_in_output": True,
        "skip_special_tokens": bool(stop_rule.skip_special_tokens),
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    if seed is not None:
        body["seed"] = int(seed)
    if getattr(request, "routes", None) is not None:  # an MoE policy's routes (the HF server's field)
        body["return_routed_experts"] = True
    return body


class HTTPReplica:
    """A client of one server at ``url`` (see the module docstring); thread-safe.

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``).
        token: the run's token, sent as ``Authorization: Bearer`` on every request.
        timeout: seconds a push, a pause or a health check may take (a rollout has its own deadline).
        workers: most requests in flight at once (one per prompt).
    """

    def __init__(self, url: str, token: str | None, timeout: float = 300.0, workers: int = 32):
        import httpx

        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.stats = ReplicaStats()
        self.owner = secrets.token_hex(32)  #: this client's push key (``checks.PushGuard``): never sent elsewhere
        self.held: WeightsVersion | None = None  #: the version this client last pushed or saw served
        self.channel: str | None = None  #: ``shm`` or ``nccl``, decided at the first push
        self.transfer: Any = None  #: vLLM's NCCL trainer engine, once opened
        self._lock = threading.Lock()
        self._outstanding = 0
        self._busy_since: float | None = None
        self._model: str | None = None
        self._engine: str | None = None
        self.lora: Path | None = None  #: the folder of the LoRA adapter vLLM serves the rollouts with (None: none)
        self.lora_loaded = False  #: vLLM has an adapter under ``LORA_NAME`` (the next one loads in place)
        self.adapters: dict[str, Path] = {}  #: named adapters vLLM holds (``AdapterWeights.name``) -> their folders
        self.routeless = False  #: routes were asked for and this server sent none (warned once)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
        self.http = httpx.Client(base_url=self.url, headers=headers, limits=limits, timeout=self.timeout)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aitraining-pl-http")

    # ------------------------------------------------------------------ requests
    def call(self, method: str, route: str, doing: str, timeout: float | None = None, **kwargs: Any) -> Any:
        """One request; its JSON answer (None when empty). ``ReplicaDown`` when the server cannot be reached or
        does not answer in ``timeout`` seconds; ``GenerationServerError`` for any answer but a success."""
        import httpx

        seconds = self.timeout if timeout is None else max(0.1, timeout)
        try:
            response = self.http.request(method, route, timeout=httpx.Timeout(seconds, connect=CONNECT_TIMEOUT),
                                         **kwargs)  # fmt: skip
        except httpx.TimeoutException:
            raise ReplicaDown(f"{self.url}: no answer within {seconds:.3g} s while {doing}") from None
        except httpx.TransportError as err:
            raise ReplicaDown(f"{self.url}: cannot reach the server while {doing} ({type(err).__name__})") from None
        if response.status_code == 401:
            raise GenerationServerError(
                self.url, f"it refused the run's token (401) while {doing}: give the trainer the server's token "
                "(docs/vllm.md, Server mode)",
            )  # fmt: skip
        if response.status_code >= 400:
            raise GenerationServerError(self.url, f"{doing} failed ({response.status_code}: {reason(response)})")
        try:
            return response.json() if response.content else None
        except ValueError:  # a plain-text success (vLLM's /v1/load_lora_adapter)
            return None

    def model(self, timeout: float | None = None) -> str:
        """The served model's name (``/v1/models``: what completions name); ``timeout``: seconds to wait (None: the
        client's)."""
        if self._model is None:
            self._model = str(self.listed(timeout).get("id"))
        return self._model

    def listed(self, timeout: float | None = None) -> dict[str, Any]:
        """The served model's entry in ``/v1/models``; ``BadAnswer`` when the answer has none."""
        answer = self.call("GET", "/v1/models", "listing the served model", timeout=timeout)
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list) or not data or not isinstance(data[0], dict):
            raise BadAnswer(f"{self.url}: its /v1/models answer lists no model")
        return data[0]

    def alive(self) -> bool:
        try:
            return self.http.get("/health", timeout=5.0).status_code == 200
        except Exception:  # noqa: BLE001 - any failure means not up
            return False

    def outstanding_tokens(self) -> int:
        with self._lock:
            return self._outstanding

    def pause(self) -> None:
        self.call("POST", "/pause", "pausing generation", params={"mode": "keep"})

    def resume(self) -> None:
        self.call("POST", "/resume", "resuming generation")

    def served_version(self, timeout: float | None = None) -> WeightsVersion | None:
        """The weights version the server says it holds (``/weight_info``); ``timeout`` as ``model``'s."""
        answer = self.call("GET", "/weight_info", "reading the served weights version", timeout=timeout)
        return WeightsVersion.parse(answer.get("weight_version") if isinstance(answer, dict) else None)

    # ------------------------------------------------------------------ sampling
    def sample(self, request: Any, deadline: float) -> SampledTokens:
        wanted = WeightsVersion.parse(getattr(request, "version", None))
        self.wait_for(wanted, deadline)
        n, generation = int(request.num_samples), request.generation
        asked = 1 if not generation.do_sample else n
        prompts = [ids[m.bool()].tolist() for ids, m in zip(request.prompt_ids, request.prompt_mask)]
        tokens = len(prompts) * n * int(generation.max_new_tokens)
        self._begin(tokens)
        try:  # the deadline holds from the first call on (a server that hangs at /v1/models: issue 52)
            hf = self.engine(deadline - time.monotonic()) == "hf"
            model = LORA_NAME if self.lora is not None else self.model(deadline - time.monotonic())
            if request.adapter is not None and not hf:  # a named adapter (the HF server merges the one pushed)
                model = request.adapter
            futures = []
            if request.images is None and hf:  # one request: the HF server decodes it as a batch
                seed = None if request.seed is None else int(request.seed) % 2**31  # prompt i: seed + i * asked
                body = completion_body(model, prompts, request, asked, seed)
                futures.append(self.pool.submit(self._complete, body, deadline, None, prompts, request))
            for i, prompt in enumerate(prompts if not futures else ()):
                seed = None if request.seed is None else (int(request.seed) + i * asked) % 2**31
                body = completion_body(model, prompt, request, asked, seed)
                if not hf:  # a vllm serve returns routes by its own flag (--enable-return-routed-experts)
                    body.pop("return_routed_experts", None)
                if request.images is not None:  # vLLM's tokens-in route, which takes the images (``images``)
                    body = generate_body(body, request.images, i)
                futures.append(self.pool.submit(self._complete, body, deadline, i, prompt, request))
            rows = []
            for future in futures:
                choices = future.result()
                rows += choices if asked == n else [c for c in choices for _ in range(n)]
        finally:
            self._end(tokens)
        sampled = padded_samples(rows, request.pad_token_id, request.prompt_mask.repeat_interleave(n, 0))
        with self._lock:
            self.stats.requests += len(prompts)
            self.stats.tokens += sum(len(ids) for ids, *_ in rows)
        if getattr(request, "routes", None) is not None and sampled.routes is None and not self.routeless:
            self.routeless = True
            why = "no routing replay; a vllm serve needs --enable-return-routed-experts"
            warnings.warn(f"{self.url} returns no routed_experts: the trainer routes its rollouts itself ({why})",
                          stacklevel=2)  # fmt: skip
        device = request.prompt_ids.device
        moved = {k: None if v is None else v.to(device) for k, v in sampled._asdict().items()}
        return SampledTokens(**moved)

    def _complete(self, body: dict[str, Any], deadline: float, index: int | None, prompt: list,
                  request: Any) -> list[tuple]:  # fmt: skip
        """The choices of one request, ``n`` per prompt in prompt order: prompt ``index`` (``prompt``), or with
        ``index`` None all of them (``prompt``: the list of prompts); each checked against ``request``
        (``answers.checked_rows``: its ``max_new_tokens``, its ``vocab`` and ``version`` when it has them)."""
        images = "sampling_params" in body  # ``generate_body``: a prompt with images
        n = body["sampling_params"]["n"] if images else body["n"] * (len(prompt) if index is None else 1)
        doing = f"sampling {n} responses of " + ("the prompts" if index is None else f"prompt {index}")
        route = "/inference/v1/generate" if images else "/v1/completions"
        answer = answer_object(self.call("POST", route, doing, timeout=deadline - time.monotonic(), json=body),
                               self.url, doing)  # fmt: skip
        if images:
            check_expanded(prompt, answer.get("prompt_token_ids"), self.url, index)
        choices = answer["choices"]
        if len(choices) != n or not all(isinstance(c, dict) for c in choices):
            raise BadAnswer(f"{self.url}: {len(choices)} choices came back for n={n} while {doing}")
        choices = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c.get("index"), int) else 0)
        try:
            rows = generate_choices(answer) if images else [choice_tokens(c) for c in choices]
        except (TypeError, ValueError, AttributeError) as err:
            raise BadAnswer(f"{self.url}: its answer while {doing} cannot be read ({type(err).__name__})") from None
        wanted = WeightsVersion.parse(getattr(request, "version", None))
        rows = checked_rows(rows, self.url, doing, int(request.generation.max_new_tokens),
                            getattr(request, "vocab", None), None if wanted is None else wanted.step)  # fmt: skip
        shape = getattr(request, "routes", None)
        if shape is None or images:
            return rows
        owners = [prompt] * len(choices) if index is not None else [p for p in prompt for _ in range(body["n"])]
        texts = [c.get("routed_experts") for c in choices]
        if all(text is None for text in texts):
            return rows  # a server that records none (``sample`` warns)
        return [(*row, decoded_routes(text, len(owner) + len(row[0]) - 1, shape, f"{self.url}: choice {i} of its "
                                      f"answer while {doing}"))
                for i, (row, owner, text) in enumerate(zip(rows, owners, texts))]  # fmt: skip

    def wait_for(self, wanted: WeightsVersion | None, deadline: float) -> None:
        """Return once the server serves ``wanted`` or a later step of its run (a version another process
        pushed); ``ReplicaDown`` at ``deadline``."""
        while wanted is not None and not (self.held is not None and self.held.serves(wanted, newer=True)):
            self.held = self.served_version(deadline - time.monotonic())
            if self.held is not None and self.held.serves(wanted, newer=True):
                return
            if time.monotonic() >= deadline:
                raise ReplicaDown(f"{self.url}: weights version {wanted.step} never arrived (it serves {self.held})")
            time.sleep(0.05)

    def _begin(self, tokens: int) -> None:
        with self._lock:
            if self._outstanding == 0:
                self._busy_since = time.monotonic()
            self._outstanding += tokens

    def _end(self, tokens: int) -> None:
        with self._lock:
            self._outstanding -= tokens
            if self._outstanding == 0 and self._busy_since is not None:
                self.stats.busy_seconds += time.monotonic() - self._busy_since
                self._busy_since = None

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: WeightsVersion) -> PushReport:
        """``Replica.push``; ``weights`` may be an ``adapters.AdapterWeights`` (a LoRA adapter alone, after the
        unmerged base weights were pushed once)."""
        start = time.perf_counter()
        if isinstance(weights, AdapterWeights):
            size = self.push_adapter(weights, version)
            return self.named(version, PushReport(time.perf_counter() - start, size))
        weights = iter(weights)
        first = next(weights, None)
        if first is None:
            raise GenerationServerError(self.url, f"pushing weights version {version.step}: no tensors")
        stream = _chained(first, weights)
        if self.lora is not None:  # full weights: the rollouts name the base model again
            shutil.rmtree(self.lora, ignore_errors=True)
            self.lora = None
        if self.channel is None:  # here, not at setup: by now Lightning has put the policy on its device
            self.channel = "nccl" if first[1].is_cuda else "shm"
        size = self.push_nccl(stream, version) if self.channel == "nccl" else self.push_file(stream, version)
        return self.named(version, PushReport(time.perf_counter() - start, size))

    def named(self, version: WeightsVersion, report: PushReport) -> PushReport:
        """After a push: drop the prefix cache, name the version, count the push."""
        self.call("POST", "/reset_prefix_cache", "dropping the prefix cache")
        self.call("POST", "/update_weight_version", "naming the weights version", json={"new_version": str(version)})
        self.held = version
        with self._lock:
            self.stats.pushes.append(report)
        return report

    def engine(self, timeout: float | None = None) -> str:
        """``vllm`` or ``hf``: who serves (``/v1/models``' ``owned_by``); ``timeout`` as ``model``'s."""
        if self._engine is None:
            self._engine = "hf" if self.listed(timeout).get("owned_by") == "aitraining-pl" else "vllm"
        return self._engine

    def push_adapter(self, adapter: AdapterWeights, version: WeightsVersion) -> int:
        """A LoRA adapter alone: vLLM loads it as a dynamic adapter that the rollouts then name; the HF server
        applies it over its base weights. The adapter's bytes."""
        base = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None
        folder = write_adapter(tempfile.mkdtemp(prefix=PUSH_PREFIX, dir=base), adapter)
        doing = f"pushing the LoRA adapter of weights version {version.step}"
        try:
            if self.engine() == "vllm":
                name = adapter.name or LORA_NAME
                again = self.lora_loaded if adapter.name is None else name in self.adapters
                body = {"lora_name": name, "lora_path": str(folder), "load_inplace": again}
                self.call("POST", "/v1/load_lora_adapter", doing, json=body)
                # vLLM may read it again (its adapter cache): kept until the next of that name
                if adapter.name is None:
                    self.lora_loaded = True
                    folder, self.lora = self.lora, folder
                else:
                    folder, self.adapters[name] = self.adapters.get(name), folder
            else:
                kwargs = {"path": str(folder), "version": str(version), "owner": self.owner}
                answer = self.call("POST", "/collective_rpc", doing, json={"method": "aitraining_pl_load_adapter",
                                                                           "kwargs": kwargs}) or {}  # fmt: skip
                self.refused(answer, version)
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        return adapter.bytes

    def unload_adapter(self, name: str) -> None:
        """Drop the named adapter ``name`` from a ``vllm serve`` (``/v1/unload_lora_adapter``) and its folder."""
        folder = self.adapters.pop(name, None)
        try:
            if folder is not None:
                self.call("POST", "/v1/unload_lora_adapter", f"unloading the LoRA adapter {name}",
                          json={"lora_name": name})  # fmt: skip
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def refused(self, answer: dict[str, Any], version: WeightsVersion) -> None:
        """Raise the first refusal in a ``/collective_rpc`` answer (one result per worker)."""
        refused = [r.get("error") for r in answer.get("results") or [{}] if not (r or {}).get("ok")]
        if refused:
            raise GenerationServerError(self.url, f"it refused weights version {version.step}: {refused[0]} "
                                        "(the previous weights keep serving)")  # fmt: skip

    def push_file(self, weights: Iterable[tuple[str, torch.Tensor]], version: WeightsVersion) -> int:
        """The CPU path: one safetensors file in shared memory, loaded by the worker extension; its bytes."""
        from safetensors.torch import save_file

        base = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None
        folder = tempfile.mkdtemp(prefix=PUSH_PREFIX, dir=base)  # 0700: this user only
        try:
            tensors, storages = {}, set()
            for name, tensor in weights:
                tensor = tensor.detach().to("cpu").contiguous()
                key = tensor.untyped_storage().data_ptr()
                tensors[name] = tensor.clone() if key in storages else tensor  # safetensors refuses shared storage
                storages.add(key)
            path = os.path.join(folder, "weights.safetensors")
            save_file(tensors, path)
            doing = f"pushing weights version {version.step}"
            kwargs = {"path": path, "version": str(version), "owner": self.owner}
            body = {"method": "aitraining_pl_load", "kwargs": kwargs, "timeout": self.timeout}
            self.refused(self.call("POST", "/collective_rpc", doing, json=body) or {}, version)
            return sum(t.numel() * t.element_size() for t in tensors.values())
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def push_nccl(self, weights: Iterable[tuple[str, torch.Tensor]], version: WeightsVersion) -> int:
        """The GPU path: vLLM's NCCL weight transfer (``nccl_transfer``); its bytes. Not run in CI (no GPU)."""
        from aitraining_pl.generation.servers.nccl_transfer import send_weights

        self.transfer, size = send_weights(self, self.transfer, list(weights), str(version))
        return size

    def close(self, release: bool = True) -> None:
        """Free the server's weights for another run (this client's key; not when ``release`` is False: a client that
        never pushed, such as a served teacher's) and close the connections."""
        try:
            if release:
                body = {"method": "aitraining_pl_release", "kwargs": {"owner": self.owner}}
                self.http.post("/collective_rpc", json=body, timeout=5.0)
        except Exception:  # noqa: BLE001 - a server already gone has nothing to free
            pass
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()
        for folder in [self.lora, *self.adapters.values()]:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def _chained(first: tuple[str, torch.Tensor], rest: Iterable[tuple[str, torch.Tensor]]):
    yield first
    yield from rest


def reason(response: Any) -> str:
    """The one-line reason in an error answer (``error``, ``detail`` or ``message``), at most 300 characters."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300].replace("\n", " ")
    if isinstance(body, dict):
        inner = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(inner, dict):
            inner = inner.get("message", inner)
        return str(inner)[:300].replace("\n", " ")
    return str(body)[:300]
