"""An OpenAI-compatible endpoint for the policy being trained, recording every call token-in / token-out.

``AgentEndpoint`` serves ``POST /v1/chat/completions`` and ``GET /v1/models`` (FastAPI, uvicorn in a daemon thread
on 127.0.0.1, a free port) for the policy through a ``RolloutEngine``: whatever ``engine.backend`` is (the policy
itself, a colocated vLLM engine, a generation server) samples, with the run's generation settings.

- **Attribution.** Each episode has its own key, given to its client as the API key (``Authorization: Bearer
  <key>``): calls are attributed by key, never by timing. A key that was never opened, or whose episode is
  finished, gets HTTP 401 / 403 with an OpenAI error body, and nothing is recorded.
- **Rendering.** A request's messages are rendered by the episode path's ``ChatFormat`` (the tokenizer's chat
  template, with the request's tools, BOS first). When they extend an earlier call of the episode, that call's
  messages followed by the assistant message it returned (content and tool calls as returned), the prompt is
  that call's prompt ids, its sampled ids as sampled, and the new messages rendered as a reply
  (``ChatFormat.reply_ids``): the model's text is never re-tokenised, and the prompt extends the earlier call's
  tokens, so both train as one sequence (``recording.split_sequences``). Other messages (a rewritten history)
  are rendered whole.
- **Images.** A user message's content may hold ``image_url`` parts whose URLs are ``data:image/...;base64,`` data
  URLs (any other URL: a 400 naming the field; nothing is fetched). With a vision-language policy (its tokenizer
  carries its processor), each becomes the processor's image placeholder in the rendered chat, expanded into the
  image's tokens (an image of more than ``datamodules.vision.MAX_IMAGE_PIXELS`` pixels, refused from its header, or
  more than ``MAX_IMAGES`` images in one request: a 400 naming the field; images are decoded one at a time), and the
  image's pixel values go with the prompt to the HF decoder (``environments.chat``,
  ``generation.hf.vision_decoding``); each record keeps its prompt's images (``CallRecord.images``), so the trainer's
  log-prob pass sees the same pixel values; image tokens are part of the prompt, never trained on. A text-only
  policy answers an image part with a 400 naming it.
- **Tool calls** in a sampled turn are parsed by the episode path's parser in the chat template's format
  (``environments.tools``) and returned as ``tool_calls`` (``finish_reason: tool_calls``), unless ``tool_choice``
  is ``none``; a call that does not parse is returned as text. ``tool_choice: "required"`` (or a named function)
  is honoured by prefilling the format's call opening (``<tool_call>`` and, for a named function, ``{"name":
  ..., "arguments": ``) after the generation prompt: the prefill is part of the recorded prompt (context, never
  trained as sampled), and the model samples the call from there. ``parallel_tool_calls: false`` stops the turn
  after its first call (``hermes``; ``llama3`` writes one call anyway; ``mistral`` refuses it with a 400).
- **Limits.** A call whose prompt plus ``max_tokens`` (capped as below) is longer than the model's context
  (``max_position_embeddings``, a VL config's in its ``text_config``) gets a 400 (``context_length_exceeded``)
  before anything is sampled, and so does a request whose text is so long that it could not fit (more than
  ``MAX_CHARS_PER_TOKEN`` characters per token of the context), before it is rendered. Rendering runs in a thread of
  its own, never on the server's loop.
  A batch whose sampling fails is sampled again one call at a time, so one episode's bad call fails that call only.
- **Streaming.** ``stream: true`` is answered in OpenAI's server-sent-events format (``protocol.stream_chunks``)
  once the call is sampled: the recorded tokens are the same as without streaming.
- **Sampling.** The policy and its backend are not thread-safe: one sampler thread answers the calls. Those that
  arrive together (within ``batch_window`` seconds of the first, or until every running episode has a call pending)
  are sampled in one ``engine.sample`` per distinct setting, in the episodes' opening order (the same draws whatever
  the arrival order). ``max_tokens`` is capped by ``generation.max_new_tokens``; ``stop`` adds stop strings; the
  request's ``temperature`` / ``top_p`` apply only with ``request_sampling`` (else the run's distribution, which the
  trainer's log-probs are of, samples every call).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import dataclasses
import itertools
import json
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from aitraining_pl.agents.protocol import (
    ChatRequest,
    RequestError,
    assistant_message,
    completion_body,
    conversation_opening,
    parse_request,
    same_turn,
    stream_chunks,
    text_size,
    tool_prefill,
)
from aitraining_pl.agents.recording import CallRecord
from aitraining_pl.datamodules.io import DataValidationError
from aitraining_pl.datamodules.vision import MAX_IMAGES
from aitraining_pl.environments.chat import ChatFormat, chat_ids, image_part_count, vision_chat_format
from aitraining_pl.environments.tools import detect_tool_format, parse_tool_calls
from aitraining_pl.generation.backend import StopRule
from aitraining_pl.models.loading import context_length_of
from aitraining_pl.models.vision import VisionInputs, merge_vision
from aitraining_pl.rollout import RolloutEngine

#: a request whose messages and tools take more characters than this times the model's context cannot fit: it is
#: refused before it is rendered
MAX_CHARS_PER_TOKEN = 64
#: distinct tool lists whose rendering is kept (the least recently used beyond are dropped)
FORMAT_CACHE = 64

EXTRA_HINT = "the agent endpoint needs FastAPI, uvicorn and openai: pip install 'aitraining-pl[agents]'"


def require_agents_extra() -> None:
    """Raise one ``ImportError`` line naming the extra when FastAPI, uvicorn or openai is missing."""
    try:
        import fastapi  # noqa: F401
        import openai  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ImportError(f"{EXTRA_HINT} ({err})") from None


@dataclass
class EpisodeLog:
    """The calls of one episode, by key."""

    records: list[CallRecord] = field(default_factory=list)
    finished: bool = False
    running: bool = True  #: its agent is running (False: opened ahead, waiting for a free worker)
    order: int = 0  #: opening order: a batch samples its calls in this order (the same draws whatever the timing)
    in_flight: list = field(default_factory=list)  #: the conversations (their opening messages) of pending calls
    overlapping: int = 0  #: calls that arrived while a call of another conversation with this key was pending


@dataclass
class _Pending:
    order: int  #: the episode's opening order
    prompt_ids: list[int]
    settings: tuple  #: (max_new_tokens, stop, n, temperature, top_p)
    future: concurrent.futures.Future
    images: list = field(default_factory=list)  #: the prompt's images' vision inputs, in order


class AgentEndpoint:
    """See the module docstring.

    Args:
        engine: the rollout engine (tokenizer, generation settings, backend); ``bind`` swaps it per batch.
        model: the policy (the plain transformers / peft model ``engine.sample`` takes).
        model_name: the model id the endpoint reports (any ``model`` in a request is served by the policy).
        batch_window: seconds the sampler waits after a call for others to sample with it (it samples at once when
            every open episode has a call pending).
        request_sampling: honour a request's ``temperature`` / ``top_p`` (off: the run's settings).
        chat_template: a chat template used instead of the tokenizer's (e.g. a tool-calling one).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        model: torch.nn.Module,
        model_name: str = "policy",
        batch_window: float = 0.05,
        request_sampling: bool = False,
        chat_template: str | None = None,
    ):
        require_agents_extra()
        self.model_name, self.batch_window, self.request_sampling = model_name, batch_window, request_sampling
        self.chat_template = chat_template
        self.episodes: dict[str, EpisodeLog] = {}
        self._lock = threading.Lock()  # guards ``episodes`` and the engine binding
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._formats: collections.OrderedDict[str, tuple[ChatFormat, str | None]] = collections.OrderedDict()
        self._renderer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="agent-endpoint-render")
        self._opened = itertools.count()
        self._server = self._thread = self._sampler = None
        self.port = 0
        self.bind(engine, model)

    # ------------------------------------------------------------------ episodes
    def bind(self, engine: RolloutEngine, model: torch.nn.Module, version: Any = None) -> None:
        """Serve ``model`` with ``engine`` (and record ``version``) from now on."""
        with self._lock:
            if self.chat_template is not None and engine.tokenizer.chat_template != self.chat_template:
                tokenizer = copy.copy(engine.tokenizer)
                tokenizer.chat_template = self.chat_template
                engine = copy.copy(engine)
                engine.tokenizer = tokenizer
            if getattr(self, "engine", None) is None or engine.tokenizer is not self.engine.tokenizer:
                self._formats.clear()
            self.engine, self.model = engine, model
            self.version = version if version is not None else getattr(engine.backend, "version", None)

    def open_episode(self, running: bool = True) -> str:
        """A new episode's key (``running=False``: opened ahead of its agent's start, ``start_episode``)."""
        key = f"ep-{secrets.token_urlsafe(18)}"
        with self._lock:
            self.episodes[key] = EpisodeLog(running=running, order=next(self._opened))
        return key

    def start_episode(self, key: str) -> None:
        """The agent of an episode opened ahead starts (the sampler then waits for its calls too)."""
        with self._lock:
            if key in self.episodes:
                self.episodes[key].running = True

    def finish_episode(self, key: str) -> list[CallRecord]:
        """Close an episode (later calls with its key are refused) and return its records."""
        with self._lock:
            log = self.episodes.get(key)
            if log is None:  # forgotten already
                return []
            log.finished = True
            return list(log.records)

    def overlapping(self, key: str) -> int:
        """Calls of the episode ``key`` that overlapped a pending call of another conversation (0 once forgotten):
        a sign that several agents share one client (a process-global default client)."""
        with self._lock:
            log = self.episodes.get(key)
            return log.overlapping if log is not None else 0

    def forget(self, keys) -> None:
        """Drop finished episodes' records."""
        with self._lock:
            for key in keys:
                self.episodes.pop(key, None)

    def check_key(self, key: str | None) -> None:
        """``RequestError`` (401 / 403) unless ``key`` is an open episode's."""
        with self._lock:
            self._episode(key)

    def _episode(self, key: str | None) -> EpisodeLog:
        log = self.episodes.get(key or "")
        if log is None:
            raise RequestError(401, "unknown API key: not an episode of this endpoint", code="invalid_api_key")
        if log.finished:
            raise RequestError(403, "this episode is finished: its key takes no more calls", code="episode_finished")
        return log

    # ------------------------------------------------------------------ rendering
    def chat_format(self, tools: list[dict]) -> tuple[ChatFormat, str | None]:
        """The ``ChatFormat`` for ``tools`` and the template's tool-call format (None without tools)."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._formats:
            try:
                chat = vision_chat_format(self.engine.tokenizer, tools)
                tool_format = detect_tool_format(chat.template) if tools else None
            except ValueError as err:  # ToolTemplateError: the template cannot show tools
                raise RequestError(400, str(err), "tools") from None
            self._formats[key] = (chat, tool_format)
            while len(self._formats) > FORMAT_CACHE:
                self._formats.popitem(last=False)
        self._formats.move_to_end(key)
        return self._formats[key]

    @property
    def context_length(self) -> int | None:
        """The model's context (``models.loading.context_length_of``: a VL config's from its ``text_config``; None
        when it does not say)."""
        return context_length_of(self.model)

    def _checked_prompt(self, log: EpisodeLog, request: ChatRequest) -> tuple[list[int], list[dict], str, int]:
        """A call's prompt ids (with the tool-call prefill, ``tool_prefill``), its images' vision inputs, the
        prefill's text, and its ``max_new_tokens``; ``RequestError`` when it cannot be rendered or would not fit the
        context."""
        context = self.context_length
        max_new = min(
            request.max_tokens or self.engine.generation.max_new_tokens, self.engine.generation.max_new_tokens
        )
        count = image_part_count(request.messages)
        if count > MAX_IMAGES:
            raise RequestError(400, f"this request has {count} images: more than the {MAX_IMAGES} a call may carry",
                               "messages")  # fmt: skip
        if context is not None:
            size = text_size(request.messages) + len(json.dumps(request.tools))
            if size > context * MAX_CHARS_PER_TOKEN:
                raise RequestError(
                    400, f"this request's messages and tools are {size} characters: more than can fit in the "
                    f"model's context of {context} tokens", "messages", "context_length_exceeded",
                )  # fmt: skip
        try:
            prompt, images = self.prompt_ids(log, request.messages, request.tools)
        except RequestError:
            raise
        except Exception as err:  # the chat template refused the conversation (roles out of order, ...)
            raise RequestError(400, f"the chat template cannot render these messages: {err}", "messages") from None
        chat, tool_format = self.chat_format(request.tools)
        marker, rest = tool_prefill(request, tool_format)
        prompt = prompt + chat.encode(marker) + chat.encode_text(rest)
        if context is not None and len(prompt) + max_new > context:
            raise RequestError(
                400, f"this call's prompt is {len(prompt)} tokens and max_tokens {max_new}: {len(prompt) + max_new} "
                f"is more than the model's context of {context} tokens (shorten the conversation, lower max_tokens "
                "or generation.max_new_tokens)", "messages", "context_length_exceeded",
            )  # fmt: skip
        return prompt, images, marker + rest, max_new

    def prompt_ids(self, log: EpisodeLog, messages: list[dict], tools: list[dict]) -> tuple[list[int], list[dict]]:
        """The prompt of a call (see the module docstring: an extended conversation reuses the sampled ids) and its
        images' vision inputs, in order."""
        chat, _ = self.chat_format(tools)
        tools_key = json.dumps(tools, sort_keys=True)
        for record in reversed(log.records):
            done = len(record.messages)
            if (
                record.tools_key == tools_key
                and len(messages) > done
                and messages[:done] == record.messages
                and same_turn(messages[done], record.assistant)
            ):
                reply, images = self._render(chat, messages[done + 1 :], record.completion_ids, done + 1)
                return record.prompt_ids + record.completion_ids + reply, record.images + images
        return self._render(chat, messages)

    def _render(self, chat: ChatFormat, messages: list[dict], turn_ids=None, first: int = 0):
        """``environments.chat.chat_ids``: a 400 naming the image part a text-only policy cannot take or that is bad."""
        try:
            return chat_ids(chat, messages, turn_ids, first=first, source="the request")
        except DataValidationError as err:
            raise RequestError(400, str(err), err.field) from None

    # ------------------------------------------------------------------ one call
    async def complete(self, key: str | None, body: Any) -> dict | list[dict]:
        """Answer one chat-completions request of the episode ``key`` and record it: the completion body, or with
        ``stream: true`` its chunks (``protocol.stream_chunks``)."""
        request = parse_request(body)
        with self._lock:
            log = self._episode(key)
        opening = json.dumps(conversation_opening(request.messages))
        with self._lock:
            if any(other != opening for other in log.in_flight):
                log.overlapping += 1
            log.in_flight.append(opening)
        try:
            loop = asyncio.get_running_loop()
            checked = await loop.run_in_executor(self._renderer, self._checked_prompt, log, request)
            prompt, images, prefill, max_new = checked
            samples = await self._queued(log, request, prompt, max_new, images)
        finally:
            with self._lock:
                log.in_flight.remove(opening)
        completion = self._answer(key, request, prompt, prefill, samples, images)
        return stream_chunks(completion, request.include_usage) if request.stream else completion

    async def _queued(self, log: EpisodeLog, request: ChatRequest, prompt: list[int], max_new: int, images=()) -> list:
        """The call's samples, from the sampler thread."""
        temperature = request.temperature if self.request_sampling else None
        top_p = request.top_p if self.request_sampling else None
        stop = tuple(request.stop)
        if not request.parallel_tool_calls and request.tools and request.tool_choice != "none":
            stop += ("</tool_call>",)  # hermes: the turn ends with its first call (tool_prefill refuses the others)
        settings = (max_new, stop, request.n, temperature, top_p)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(_Pending(log.order, prompt, settings, future, list(images)))
        return await asyncio.wrap_future(future)

    def _answer(self, key, request: ChatRequest, prompt: list[int], prefill: str, samples: list, images) -> dict:
        """The completion body of ``samples``, each recorded in the episode ``key``."""
        chat, tool_format = self.chat_format(request.tools)
        tokenizer, choices = self.engine.tokenizer, []
        for ids, logprobs, ended in samples:
            text = prefill + tokenizer.decode(ids, skip_special_tokens=True)
            calls = []
            if tool_format is not None and request.tool_choice != "none":
                raw = prefill + tokenizer.decode(ids, skip_special_tokens=False)
                calls = [c for c in parse_tool_calls(raw, tool_format) if not c.error]
            message = assistant_message(text, calls, tool_format or "")
            reason = "tool_calls" if calls else ("stop" if ended else "length")
            pieces = None
            if request.logprobs:
                pieces = []
                for token, lp in zip(ids, logprobs):
                    piece = tokenizer.decode([token], skip_special_tokens=False)
                    pieces.append((piece, list(piece.encode()), lp))
            choices.append({"message": message, "finish_reason": reason, "completion_ids": ids, "logprobs": pieces})
        tools_key = json.dumps(request.tools, sort_keys=True)
        with self._lock:
            log = self._episode(key)  # finished while sampling (timed out): refused, nothing recorded
            for (ids, logprobs, ended), choice in zip(samples, choices):
                log.records.append(
                    CallRecord(
                        prompt, ids, logprobs, ended, self.version, request.messages, choice["message"], tools_key,
                        len(choice["message"].get("tool_calls", [])), images,
                    )
                )  # fmt: skip
        return completion_body(self.model_name, choices, len(prompt))

    # ------------------------------------------------------------------ the sampler thread
    def _waiting_for_all(self, pending: int) -> bool:
        """Whether every open episode has a call pending (nothing more can arrive before one is answered)."""
        with self._lock:
            return pending >= sum(log.running and not log.finished for log in self.episodes.values())

    def _sample_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, deadline = [first], time.monotonic() + self.batch_window
            while not self._waiting_for_all(len(batch)) and (left := deadline - time.monotonic()) > 0:
                try:
                    item = self._queue.get(timeout=min(left, 0.005))
                except queue.Empty:
                    continue
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            groups: dict[tuple, list[_Pending]] = {}
            for item in sorted(batch, key=lambda item: item.order):  # the same draws whatever the arrival order
                groups.setdefault(item.settings, []).append(item)
            for settings, items in groups.items():
                self._serve(settings, items)

    def _serve(self, settings: tuple, items: list[_Pending]) -> None:
        """Sample ``items`` together; if that fails, one at a time (a call's error goes to that call only)."""
        try:
            results = self._sample(settings, [item.prompt_ids for item in items], [item.images for item in items])
        except Exception as err:  # noqa: BLE001 - handed to the waiting call (HTTP 500)
            if len(items) == 1:
                items[0].future.set_exception(err)
            else:
                for item in items:
                    self._serve(settings, [item])
            return
        for item, result in zip(items, results):
            item.future.set_result(result)

    def _engine_for(self, settings: tuple) -> RolloutEngine:
        max_new, stop, _, temperature, top_p = settings
        engine = copy.copy(self.engine)
        changes: dict[str, Any] = {"max_new_tokens": max_new}
        if temperature is not None:
            changes.update(temperature=max(temperature, 1e-5), do_sample=temperature > 0)
        if top_p is not None:
            changes["top_p"] = top_p
        engine.generation = dataclasses.replace(engine.generation, **changes)
        if stop:
            rule = engine.stop_rule
            engine.stop_rule = StopRule(
                engine.tokenizer, [*rule.stop_strings, *stop], rule.stop_sequences, rule.skip_special_tokens
            )
        return engine

    @torch.no_grad()
    def _sample(self, settings: tuple, prompts: list[list[int]], images: list[list[dict]]) -> list[list[tuple]]:
        """``n`` samples of each prompt (with its ``images``' vision inputs): per prompt, per sample, (ids, log-probs,
        ended)."""
        with self._lock:
            engine, model = self._engine_for(settings), self.model
        n = settings[2]
        device = next(model.parameters()).device
        pad = engine.pad_token_id(model, engine.end_token_ids(model))
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(prompts):
            ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
        vision = VisionInputs([merge_vision(i) for i in images]) if any(images) else None
        rollout = engine.sample(model, ids.to(device), mask.to(device), n, with_logprobs=True, vision=vision)
        lengths = rollout.response_mask.sum(1).tolist()
        logps = rollout.sampling_logprobs
        rows = [
            (
                rollout.response_ids[r, :length].tolist(),
                [0.0] * length if logps is None else logps[r, :length].float().tolist(),
                bool(rollout.ended[r]),
            )
            for r, length in enumerate(lengths)
        ]
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))]

    # ------------------------------------------------------------------ the server
    def app(self):
        """The FastAPI application (``agents.server``)."""
        from aitraining_pl.agents.server import build_app

        return build_app(self)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``http://127.0.0.1:<port>/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> AgentEndpoint:
        """Start the server and the sampler thread (idempotent)."""
        if self._server is not None:
            return self
        import uvicorn

        from aitraining_pl.agents.server import server_config

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(server_config(self.app()))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._sampler = threading.Thread(target=self._sample_loop, daemon=True, name="agent-endpoint-sampler")
        self._thread.start()
        self._sampler.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the agent endpoint's server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop the server and the sampler thread."""
        if self._server is None:
            return
        self._server.should_exit = True
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._sampler.join(timeout=10)
        self._server = self._thread = self._sampler = None

    def __enter__(self) -> AgentEndpoint:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
