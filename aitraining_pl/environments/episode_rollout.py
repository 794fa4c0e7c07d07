"""Episodes as rollouts: the rollout engine's settings, a multi-turn decoder and an episode environment give the
same ``Rollout`` the online modules train on, with holes in the response mask where the environment spoke.

The token sequence of an episode is exactly: the prompt tokens, each turn's tokens as sampled, and each reply
of the environment rendered by the chat template and appended as tokens (``ChatFormat.reply_ids``), up to the
end. ``response_mask`` is 1 on sampled tokens only; ``response_attention`` on every real token. Each turn's
reward sits on that turn's last sampled token (``EpisodeInfo.token_rewards``); the episode return is their sum.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from aitraining_pl.datamodules.formats import FALLBACK_CHAT_TEMPLATE
from aitraining_pl.environments.episode import AssistantTurn, EpisodeEnvironment
from aitraining_pl.environments.episode_guard import guarded_reset, guarded_step
from aitraining_pl.environments.tools import ToolTemplateError
from aitraining_pl.environments.vision_chat import chat_ids, vision_chat_format, without_pixels
from aitraining_pl.generation.hf.episode_decoding import EpisodeTokens, TurnSample, decode_episodes, decode_turns
from aitraining_pl.generation.hf.generate import hf_generation_config
from aitraining_pl.models.tokens import padded, with_bos
from aitraining_pl.models.training import eval_mode
from aitraining_pl.models.vision import VisionInputs, merge_vision, processor_of
from aitraining_pl.rewards import DEFAULT_REWARD_TIMEOUT
from aitraining_pl.rollout import Rollout, RolloutEngine

#: a content's slot in a reply rendered to find the template's own text (plain ASCII: kept by ``trim``, ``tojson``)
_SLOT = "AITPLSLOT"
#: content of the assistant message whose rendering shows what a template writes after an assistant turn
_MARK = "\u2063ASSISTANT-TURN\u2063"


def check_assistant_turns(template: str, render=None) -> None:
    """``ValueError`` (one line saying what the template must render) unless ``template`` writes an assistant
    message's content and marks it as the assistant's (its rendering differs from the same text as a user's).
    ``render(messages)`` renders with the tokenizer; default: the template alone (no tokenizer, e.g. when an
    environment is built)."""
    if render is None:
        from transformers.utils.chat_template_utils import render_jinja_template

        def render(messages):
            return render_jinja_template([messages], chat_template=template, bos_token="", eos_token="")[0][0]

    user = {"role": "user", "content": "x"}
    try:
        head = render([user, {"role": "assistant", "content": _MARK}])
        same = head == render([user, {"role": "user", "content": _MARK}])
    except Exception:  # noqa: BLE001 - a template that refuses two user messages in a row distinguishes roles
        head, same = render([user, {"role": "assistant", "content": _MARK}]), False
    if _MARK not in head or same:
        raise ValueError(
            "the chat template does not mark assistant turns: it must render an assistant message's content, with "
            "markers of its own that differ from a user message's (e.g. <|im_start|>assistant ... <|im_end|>)"
        )


class ChatFormat:
    """Token ids of an episode's prompt and of the environment's replies, from the tokenizer's chat template
    (``FALLBACK_CHAT_TEMPLATE`` when it has none).

    A reply is what rendering the conversation with the reply adds after rendering it without (the delta of
    ``[user, assistant] + reply`` over ``[user, assistant]``, with the generation prompt), preceded by what
    the template writes after an assistant turn's text (``<|im_end|>\\n``, ``<|eot_id|>``, ``</s>``) less
    the end token the model already sampled. Replies are rendered without the tool list (templates such as
    Mistral's move it to the last user message; the prompt already showed it). Every string of the messages and
    tools (contents, names, tool-call arguments, tool descriptions) is tokenised as plain text, in the prompt as in
    a reply: a tool result or a user message holding ``<|im_start|>`` gets the characters, never the special token
    (``_plain_tokens``).

    Args:
        tokenizer: a Hugging Face tokenizer.
        tools: JSON schemas shown in the prompt; a template that never reads ``tools`` raises
            ``ToolTemplateError``.
        image_placeholder: a VL model's image placeholder (``datamodules.vision.image_placeholder``): where a
            content spells it, it is tokenised with its special tokens (an image's place, which
            ``environments.vision_chat`` puts there for an image part and expands into the image's tokens).
    """

    def __init__(self, tokenizer, tools: Sequence[dict] = (), image_placeholder: str | None = None):
        self.tokenizer, self.tools = tokenizer, list(tools) or None
        self.image_placeholder = image_placeholder
        self.template = getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        if self.tools and "tools" not in self.template:
            raise ToolTemplateError(
                "tools are configured but the tokenizer's chat template does not render them (it never reads the "
                "`tools` variable): use a tool-calling template (Qwen2.5 / Hermes, Llama 3.1+, Mistral v0.3+)"
            )
        self._base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        self._head = self.render(self._base)
        check_assistant_turns(self.template, self.render)
        self.glue_ids = self.encode(self._head[self._head.rindex(_MARK) + len(_MARK) :])
        self._replies: dict[str, list[int]] = {}  # rendered replies by their messages (games repeat them)
        added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)  # special tokens' spellings
        self._added = re.compile("|".join(map(re.escape, added))) if added else None

    def render(self, messages: list[dict], tools=None, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, chat_template=self.template, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first messages with the tools and the generation prompt, BOS first (as the data module does); every
        string of the messages and tools as plain text."""
        text = self.render(messages, self.tools, generation_prompt=True)
        ids = self._plain_tokens(
            lambda v: self.render(v[0], v[1], generation_prompt=True), (messages, self.tools), text
        )
        return with_bos(ids, self.tokenizer)

    def reply_ids(self, messages: list[dict], turn_ids: Sequence[int]) -> list[int]:
        """Tokens appended after a turn that ended with ``turn_ids``: the rest of the template's end of an
        assistant turn, then the reply messages and the generation prompt."""
        glue = self.glue_ids
        if glue and turn_ids and turn_ids[-1] == glue[0]:
            glue = glue[1:]
        key = json.dumps(messages, sort_keys=True, default=str)
        if key not in self._replies:
            head, full = self._head, self.render(self._base + list(messages), generation_prompt=True)
            if not full.startswith(head):
                raise ValueError(
                    "the chat template renders a conversation differently once a reply is added, so replies cannot "
                    f"be appended as tokens: {head[-80:]!r} is not the start of {full[len(head) - 80 :][:160]!r}"
                )
            if len(self._replies) > 4096:
                self._replies.clear()
            reply = lambda v: self.render(self._base + v, generation_prompt=True)[len(head) :]  # noqa: E731
            self._replies[key] = self._plain_tokens(reply, list(messages), full[len(head) :])
        return glue + self._replies[key]

    def encode_text(self, text: str) -> list[int]:
        """``text`` as plain text: a special token's spelling in it (``<|im_start|>``) is not that token."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []

    def _content_ids(self, text: str) -> list[int]:
        """A content's ``text`` as plain text, but for the image placeholders in it (with their special tokens)."""
        if not self.image_placeholder or self.image_placeholder not in text:
            return self.encode_text(text)
        pieces = text.split(self.image_placeholder)
        ids = self.encode_text(pieces[0])
        for piece in pieces[1:]:
            ids += self.encode(self.image_placeholder) + self.encode_text(piece)
        return ids

    def _slotted(self, value, slots: list[str]):
        """``value`` with each string (or mapping key) that holds a special token's spelling replaced by a slot
        (``slots`` collects them in order)."""
        if isinstance(value, str):
            if not self._added.search(value):
                return value
            slots.append(value)
            return f"{_SLOT}{len(slots) - 1}Z"
        if isinstance(value, dict):
            return {self._slotted(k, slots): self._slotted(v, slots) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._slotted(v, slots) for v in value]
        return value

    def _plain_tokens(self, render, value, text: str) -> list[int]:
        """Tokens of ``text = render(value)``: the template's own text with its special tokens, every string of
        ``value`` that spells a special token as plain text (``encode_text``), so content cannot forge a turn.

        The template's text is ``render`` of ``value`` with those strings replaced by slots (``_slotted``); each
        slot is then matched, at its known place, against the ways a template writes a string (as is, trimmed, or
        JSON-escaped by ``tojson``), so a content that repeats the template's markers cannot shift the places."""
        slots: list[str] = []
        slotted = self._slotted(value, slots) if self._added is not None else value
        if not slots:
            return self.encode(text)  # nothing to forge: the whole text at once
        pieces = re.split(f"{_SLOT}(\\d+)Z", render(slotted))
        ids, at = self.encode(pieces[0]), len(pieces[0])
        for index, piece in zip(pieces[1::2], pieces[2::2]):
            original = slots[int(index)]
            forms = (
                original,
                original.strip(),
                json.dumps(original)[1:-1],
                json.dumps(original, ensure_ascii=False)[1:-1],
            )
            form = next((f for f in forms if text.startswith(f + piece, at)), None)
            if form is None:
                raise ValueError(
                    "the chat template renders a message's text differently from its content (not as is, trimmed, "
                    "nor JSON-escaped), so it cannot be tokenised without its special tokens"
                )
            ids += self._content_ids(form) + self.encode(piece)
            at += len(form) + len(piece)
        if at != len(text):
            raise ValueError("the chat template renders these messages differently with the same text")
        return ids


@dataclass
class EpisodeInfo:
    """What an episode rollout adds to a ``Rollout`` (rows as in the rollout)."""

    response_attention: torch.Tensor  #: (N, R) 1 on every real token after the prompt (model and environment)
    token_rewards: torch.Tensor  #: (N, R) each turn's reward on its last sampled token
    returns: torch.Tensor  #: (N,) episode returns (sum of the turn rewards)
    metrics: dict[str, list[float]]  #: per episode: turns, tool_calls, tool_errors, truncated, env metrics
    transcripts: list[list[dict]]  #: per episode: the assistant turns and replies as messages
    prefilled: list[int] = field(default_factory=list)  #: tokens prefilled before each turn
    sampled: list[int] = field(default_factory=list)  #: tokens sampled in each turn
    #: (N,) long: the episode each row belongs to, where an episode gives several rows (``agents``: one per
    #: sequence); None: row ``i`` is episode ``i``
    episode: torch.Tensor | None = None


class _Episodes:
    """The environments of a batch and the ``respond`` callback of the decoder; for a VL policy (``processor``),
    each row's images so far (``images``: per-image vision inputs, in order)."""

    def __init__(
        self, environment: EpisodeEnvironment, chat: ChatFormat, tokenizer, rows: int, max_new_tokens: int, timeout
    ):
        self.envs, self.timeout = [environment.spawn() for _ in range(rows)], timeout
        self.vision = processor_of(tokenizer) is not None  # a VL policy
        self.images: list[list[dict]] = [[] for _ in range(rows)]
        self.chat, self.tokenizer, self.limits, self.max_new = chat, tokenizer, environment.limits, max_new_tokens
        self.length = [0] * rows
        self.done = [False] * rows
        self.rewards: list[list[float]] = [[] for _ in range(rows)]
        self.metrics: list[dict[str, float]] = [{"turns": 0.0, "truncated": 0.0} for _ in range(rows)]
        self.transcripts: list[list[dict]] = [[] for _ in range(rows)]

    def __call__(self, turn: int, rows: list[int], turns: list[list[int]], ended: list[bool]) -> list:
        replies = []
        for r, ids, closed in zip(rows, turns, ended):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            raw = self.tokenizer.decode(ids, skip_special_tokens=False)
            result = guarded_step(self.envs[r], AssistantTurn(text, raw, list(ids), closed, turn), self.timeout)
            self.rewards[r].append(result.reward)
            self.metrics[r]["turns"] += 1
            for key, value in result.metrics.items():
                self.metrics[r][key] = self.metrics[r].get(key, 0.0) + value
            self.transcripts[r].append({"role": "assistant", "content": text})
            self.length[r] += len(ids)
            reply = None
            if result.done:
                self.done[r] = True
            elif turn + 1 < self.limits.max_turns:
                reply, images = self.reply(result, ids)
                if self.length[r] + len(reply) + self.max_new > self.limits.max_total_tokens:
                    reply = None
            if reply is None:
                self.metrics[r]["truncated"] = float(not self.done[r])
            else:
                self.length[r] += len(reply)
                self.images[r] += images
                self.transcripts[r] += [without_pixels(m) for m in result.messages]
            replies.append(reply)
        return replies

    def reply(self, result, turn_ids: list[int]) -> tuple[list[int], list[dict]]:
        """A reply's tokens (image tokens expanded) and its images' vision inputs."""
        where, source = "EpisodeStep.messages", "the environment's reply"
        return chat_ids(self.chat, result.messages, turn_ids, result.images, where=where, source=source)


def sample_episodes(
    engine: RolloutEngine,
    model: torch.nn.Module,
    environment: EpisodeEnvironment,
    prompts: Sequence[str],
    metadata: Sequence[dict],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    num_samples: int = 1,
    *,
    reprefill: bool = False,
    timeout: float | None = DEFAULT_REWARD_TIMEOUT,
    vision: VisionInputs | None = None,
) -> Rollout:
    """Play ``num_samples`` episodes per prompt with ``engine``'s settings (``max_new_tokens`` per turn) and
    return their ``Rollout``, its ``episodes`` (``EpisodeInfo``) set. Prompts whose ``reset`` returns messages
    are re-rendered from them (with the environment's tools); the others keep ``prompt_ids``. With a generation
    backend on ``engine`` (vLLM), each turn sends every unfinished episode's whole token sequence to it
    (``backend_turns``); the rollout then carries the backend's ``sampling_logprobs``. The environment's ``reset``
    and ``step`` run guarded (``episode_guard``): each call at most ``timeout`` seconds (the online modules'
    ``reward_timeout``), and any fault stops the run with one ``RewardError`` naming the environment.

    A vision-language policy (its tokenizer carries its processor) plays with images: the prompts' (``vision``, one
    entry per prompt, or the image parts of ``reset``'s messages) and those of the environment's replies
    (``EpisodeStep.images``, ``environments.vision_chat``), their image tokens masked like the rest of a reply.
    Each turn re-runs every unfinished episode's whole sequence with all of its images so far through the HF
    decoder with images (``backend_turns`` with ``images``): exact on every architecture (the model places the image
    tokens and, for the Qwen VL family, their multimodal positions over the whole sequence itself), where extending
    the KV cache by a reply with a new image would need the new image's positions computed outside the model. The
    rollout carries each row's images in order (``Rollout.vision``) for the trainer's log-prob pass."""
    tokenizer, device = engine.tokenizer, prompt_ids.device
    chat = vision_chat_format(tokenizer, environment.tools)
    if environment.tools:
        environment.for_template(chat.template)
    n = len(prompts) * num_samples
    episodes = _Episodes(environment, chat, tokenizer, n, engine.generation.max_new_tokens, timeout)
    group = torch.arange(len(prompts), device=device).repeat_interleave(num_samples)
    first = [
        guarded_reset(episodes.envs[r], prompts[int(g)], dict(metadata[int(g)]), timeout)
        for r, g in enumerate(group.tolist())
    ]
    prompts_images = [vision.prompts[i] if vision is not None else {} for i in range(len(prompts))]
    prompt_ids, prompt_mask = _prompts(
        chat, first[::num_samples], prompt_ids, prompt_mask, engine, model, prompts_images
    )
    end_ids = engine.end_token_ids(model)
    config = hf_generation_config(engine.generation, end_ids, engine.pad_token_id(model, end_ids))
    if episodes.vision:  # a VL policy: each row's images so far, the prompt's first
        episodes.images = [[prompts_images[g]] for g in group.tolist()]
        sample = backend_turns(engine, model, episodes.images)
        tokens = decode_turns(sample, prompt_ids, prompt_mask, config.pad_token_id, episodes, num_samples)
    elif engine.backend is not None and engine.backend.location != "policy":
        sample = backend_turns(engine, model)
        tokens = decode_turns(sample, prompt_ids, prompt_mask, config.pad_token_id, episodes, num_samples)
    else:
        with eval_mode(model):
            tokens = decode_episodes(
                model, prompt_ids, prompt_mask, config, episodes, engine.stop_rule or None, num_samples, reprefill
            )
    rollout = _as_rollout(tokens, episodes, prompt_ids[group], prompt_mask[group], group, config.pad_token_id)
    if episodes.vision:
        rollout.vision = VisionInputs([merge_vision(images) for images in episodes.images])
    return rollout


def backend_turns(engine: RolloutEngine, model: torch.nn.Module, images: list[list[dict]] | None = None):
    """``decode_turns``' sampler on ``engine``'s generation backend: each turn is ``engine.sample`` of the
    histories as prompts (token ids as they are: vLLM's ``prompt_token_ids``), with the single-response path's
    sampling settings, end ids and stop rule; the backend's prefix cache keeps the earlier turns' KV
    (``prefilled``: the prompt tokens it did not find there, ``VLLMEngine.cached_tokens``). With ``images`` (a VL
    policy's: each row's per-image vision inputs so far, in order), each history is sampled with its images by the HF
    decoder with images (``sample_episodes`` says why the whole history)."""

    def sample(ids: torch.Tensor, mask: torch.Tensor, samples: int, rows: list[int]) -> TurnSample:
        extra = {} if images is None else {"vision": VisionInputs([merge_vision(images[r]) for r in rows[::samples]])}
        drawn = engine.sample(model, ids, mask, samples, **extra)
        lengths = drawn.response_mask.sum(1).tolist()
        tokens = [row[:n].tolist() for row, n in zip(drawn.response_ids, lengths)]
        logps = drawn.sampling_logprobs
        logps = None if logps is None else [row[:n].tolist() for row, n in zip(logps, lengths)]
        cached = int(getattr(engine.backend, "cached_tokens", 0) or 0)
        return TurnSample(tokens, drawn.ended.tolist(), logps, int(mask.sum()) - cached)

    return sample


def _prompts(chat: ChatFormat, first, prompt_ids, prompt_mask, engine, model, images: list[dict]):
    """The prompts: ``reset``'s messages rendered (a VL policy's: their image parts' images replace the prompt's,
    ``images[i]``), the data module's where it returned None."""
    if all(messages is None for messages in first):
        return prompt_ids, prompt_mask
    rows = []
    for i, messages in enumerate(first):
        if messages is None:
            rows.append(prompt_ids[i][prompt_mask[i].bool()].tolist())
        else:
            ids, parts = chat_ids(chat, messages, where="reset", source="the environment's reset")
            rows.append(ids)
            images[i] = merge_vision(parts)
    end_ids = engine.end_token_ids(model)
    ids, mask = padded(rows, engine.pad_token_id(model, end_ids), "left", device="cpu")
    return ids.to(prompt_ids.device), mask.to(prompt_mask.device)


def _as_rollout(tokens: EpisodeTokens, episodes: _Episodes, prompt_ids, prompt_mask, group, pad) -> Rollout:
    n, device = len(tokens.tokens), prompt_ids.device
    ids, attention = padded(tokens.tokens, int(pad), width=1, device="cpu")
    model_mask, _ = padded(tokens.from_model, 0, width=ids.shape[1], device="cpu")
    rewards = torch.zeros(ids.shape)
    for r in range(n):
        for end, reward in zip(tokens.turn_ends[r], episodes.rewards[r]):
            rewards[r, end] += reward
    # ended: the environment ended the episode after a turn that itself ended (not cut at max_new_tokens)
    ended = torch.tensor([d and t[-1] for d, t in zip(episodes.done, tokens.turn_ended)], dtype=torch.bool)
    texts = [episodes.tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(ids, model_mask)]
    keys = sorted({k for m in episodes.metrics for k in m})
    info = EpisodeInfo(
        attention.to(device),
        rewards.to(device),
        rewards.sum(1).to(device),
        {k: [m.get(k, 0.0) for m in episodes.metrics] for k in keys},
        episodes.transcripts,
        tokens.prefilled,
        tokens.sampled,
    )
    rollout = Rollout(prompt_ids, prompt_mask, ids.to(device), model_mask.to(device), ended.to(device), texts, group)
    if tokens.sampling_logprobs is not None:
        logps, _ = padded(tokens.sampling_logprobs, 0.0, width=ids.shape[1], dtype=torch.float32, device="cpu")
        rollout.sampling_logprobs = logps.to(device)
    rollout.episodes = info
    return rollout
