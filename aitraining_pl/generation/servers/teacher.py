"""``HTTPTeacher``: a distillation teacher on a server that speaks the engine's own HTTP routes
(``DistillationModule(teacher_server={"url": ...})``): a plain ``vllm serve --model <teacher>``, this project's HF
server started with ``--teacher``, or one the trainer launches for ``teacher_model_name`` (``teacher_server: {launch:
vllm | hf}``: in each process that scores, at its first scoring, with the teacher's own weights).

The teacher's log-probs of the student's rows come from vLLM's ``/v1/completions`` with each row's tokens (its
attention mask's, unpadded) as the prompt's token ids, ``max_tokens: 1`` and ``prompt_logprobs: 0``: each choice's
``prompt_logprobs`` is one entry per prompt token, ``None`` for the first and else ``{"<token id>": {"logprob": ...,
"rank": ..., "decoded_token": ...}}`` for the given token (vLLM 0.32, ``CompletionResponseChoice.prompt_logprobs``;
with ``prompt_logprobs: 0`` only the given token is listed). The log-prob of each given token is read under its own
id, never re-tokenised; an entry missing or under another id is refused. vLLM computes them from the raw logits
(its ``logprobs_mode`` does not apply to prompt tokens), so they are at temperature 1 only, and reads no prefix cache
for a request with ``prompt_logprobs`` (``SamplingParams.skip_reading_prefix_cache``), so every token is scored. The
rows are sent concurrently (vLLM batches them).

The requests are ``HTTPReplica.call``'s (the run's token as ``Authorization: Bearer``, found as for a generation
server: ``token_file``, else ``AITRAINING_PL_SERVER_TOKEN``, else the file a loopback ``aitraining-pl vllm-serve``
wrote). Any failure, nothing listening, a timeout, a 401, a refused request or a malformed answer, is one
``GenerationServerError`` line naming ``teacher server <url>``; NaN and out-of-range values are refused by the
module's ``checked_logprobs``. The teacher never pushes and owns nothing on the server."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

import torch

from aitraining_pl.errors import ConfigError, GenerationServerError
from aitraining_pl.generation.config import VLLMConfig, check_url
from aitraining_pl.generation.servers.auth import find_token
from aitraining_pl.generation.servers.http import HTTPReplica
from aitraining_pl.generation.servers.replica import ReplicaDown


def prompt_logprobs_of(entries: Any, tokens: list[int], doing: str) -> list[float]:
    """The log-prob of each of ``tokens`` but the first from a choice's ``prompt_logprobs`` ``entries`` (one per
    token; each a mapping from the token's id, as text, to its ``{"logprob": ...}``); a ``ValueError`` naming what is
    wrong for an answer of another length, a missing entry or one under another id."""
    if not isinstance(entries, list) or len(entries) != len(tokens):
        count = len(entries) if isinstance(entries, list) else "no"
        raise ValueError(f"{count} prompt log-probs came back for {len(tokens)} tokens while {doing} (a server that "
                         "answers prompt_logprobs: vllm serve, or the HF server)")  # fmt: skip
    values = []
    for position in range(1, len(tokens)):
        entry = entries[position]
        item = entry.get(str(tokens[position])) if isinstance(entry, dict) else None
        value = item.get("logprob") if isinstance(item, dict) else item
        if not isinstance(value, (int, float)):
            raise ValueError(f"no log-prob of the given token {tokens[position]} at position {position} while {doing}")
        values.append(float(value))
    return values


class HTTPTeacher:
    """The ``TeacherScorer`` of ``modules.distill`` on a server at ``url`` (see the module docstring); it connects
    when first used (again in each process it is copied to).

    Args:
        url: the server's base URL, ``http://host:port``.
        token_file: a file holding the run's token (else ``AITRAINING_PL_SERVER_TOKEN``, else the file a loopback
            ``aitraining-pl vllm-serve`` wrote; none: a server without the token middleware).
        timeout: seconds one scoring call may take (and a launched server to start).
        setting: where these are configured (messages name it).
        launch: instead of ``url``, start a server of this engine (``vllm`` or ``hf``) for ``model`` in this process
            at the first use (``start.start``: loopback, a fresh token, GPUs of its own), stopped by ``close`` (the
            module's ``teardown``) or with this process.
        model: the teacher's folder or hub id (``launch``).
        devices: the launched server's GPUs (indices of the visible ones; default: those after the trainer's).
    """

    kind = "teacher server"  #: how messages name it (``DistillationModule.teacher_name``)
    model = None  #: no model in this process

    def __init__(self, url: str | None = None, token_file: str | None = None, timeout: float = 240.0,
                 setting: str = "teacher_server", launch: str | None = None, model: str | None = None,
                 devices: list[str] | None = None):  # fmt: skip
        self.setting, self.timeout, self.launch = setting, float(timeout), launch
        self.model_name, self.devices = model, devices
        self.server: Any = None  #: the launched server (``start.ServerProcess``), once started
        self._replica: HTTPReplica | None = None
        if launch is not None:
            if launch not in ("vllm", "hf") or not model:
                raise ConfigError(f"{setting}.launch", f"vllm or hf, with the teacher's folder or hub id "
                                  f"(teacher_model_name), got {launch!r} for {model!r}")  # fmt: skip
            self.url = self.address = f"(a {launch} server launched for {model})"
            return
        check_url(url, f"{setting}.url")
        parts = urlsplit(str(url))
        if parts.scheme not in ("http", "https"):
            raise ConfigError(f"{setting}.url", f"{url!r}: a teacher is served over http(s) (vllm serve, the HF "
                              "server)")  # fmt: skip
        self.url = self.address = str(url).rstrip("/")
        self.options = VLLMConfig(server_host=parts.hostname, server_port=parts.port, server_token_file=token_file)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_replica": None, "server": None}  # a copy (another process) opens its own

    def replica(self) -> HTTPReplica:
        """The connection (``HTTPReplica``: its requests and error handling), opened at the first use (after
        starting the server, with ``launch``)."""
        if self._replica is None:
            if self.launch is not None:
                self.server = self.start()
                self.url = self.address = self.server.url
                token = self.server.token
            else:
                token = find_token(self.options, f"{self.setting}.token_file")
            self._replica = HTTPReplica(self.url, token, timeout=self.timeout)
        return self._replica

    def start(self) -> Any:
        """Launch the teacher's server (``launch``) and wait until it answers; one line with the end of its log
        when it does not start."""
        import tempfile
        from pathlib import Path

        from aitraining_pl.generation.servers.start import start

        folder = Path(tempfile.mkdtemp(prefix="aitraining-pl-teacher-"))  # the token and the log (deleted with it)
        try:
            return start(self.launch, folder, options=VLLMConfig(), teacher=self.model_name, timeout=self.timeout,
                         devices=self.devices)  # fmt: skip
        except RuntimeError as err:
            tail = " | ".join(line for line in str(err).splitlines()[1:] if line.strip())[-600:]
            raise self.error(f"the launched {self.launch} server did not start: {tail}") from None

    def to(self, *args: Any, **kwargs: Any) -> HTTPTeacher:
        return self  # the weights live on the server

    def error(self, what: str) -> GenerationServerError:
        return GenerationServerError(f"{self.kind} {self.url}", what)

    @torch.no_grad()
    def token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, temperature: float
    ) -> torch.Tensor:
        """(N, R) the served teacher's log-probs of the response tokens of rows (N, P + R), float32 (0 on padding)."""
        if float(temperature) != 1.0:
            raise ConfigError(self.setting, f"a served teacher's log-probs are at temperature 1 (vLLM's prompt "
                              f"log-probs are of the raw logits), not {float(temperature):g}")  # fmt: skip
        kept = attention_mask.bool().cpu()
        rows = [ids[keep].tolist() for ids, keep in zip(input_ids.cpu(), kept)]
        deadline = time.monotonic() + self.timeout
        replica = self.replica()
        try:
            model = replica.model(deadline - time.monotonic())  # the deadline from the first call on
            futures = [replica.pool.submit(self._score, model, tokens, i, deadline) for i, tokens in enumerate(rows)]
            scored = [future.result() for future in futures]
        except ReplicaDown as err:
            what = str(err).removeprefix(f"{self.url}: ")
            raise self.error(f"{what} (teacher_server.timeout {self.timeout:g} s); a run that had started resumes "
                             "from its last checkpoint with --ckpt_path") from None  # fmt: skip
        except GenerationServerError as err:  # HTTPReplica's line names the URL alone
            raise self.error(err.why) from None
        out = torch.zeros(input_ids.shape[0], input_ids.shape[1] - prompt_length)
        for row, values in enumerate(scored):
            index = kept[row].long().cumsum(0) - 1  # each column's place in the unpadded row
            for column in range(prompt_length, input_ids.shape[1]):
                if kept[row, column]:
                    place = int(index[column])
                    out[row, column - prompt_length] = values[place - 1] if place >= 1 else float("nan")
        return out.to(input_ids.device)

    def _score(self, model: str, tokens: list[int], row: int, deadline: float) -> list[float]:
        """The teacher's log-probs of ``tokens[1:]`` (one row)."""
        doing = f"scoring row {row} ({len(tokens)} tokens) with the teacher"
        body = {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
                "return_tokens_as_token_ids": True}  # fmt: skip
        replica = self.replica()
        answer = replica.call("POST", "/v1/completions", doing, timeout=deadline - time.monotonic(), json=body) or {}
        choices = answer.get("choices") or [{}]
        try:
            return prompt_logprobs_of(choices[0].get("prompt_logprobs"), tokens, doing)
        except ValueError as err:
            raise self.error(str(err)) from None

    def close(self) -> None:
        """Close the connections and stop a launched server (the next use launches it again)."""
        replica, self._replica = self._replica, None
        if replica is not None:
            replica.close(release=False)
        server, self.server = self.server, None
        if server is not None:
            server.stop()
