"""Tools for episodes: plain Python functions the model calls in its chat template's own format.

A tool is a function with type hints and a Google-style docstring; its JSON schema comes from
``transformers.utils.get_json_schema`` and is shown to the model by the chat template (``tools=``). A tool call
in an assistant turn is parsed in the template's format (``TOOL_CALL_FORMATS``, detected from the template by
``detect_tool_format``):

- ``hermes`` (Qwen2.5, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more;
- ``llama3`` (Llama 3.1 / 3.2 / 3.3): the turn is one JSON object ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``;
- ``mistral`` (Mistral v0.3 and later): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

``call_tool`` runs one call in the tool worker process (``tool_worker``: started fresh, not forked from the
trainer; each call in its own process group, killed with everything it started when it ends) with a wall-clock
limit (``ToolLimits``): what it returns (or prints) comes back as text of bounded size; an exception, a timeout, a
call that dies, a result that is not text (converted with ``json.dumps`` or ``repr``), an unknown tool, arguments
that do not fit and a call nested too deeply to parse become an ``error: ...`` tool message. Nothing a tool does
stops the run.
"""

from __future__ import annotations

import json
import pickle
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aitraining_pl.environments.tool_worker import WORKER, as_text, bounded

#: tool-call syntaxes by name (see the module docstring)
TOOL_CALL_FORMATS = ("hermes", "llama3", "mistral")


class ToolTemplateError(ValueError):
    """Tools are configured but the chat template cannot show them to the model."""


@dataclass
class ToolLimits:
    """Limits of one tool call.

    Args:
        timeout: wall-clock seconds a call may take (its process and everything it started are killed after).
        max_output_chars: characters of a tool's result (and of its printed output) kept in the tool message.
        max_calls_per_turn: tool calls of one turn that are run (later ones get an error message).
    """

    timeout: float = 5.0
    max_output_chars: int = 2000
    max_calls_per_turn: int = 4


@dataclass
class ToolCall:
    name: str
    arguments: Any  #: a dict when well formed
    error: str = ""  #: why the call could not be parsed (then ``name`` may be empty)


def detect_tool_format(template: str | None) -> str:
    """The tool-call format of a chat template; ``ToolTemplateError`` when the template takes no tools."""
    template = template or ""
    if "tools" not in template:
        raise ToolTemplateError(
            "tools are configured but the tokenizer's chat template does not render them (it never reads the "
            "`tools` variable): use a tool-calling template (Qwen2.5 / Hermes, Llama 3.1+, Mistral v0.3+) "
            "or set `tool_format` and a template that shows the tools"
        )
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "ipython" in template or "<|python_tag|>" in template:
        return "llama3"
    raise ToolTemplateError("the chat template renders tools in an unknown format; set `tool_format` explicitly")


def _call_from(obj: Any, argument_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", None, f"a tool call must be a JSON object with a string 'name', got {str(obj)[:200]}")
    arguments = obj.get(argument_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    return ToolCall(obj["name"], arguments)


def _loads(text: str) -> tuple[Any, str]:
    try:
        return json.loads(text), ""
    except ValueError as err:
        return None, f"unparsable tool call ({err.msg} at character {err.pos}): {text[:200]}"
    except RecursionError:  # arguments nested past the interpreter's recursion limit
        return None, f"unparsable tool call (nested too deeply): {text[:200]}"


def parse_tool_calls(text: str, tool_format: str) -> list[ToolCall]:
    """The tool calls of one assistant turn (raw text, special tokens kept); [] when it makes none."""
    if tool_format == "hermes":
        calls = []
        for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.DOTALL):
            obj, error = _loads(body.strip())
            calls.append(ToolCall("", None, error) if error else _call_from(obj, "arguments"))
        return calls
    if tool_format == "mistral":
        if "[TOOL_CALLS]" not in text:
            return []
        body = text.split("[TOOL_CALLS]", 1)[1].split("</s>")[0].strip()
        obj, error = _loads(body)
        if error:
            return [ToolCall("", None, error)]
        return [_call_from(item, "arguments") for item in (obj if isinstance(obj, list) else [obj])]
    if tool_format == "llama3":
        body = text.split("<|python_tag|>", 1)[-1]
        body = re.sub(r"<\|(eot_id|eom_id|end_of_text)\|>", "", body).strip()
        if not body.startswith("{"):
            return []
        obj, error = _loads(body)
        return [ToolCall("", None, error) if error else _call_from(obj, "parameters")]
    raise ValueError(f"unknown tool_format {tool_format!r}; known: {', '.join(TOOL_CALL_FORMATS)}")


def call_tool(fn: Callable, arguments: Any, limits: ToolLimits) -> tuple[str, bool]:
    """Run ``fn(**arguments)`` in the tool worker process with ``limits``; ``(text, ok)`` (see the module
    docstring)."""
    if not isinstance(arguments, dict):
        return f"error: the arguments must be a JSON object, got {bounded(as_text(arguments), 200)}", False
    try:
        status, text = WORKER.call(fn, arguments, limits.timeout, limits.max_output_chars)
    except (pickle.PicklingError, RecursionError, TypeError, AttributeError) as err:
        return bounded(f"error: the arguments cannot be passed to the tool: {type(err).__name__}: {err}", 500), False
    return (text, True) if status == "ok" else (f"error: {text}", False)


def call_id() -> str:
    """A tool-call id (9 alphanumerics, as Mistral's template requires)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def tool_schemas(functions: Sequence[Callable]) -> list[dict]:
    """The JSON schemas of ``functions`` (``transformers.utils.get_json_schema``; type hints and docstrings)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in functions]


def run_calls(
    calls: Sequence[ToolCall], functions: dict[str, Callable], limits: ToolLimits, tool_format: str
) -> tuple[list[dict], int]:
    """Run parsed calls; the ``tool`` messages (one per call) and the number of errors."""
    messages, errors = [], 0
    for i, call in enumerate(calls):
        if call.error:
            text, ok = f"error: {call.error}", False
        elif i >= limits.max_calls_per_turn:
            text, ok = f"error: at most {limits.max_calls_per_turn} tool calls per turn", False
        elif call.name not in functions:
            text, ok = f"error: unknown tool {call.name[:100]!r}; tools: {', '.join(functions)}", False
        else:
            text, ok = call_tool(functions[call.name], call.arguments, limits)
        errors += not ok
        messages.append({"role": "tool", "name": call.name or "invalid", "content": text, "tool_call_id": call_id()})
    return messages, errors
