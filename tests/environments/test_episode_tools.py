"""Tools in episodes: the token ids of the Qwen2.5, Llama 3.1 and Mistral v0.3 chat templates (real template
strings, a byte-level tokenizer with their special tokens), tool-call parsing in each format, a template without
tools, and tool faults (raises, hangs, prints a lot, returns non-text) answered by bounded tool messages."""

from __future__ import annotations

import json
import time

import pytest
from chat_templates import TEMPLATES, template_tokenizer

from aitraining_pl.environments.chat import ChatFormat
from aitraining_pl.environments.episode import AssistantTurn
from aitraining_pl.environments.multiturn import ToolEnvironment, calculator, run_python
from aitraining_pl.environments.tools import (
    ToolLimits,
    ToolTemplateError,
    call_tool,
    detect_tool_format,
    parse_tool_calls,
    run_calls,
    tool_schemas,
)
from aitraining_pl.models import load_tokenizer
from aitraining_pl.models.tokens import with_bos


def _call_message(name: str) -> dict:
    call = {"name": "calculator", "arguments": {"expression": "2+3"}}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "abcdefghi", "type": "function", "function": call}],
    }


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_sequence_is_sampled_tokens_plus_the_templates_rendering_of_the_replies(name):
    """prompt + sampled turn + reply ids == the template's rendering of the whole conversation, tokenised, for a
    user reply and for a tool call answered by a tool message; the call parses in the template's format."""
    tokenizer, end = template_tokenizer(name)
    env = ToolEnvironment([calculator], reward=lambda p, r, m: [1.0])
    env.for_template(tokenizer.chat_template)
    assert env.tool_format == {"qwen2.5": "hermes", "llama3.1": "llama3", "mistral": "mistral"}[name]
    chat = ChatFormat(tokenizer, env.tools)
    encode = chat.encode
    first = [{"role": "user", "content": "Add 2 and 3."}]
    prompt = chat.prompt_ids(first)
    assert tokenizer.decode(prompt).count("calculator") >= 1  # the tools are shown
    # a plain answer, then a user reply
    turn = encode(" 5" if name == "mistral" else "5") + [end]  # Mistral's template writes " " + content
    reply = [{"role": "user", "content": "Sure?"}]
    got = prompt + turn + chat.reply_ids(reply, turn)
    assert got == _expected(chat, first + [{"role": "assistant", "content": "5"}] + reply, name)
    # a tool call (as the template writes it), run, and answered with a tool message
    call = encode(TEMPLATES[name][3]) + [end]
    raw = tokenizer.decode(call, skip_special_tokens=False)
    step = env.spawn()
    step.reset("Add 2 and 3.", {})
    answer = step.step(AssistantTurn(tokenizer.decode(call, skip_special_tokens=True), raw, call, True, 0))
    assert answer.messages[0]["content"] == "5" and answer.metrics == {"tool_calls": 1.0, "tool_errors": 0.0}
    tool = [{**answer.messages[0], "tool_call_id": "abcdefghi"}]
    got = prompt + call + chat.reply_ids(tool, call)
    assert got == _expected(chat, first + [_call_message(name)] + tool, name)


def _expected(chat: ChatFormat, conversation: list[dict], name: str) -> list[int]:
    """The template's rendering of the whole conversation, tokenised. Mistral's template shows the tool list
    before the *last* user message; an episode shows it once, before the first (the prompt), so there the
    expected text is the conversation rendered without tools and the tool list put before the first ``[INST]``."""
    if name != "mistral":
        return with_bos(chat.encode(chat.render(conversation, chat.tools, generation_prompt=True)), chat.tokenizer)
    shown = chat.render(conversation[:1], chat.tools, generation_prompt=True)
    tools_block = shown[: shown.index("[INST]")]
    return with_bos(chat.encode(tools_block + chat.render(conversation, None, generation_prompt=True)), chat.tokenizer)


def test_a_template_without_tools_gives_one_clear_error():
    tokenizer = load_tokenizer("byte")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    schemas = tool_schemas([calculator])
    with pytest.raises(ToolTemplateError, match="does not render them"):
        ChatFormat(tokenizer, schemas)
    with pytest.raises(ToolTemplateError, match="does not render them"):
        detect_tool_format(tokenizer.chat_template)


def test_tool_calls_parse_in_each_format_and_bad_calls_become_errors():
    assert parse_tool_calls("no call here", "hermes") == []
    (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "hermes")
    assert (call.name, call.arguments) == ("f", {"x": 1})
    (bad,) = parse_tool_calls("<tool_call>{not json</tool_call>", "hermes")
    assert bad.error.startswith("unparsable tool call")
    calls = parse_tool_calls('[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]', "mistral")
    assert [c.name for c in calls] == ["a", "b"]
    assert parse_tool_calls('<|python_tag|>{"name": "g", "parameters": {"y": 2}}<|eom_id|>', "llama3")[0].arguments == {
        "y": 2
    }
    messages, errors = run_calls(
        parse_tool_calls('<tool_call>{"name": "nope"}</tool_call><tool_call>[</tool_call>', "hermes"),
        {"f": len},
        ToolLimits(),
        "hermes",
    )
    assert errors == 2 and "unknown tool 'nope'" in messages[0]["content"] and "unparsable" in messages[1]["content"]


def _raises():
    """Raise."""
    raise RuntimeError("boom " * 10_000)


def _hangs():
    """Sleep forever."""
    while True:
        time.sleep(1)


def _prints_a_gigabyte():
    """Print 1 GB."""
    chunk = "x" * (1 << 20)
    for _ in range(1024):
        print(chunk)
    return "done"


def _dies():
    """Exit the process without a result."""
    import os

    os._exit(3)


def _returns_an_object():
    """Return a non-text value."""
    return object()


def _returns_bytes():
    """Return bytes and a set."""
    return {b"\x00\xff", 3}


@pytest.mark.parametrize(
    "fn, expect, ok",
    [
        (_raises, "error: RuntimeError: boom", False),
        (_hangs, "error: the tool did not finish within 1 s", False),
        (_prints_a_gigabyte, "... [1073742698 characters cut]\ndone", True),
        (_dies, "error: the tool's process died without a result", False),
        (_returns_an_object, "<object object at", True),
        (_returns_bytes, "b'\\x00\\xff'", True),
    ],
)
def test_tool_faults_become_bounded_tool_messages(fn, expect, ok):
    limits = ToolLimits(timeout=1.0 if fn is _hangs else 30.0, max_output_chars=300)
    text, succeeded = call_tool(fn, {}, limits)  # a hang ends as its timeout's message, not as a wall-clock bound
    assert succeeded is ok and expect in text and len(text) <= 300 + 40


def test_tools_answer_with_text_calculator_and_sandboxed_python():
    assert calculator("(3 + 4) * 12 / 6") == "14"
    text, ok = call_tool(calculator, {"expression": "2 ** 1000"}, ToolLimits())
    assert not ok and "exponent too large" in text
    assert run_python("print(6 * 7)") == "42"
    assert "ZeroDivisionError" in run_python("print(1 / 0)")
    schema = json.dumps(tool_schemas([run_python])[0])
    assert '"code"' in schema and "sandbox" in schema
