"""The OpenAI chat-completions protocol as the endpoint speaks it: the request's fields checked (``ChatRequest``), its
messages normalised for a chat template, the response built from the ``openai`` package's own types, and the
error bodies (``{"error": {"message", "type", "param", "code"}}``) of what it refuses.

Served fields: ``messages`` (content as text, or text and ``image_url`` parts whose URLs are data URLs, for a
vision-language policy: ``environments.chat``), ``tools``, ``tool_choice`` (``auto``, ``none``, ``required``,
a named function), ``parallel_tool_calls``, ``temperature``, ``top_p``, ``max_tokens`` (or
``max_completion_tokens``), ``n``, ``stop``, ``logprobs``, ``top_logprobs`` (0 only), ``stream`` and
``stream_options.include_usage`` (the answer as OpenAI's server-sent events: ``stream_chunks``); ``model`` is
accepted and ignored (one policy is served). Fields that would
change what is sampled and cannot be honoured are refused with a 400 naming them: ``response_format`` other than
``text`` (no guided decoding), ``logit_bias``, non-zero ``presence_penalty`` / ``frequency_penalty``. Fields that do
not change the sample (``seed``, ``user``, ``metadata``, ``store``, ...) are ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aitraining_pl.environments.tools import ToolCall, call_id

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the endpoint refuses: the HTTP status and the OpenAI-style error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {401: "authentication_error", 403: "permission_error"}.get(status, "invalid_request_error")

    def body(self) -> dict:
        """The OpenAI error body."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A checked chat-completions request (see the module docstring)."""

    messages: list[dict]  #: normalised (``normalise_messages``)
    tools: list[dict]  #: JSON schemas as the chat template takes them (``{"type": "function", "function": ...}``)
    tool_choice: Any
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    n: int
    stop: list[str]
    logprobs: bool
    parallel_tool_calls: bool = True
    stream: bool = False
    include_usage: bool = False  #: ``stream_options.include_usage``: a last chunk with ``usage``


def _number(body: dict, name: str, low: float, high: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        what = "an integer" if integer else "a number"
        raise RequestError(400, f"{name} must be {what} in [{low}, {high}], got {value!r:.40}", name, "invalid_value")
    return value


def _content(content: Any, where: str) -> str | list[dict]:
    """A message content as text (a string, None, or a list of ``{"type": "text", "text": ...}`` parts), or, where
    it has ``image_url`` parts, as a list of text and ``image_url`` parts whose URLs are ``data:image/...;base64,``
    data URLs (nothing is fetched: any other URL is refused, naming the field)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise RequestError(400, f"{where}.content must be a string or a list of text parts (or text and image_url "
                           "parts)", f"{where}.content")  # fmt: skip
    if all(p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    parts = []
    for j, part in enumerate(content):
        field = f"{where}.content[{j}]"
        if part.get("type") == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif part.get("type") == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
                raise RequestError(400, f"{field}.image_url.url must be a data URL (data:image/png;base64,...): "
                                   f"nothing is fetched, got {url!r:.60}", f"{field}.image_url.url")  # fmt: skip
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise RequestError(400, f"{field}: a content part must be text or image_url, got {part.get('type')!r:.40}",
                               field)  # fmt: skip
    return parts


def text_size(messages: list[dict]) -> int:
    """Characters of ``messages`` as JSON, an image's data URL counted as one (images are not text)."""

    def strip(content):
        if not isinstance(content, list):
            return content
        return [{"type": "image_url"} if p.get("type") == "image_url" else p for p in content]

    return len(json.dumps([{**m, "content": strip(m.get("content"))} for m in messages]))


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise RequestError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(400, f"{where}.tool_calls[{j}] has no function name", f"{where}.tool_calls[{j}]")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):  # the API sends a JSON string; chat templates render a mapping
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass
        call_id_ = str(call.get("id") or "")
        out.append({"id": call_id_, "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out


def normalise_messages(messages: Any) -> list[dict]:
    """``messages`` checked and made what chat templates read: content as text (or text and ``image_url`` parts),
    tool-call arguments as mappings."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            got = message.get("role") if isinstance(message, dict) else message
            raise RequestError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {got!r:.40}", f"{where}.role")
        role = "system" if message["role"] == "developer" else message["role"]
        normal = {"role": role, "content": _content(message.get("content"), where)}
        if role == "assistant" and message.get("tool_calls"):
            normal["tool_calls"] = _tool_calls(message["tool_calls"], where)
        if role == "tool":
            normal["tool_call_id"] = str(message.get("tool_call_id") or "")
        if isinstance(message.get("name"), str):
            normal["name"] = message["name"]
        out.append(normal)
    return out


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools
    ):
        raise RequestError(400, 'tools must be a list of {"type": "function", "function": {...}}', "tools")
    return [{"type": "function", "function": t["function"]} for t in tools]


def _flag(body: dict, name: str, default: bool, where: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(400, f"{where}{name} must be true or false, got {value!r:.40}", where + name, "invalid_type")
    return value


def _tool_choice(choice: Any, tools: list[dict]) -> Any:
    """``tool_choice`` checked: None, ``auto``, ``none``, ``required``, or the name of one of ``tools`` (given as
    ``{"type": "function", "function": {"name": ...}}``)."""
    if choice is None or choice in ("auto", "none"):
        return choice
    if choice == "required":
        if not tools:
            raise RequestError(400, 'tool_choice "required" needs tools', "tool_choice", "invalid_value")
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError(
            400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice", "invalid_value",
        )  # fmt: skip
    if name not in [t["function"].get("name") for t in tools]:
        raise RequestError(400, f"tool_choice names {name!r:.60}, which is not one of the tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def _refuse_unserved(body: dict) -> None:
    """A 400 naming the first field that would change what is sampled and that this endpoint cannot honour."""
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else response_format
        if kind != "text":
            raise RequestError(
                400,
                f"response_format {kind!r:.40} is not supported: this endpoint has no guided decoding, so it cannot "
                "promise JSON; ask for JSON in the messages, or use tools (LangChain: with_structured_output(..., "
                'method="function_calling"))',
                "response_format", "unsupported_value",
            )  # fmt: skip
    if body.get("logit_bias"):
        raise RequestError(400, "logit_bias is not supported (the run's distribution samples)", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name):
            raise RequestError(400, f"{name} is not supported (the run's distribution samples); send 0", name)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(400, "stream_options must be an object", "stream_options", "invalid_type")


def parse_request(body: Any) -> ChatRequest:
    """A ``ChatRequest`` from a decoded JSON body; ``RequestError`` (400) naming the field that is wrong."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    _refuse_unserved(body)
    if body.get("top_logprobs"):
        raise RequestError(400, "top_logprobs is not supported (the sampled token's log-prob only)", "top_logprobs")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise RequestError(400, "stop must be a string or a list of at most 4 strings", "stop")
    max_tokens = _number(body, "max_tokens", 1, 1 << 20, True) or _number(
        body, "max_completion_tokens", 1, 1 << 20, True
    )
    tools = _tools(body.get("tools"))
    options = body.get("stream_options") or {}
    return ChatRequest(
        messages=normalise_messages(body.get("messages")),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        max_tokens=max_tokens,
        n=_number(body, "n", 1, 128, True) or 1,
        stop=stop,
        logprobs=bool(body.get("logprobs")),
        parallel_tool_calls=_flag(body, "parallel_tool_calls", True),
        stream=_flag(body, "stream", False),
        include_usage=_flag(options, "include_usage", False, "stream_options."),
    )


def conversation_opening(messages: list[dict]) -> list[dict]:
    """The messages up to the first user message: what tells one conversation from another."""
    for i, message in enumerate(messages):
        if message["role"] == "user":
            return messages[: i + 1]
    return messages[:1]


#: per tool-call format: the text that opens a call (a template marker, tokenised with its special tokens) and
#: what follows before a forced function's arguments (plain text), ``{name}`` its JSON-quoted name
_PREFILLS = {
    "hermes": ("<tool_call>", "\n", '\n{{"name": {name}, "arguments": '),
    "mistral": ("[TOOL_CALLS]", " [", ' [{{"name": {name}, "arguments": '),
    "llama3": ("", '{"name": "', '{{"name": {name}, "parameters": '),
}


def tool_prefill(request: ChatRequest, tool_format: str | None) -> tuple[str, str]:
    """What is written after the generation prompt so that ``tool_choice`` is honoured: ``(marker, text)``, both
    "" unless a call is required (``"required"``: the call's opening; a named function: its opening up to the
    arguments). ``parallel_tool_calls: false`` in the ``mistral`` format (one list of calls) is refused."""
    if not request.tools or request.tool_choice in (None, "auto", "none"):
        choice = None
    else:
        choice = request.tool_choice
    if not request.parallel_tool_calls and tool_format == "mistral" and request.tool_choice != "none":
        raise RequestError(
            400, "parallel_tool_calls: false is not supported with the mistral tool-call format (its calls are one "
            "list)", "parallel_tool_calls", "unsupported_value",
        )  # fmt: skip
    if choice is None or tool_format is None:
        return "", ""
    marker, required, named = _PREFILLS[tool_format]
    if choice == "required":
        return marker, required
    return marker, named.format(name=json.dumps(choice["function"]["name"]))


def same_turn(sent: dict, returned: dict) -> bool:
    """Whether an assistant message the agent sent back is the one the endpoint returned (content and tool calls;
    call ids aside)."""

    def key(message: dict):
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        return message.get("role"), message.get("content") or "", calls

    return key(sent) == key(returned)


def assistant_message(text: str, calls: list[ToolCall], tool_format: str) -> dict:
    """The normalised assistant message of a sampled turn: its text, or the text before the first call and the
    calls (each with a fresh id)."""
    if not calls:
        return {"role": "assistant", "content": text}
    marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(tool_format)
    content = text.split(marker, 1)[0].strip() if marker and marker in text else ""
    tool_calls = [
        {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


def completion_body(model: str, choices: list[dict], prompt_tokens: int) -> dict:
    """The response body (``openai.types.chat.ChatCompletion``) of ``choices``: dicts of ``message`` (normalised
    assistant message), ``finish_reason``, ``completion_ids``, and ``logprobs`` (a list of ``(token text, bytes,
    logprob)``, or None)."""
    from openai.types.chat import ChatCompletion

    out = []
    for index, choice in enumerate(choices):
        message = dict(choice["message"])
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in message["tool_calls"]
            ]
        logprobs = None
        if choice["logprobs"] is not None:
            content = [{"token": t, "bytes": b, "logprob": lp, "top_logprobs": []} for t, b, lp in choice["logprobs"]]
            logprobs = {"content": content}
        out.append({"index": index, "message": message, "finish_reason": choice["finish_reason"], "logprobs": logprobs})
    completion_tokens = sum(len(c["completion_ids"]) for c in choices)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage,
    }
    return ChatCompletion.model_validate(body).model_dump(mode="json", exclude_none=True)


def stream_chunks(completion: dict, include_usage: bool) -> list[dict]:
    """A completion body (``completion_body``) as the chunks of OpenAI's streamed answer
    (``openai.types.chat.ChatCompletionChunk``): per choice, one chunk with the role and the content (and its
    log-probs), one with the tool calls (each with its ``index``), and one with an empty delta and the
    ``finish_reason``; then, with ``include_usage``, one chunk with no choices and the ``usage`` (the others carry
    ``usage: null``, as OpenAI's do). The sampling is done before the first chunk: only the answer is streamed."""
    from openai.types.chat import ChatCompletionChunk

    head = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"]}
    head["model"] = completion["model"]

    def chunk(choices: list[dict], usage: dict | None = None) -> dict:
        body = {**head, "choices": choices, "usage": usage}
        checked = ChatCompletionChunk.model_validate(body).model_dump(mode="json", exclude_none=True)
        return {**checked, "usage": usage} if include_usage else checked

    chunks = []
    for choice in completion["choices"]:
        index, message = choice["index"], choice["message"]
        first = {"index": index, "delta": {"role": "assistant", "content": message.get("content") or ""}}
        if choice.get("logprobs"):
            first["logprobs"] = choice["logprobs"]
        chunks.append(chunk([first]))
        if message.get("tool_calls"):
            calls = [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]
            chunks.append(chunk([{"index": index, "delta": {"tool_calls": calls}}]))
        chunks.append(chunk([{"index": index, "delta": {}, "finish_reason": choice["finish_reason"]}]))
    if include_usage:
        chunks.append(chunk([], completion["usage"]))
    return chunks


def sse_lines(chunks: list[dict]):
    """The server-sent events of ``chunks``: ``data: <json>`` each, then ``data: [DONE]``."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


def models_body(model: str) -> dict:
    """The ``/v1/models`` body: the one served model (``openai.types.Model``)."""
    from openai.types import Model

    entry = Model(id=model, created=int(time.time()), object="model", owned_by="aitraining-pl")
    return {"object": "list", "data": [entry.model_dump(mode="json")]}
