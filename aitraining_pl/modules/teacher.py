"""The teacher of on-policy distillation (``modules.distill``), an object the module holds: in this process
(``LocalTeacher``) or on a server (``served_teacher`` of a checked ``teacher_server``: ``generation.servers.teacher.
HTTPTeacher`` over the engine's HTTP routes), either way outside the module tree (never checkpointed, never
exported).

What a teacher gives is checked before it is used: its log-probs must be one finite value per response column
(``checked_logprobs``: a served teacher's NaN, a missing column or a single column broadcast over the response would
otherwise train silently or fail as a raw tensor error), and it must score every token of the student's tokenizer
(``check_vocabularies``: the two tokenizers are compared, not the embeddings' row counts, which checkpoints pad:
Qwen2.5-7B has 152064 rows, 0.5B 151936, with one tokenizer)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from aitraining_pl.errors import ConfigError, GenerationServerError
from aitraining_pl.losses import positions_from_mask
from aitraining_pl.models.lora import base_model
from aitraining_pl.models.rollout_scoring import response_logps
from aitraining_pl.models.sharding import as_forward
from aitraining_pl.models.training import eval_mode
from aitraining_pl.models.vision import is_vision_model, model_inputs

#: the keys of ``teacher_server`` (``url``: the engine's HTTP routes; ``launch``: a server the trainer starts)
SERVER_KEYS = ("url", "timeout", "token_file", "launch", "devices")
#: a served teacher's URL when ``teacher_server`` names none
DEFAULT_TEACHER_URL = "http://127.0.0.1:8000"


class TeacherScorer(Protocol):
    """What scores the student's tokens with the teacher. A served teacher implements ``token_logprobs``."""

    def token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, temperature: float
    ) -> torch.Tensor:
        """(N, R) teacher log-probs (logits / ``temperature``) of the response tokens of rollout rows (N, P + R)."""
        ...


def response_hidden(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, mask,
    vision: Any = None,
) -> torch.Tensor:  # fmt: skip
    """(M, H) last hidden states predicting the response tokens where ``mask`` (N, R), row-major: the decoder only,
    no LM head (the distillation loss runs both heads fused). Positions as ``generate`` counts left-padded rows.
    ``vision``: the rows' images (``models.vision.VisionInputs``) for a VL model, whose base model (vision encoder,
    projector, language model) runs with them."""
    lm = base_model(model)

    def run() -> torch.Tensor:
        if vision is not None:
            out = lm.model(**model_inputs(model, input_ids, attention_mask, vision), use_cache=False)
        else:
            out = lm.get_decoder()(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions_from_mask(attention_mask),
                use_cache=False,
            )
        return out.last_hidden_state[:, prompt_length - 1 : -1][mask.bool()]

    return as_forward(model, run)


class LocalTeacher:
    """The teacher LM in this process: frozen, in eval mode, held in a list so that no owner registers it (never in
    a ``state_dict``, an optimizer or a DDP/FSDP wrapping); ``to`` moves it.

    Args:
        model: the teacher (a transformers causal LM, or a VL model, ``AutoModelForImageTextToText``, which scores
            rows with their prompts' images).
    """

    def __init__(self, model: torch.nn.Module):
        model.eval().requires_grad_(False)
        self._model = [model]

    @property
    def model(self) -> torch.nn.Module:
        return self._model[0]

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> LocalTeacher:
        self.model.to(device=device, dtype=dtype)
        return self

    def rows(self) -> int:
        """Rows of the teacher's output embedding (its vocabulary, padding rows included)."""
        return int(base_model(self.model).get_output_embeddings().weight.shape[0])

    @property
    def sees_images(self) -> bool:
        """Whether the teacher is a VL model (it scores rows with their images)."""
        return is_vision_model(self.model)

    @torch.no_grad()
    def token_logprobs(
        self, input_ids, attention_mask, prompt_length: int, temperature: float, vision: Any = None
    ) -> torch.Tensor:
        """``TeacherScorer.token_logprobs``; ``vision``: the rows' images, for a VL teacher (``models.vision_scoring``,
        each prompt's pixel values held once: ``VisionInputs.rows``)."""
        with eval_mode(self.model):
            return response_logps(
                self.model, input_ids, attention_mask, prompt_length, temperature, vision=vision
            ).logprobs

    @torch.no_grad()
    def hidden(self, input_ids, attention_mask, prompt_length: int, mask, vision: Any = None) -> torch.Tensor:
        """(M, H_T) the teacher's hidden states predicting the response tokens where ``mask`` (with the rows' images,
        ``vision``, for a VL teacher)."""
        with eval_mode(self.model):
            return response_hidden(self.model, input_ids, attention_mask, prompt_length, mask, vision)


def teacher_rows(teacher: Any) -> int | None:
    """The teacher's vocabulary rows: a local teacher's output embedding, a served one's ``vocab_size`` (asked of
    the server); None when unknown."""
    rows = getattr(teacher, "rows", None) or getattr(teacher, "vocab_size", None)
    return rows() if rows is not None else None


def checked_logprobs(
    scores: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, teacher: str
) -> torch.Tensor:
    """``scores`` when they are the teacher's log-probs of rows ``input_ids`` (N, P + R): a float tensor of (N, R),
    finite on every response token (``attention_mask``), at most 0; else one ``GenerationServerError`` line naming
    ``teacher`` (a served teacher's answer is never broadcast, padded or trusted as it came)."""
    want = (input_ids.shape[0], input_ids.shape[1] - prompt_length)
    shape = tuple(getattr(scores, "shape", ()))
    if not torch.is_tensor(scores) or shape != want:
        raise GenerationServerError(
            teacher,
            f"returned log-probs of shape {shape} for {want[0]} rows of {want[1]} response tokens: one log-prob per "
            "response token is needed (is it serving the student's tokenizer and this version of the protocol?)",
        )
    scored = attention_mask[:, prompt_length:].bool()
    values = scores[scored].float()
    bad = ~torch.isfinite(values) | (values > 1e-4)
    if bool(bad.any()):
        row = int(torch.nonzero(scored, as_tuple=True)[0][bad.nonzero()[0, 0]])
        raise GenerationServerError(
            teacher,
            f"returned {int(bad.sum())} log-probs that are not finite numbers <= 0 (first in row {row}: "
            f"{float(values[bad][0])}); the teacher's scores are not used",
        )
    return scores


def check_vocabularies(student_tokenizer: Any, teacher_tokenizer: Any, rows: int | None, where: str) -> None:
    """One ``ConfigError`` before training when the teacher cannot score the student's tokens: its tokenizer (when
    known) is not the student's (another vocabulary or other ids), or it has fewer vocabulary ``rows`` than the
    student's tokenizer has tokens. Rows beyond the tokenizer (a checkpoint's padding) are allowed."""
    if teacher_tokenizer is not None:
        ours, theirs = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
        if ours != theirs:
            only = sorted(set(ours) ^ set(theirs))[:3]
            moved = [t for t in set(ours) & set(theirs) if ours[t] != theirs[t]][:3]
            detail = f"tokens in one only: {only}" if only else f"tokens with other ids: {sorted(moved)}"
            raise ConfigError(
                where,
                f"the teacher's tokenizer differs from the student's ({len(theirs)} vs {len(ours)} tokens; {detail}): "
                "distillation compares next-token distributions over one shared vocabulary",
            )
    size = len(student_tokenizer)
    if rows is not None and rows < size:
        raise ConfigError(
            where,
            f"the teacher's vocabulary has {rows} rows, fewer than the student's tokenizer's {size} tokens: it cannot "
            "score every token the student samples (the teacher's tokenizer differs from the student's?)",
        )


def check_teacher_server(server: Any, mode: str) -> None:
    """A ``ConfigError`` for a ``teacher_server`` that is not ``{url or launch, timeout, token_file}`` (``host`` /
    ``port``, the frame protocol's, name what replaced them), or with ``mode: full`` (it needs the teacher's whole
    distribution, hence the teacher in this process)."""
    where = "DistillationModule.teacher_server"
    if isinstance(server, dict) and {"host", "port"} & set(server):
        raise ConfigError(f"{where}.host / port", "named a teacher on the frame protocol of `aitraining-pl serve "
                          "--teacher`, which was removed: give url (a `vllm serve` or the HF server with --teacher, "
                          "e.g. http://127.0.0.1:8000) or launch: vllm | hf (docs/distillation.md)")  # fmt: skip
    if not isinstance(server, dict) or set(server) - set(SERVER_KEYS):
        raise ConfigError(where, f"a mapping with keys among {', '.join(SERVER_KEYS)}, got {server!r}")
    if {"url", "launch"} <= set(server):
        raise ConfigError(where, "give one of url (a vllm serve or the HF server) or launch (vllm or hf: a server the "
                          "trainer starts), not url and launch")  # fmt: skip
    if "devices" in server and "launch" not in server:
        raise ConfigError(f"{where}.devices", "the GPUs of a launched teacher server: give launch too")
    if "launch" in server and server["launch"] not in ("vllm", "hf"):
        raise ConfigError(
            f"{where}.launch", f"vllm or hf (the engine of the server to start), got {server['launch']!r}"
        )
    if "url" in server:
        from aitraining_pl.generation.config import check_url

        check_url(server["url"], f"{where}.url")
    if mode != "sampled":
        why = "(mode: full needs the teacher's whole distribution: the teacher in this process)"
        raise ConfigError(
            where, f"a served teacher gives the log-probs of the sampled tokens only: mode: sampled {why}"
        )


def served_teacher(server: dict[str, Any], model: str | None = None) -> TeacherScorer:
    """The teacher of a checked ``teacher_server``: an ``HTTPTeacher`` at its ``url`` (the default) or on a server
    it launches for ``model`` (``launch``)."""
    where = "DistillationModule.teacher_server"
    from aitraining_pl.generation.servers.teacher import HTTPTeacher

    timeout = float(server.get("timeout", 240.0))
    if "launch" in server:
        if not model:
            raise ConfigError(f"{where}.launch", "starts a server for teacher_model_name (a folder or hub id): give it")
        return HTTPTeacher(timeout=timeout, setting=where, launch=server["launch"], model=model,
                           devices=server.get("devices"))  # fmt: skip
    return HTTPTeacher(server.get("url", DEFAULT_TEACHER_URL), server.get("token_file"), timeout, where)
