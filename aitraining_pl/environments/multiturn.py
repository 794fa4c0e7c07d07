"""Shipped episode environments: a guessing game that answers higher / lower, a ``ToolEnvironment`` built from
plain Python functions, and two tools (``calculator``, ``run_python`` in the code sandbox)."""

from __future__ import annotations

import ast
import operator
import pickle
import re
from collections.abc import Callable, Sequence
from typing import Any

from aitraining_pl.environments.episode import AssistantTurn, EpisodeEnvironment, EpisodeLimits, EpisodeStep
from aitraining_pl.environments.sandbox import SandboxLimits, run_tests
from aitraining_pl.environments.tools import (
    ToolLimits,
    detect_tool_format,
    parse_tool_calls,
    run_calls,
    tool_schemas,
)
from aitraining_pl.errors import ConfigError
from aitraining_pl.rewards import build_reward_source, import_object, score_responses


class GuessingGame(EpisodeEnvironment):
    """Guess a secret number between ``low`` and ``high`` in ``max_turns`` turns; after each wrong guess the
    environment answers ``higher`` or ``lower`` (or ``a number?`` when the turn holds none). The secret is the
    prompt's ``secret`` metadata. Reward: 1 for the right guess, plus, per turn, ``format_reward`` for a guess that
    the answers so far have not ruled out (inside the range still open: a per-turn signal for using the answers);
    metrics: ``success`` (1 when guessed) and ``valid`` (turns with a guess still possible).

    Args:
        max_turns: guesses per episode.
        format_reward: reward of a turn whose guess is still possible.
        low: smallest secret.
        high: largest secret.
        reply_role: role of the environment's answers.
    """

    def __init__(
        self, max_turns: int = 3, format_reward: float = 0.1, low: int = 1, high: int = 7, reply_role: str = "user"
    ):
        self.limits = EpisodeLimits(max_turns=max_turns, max_total_tokens=1 << 16)
        self.format_reward, self.range, self.reply_role = float(format_reward), (int(low), int(high)), reply_role

    def reset(self, prompt: str, metadata: dict) -> None:
        if "secret" not in metadata:
            raise ValueError(f"GuessingGame: the prompt {prompt[:80]!r} has no 'secret' in its metadata")
        self.secret, (self.low, self.high) = int(metadata["secret"]), self.range
        return None

    def step(self, turn: AssistantTurn) -> EpisodeStep:
        found = re.search(r"-?\d+", turn.text)
        if found is None:
            return self._reply("a number?", 0.0, success=0.0, valid=0.0)
        guess = int(found.group())
        possible = float(self.low <= guess <= self.high)
        if guess == self.secret:
            return EpisodeStep(done=True, reward=1.0 + self.format_reward, metrics={"success": 1.0, "valid": 1.0})
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
        else:
            self.high = min(self.high, guess - 1)
        reward = self.format_reward * possible
        return self._reply("higher" if guess < self.secret else "lower", reward, success=0.0, valid=possible)

    def _reply(self, text: str, reward: float, **metrics: float) -> EpisodeStep:
        return EpisodeStep([{"role": self.reply_role, "content": text}], reward=reward, metrics=metrics)


def _resolve(tool: Callable | str) -> Callable:
    """A tool by import path or as given; it must reach the tool worker by reference (``tool_worker``)."""
    fn = import_object(tool) if isinstance(tool, str) else tool
    try:
        sendable = fn.__module__ != "__main__" and pickle.loads(pickle.dumps(fn)) is fn
    except Exception:  # noqa: BLE001 - a lambda, a local function, an object that does not pickle
        sendable = False
    if not sendable:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(
            f"tool {name!r}", "tools run in a worker process: define it at module level in an importable module"
        )
    return fn


class ToolEnvironment(EpisodeEnvironment):
    """The model answers a prompt and may call tools first: each turn's tool calls (in the chat template's
    format) are run and their results come back as ``tool`` messages; the first turn without a tool call is the
    answer, scored by ``reward`` (checked as a reward source's scores). Faults of a tool become error messages
    (``environments.tools``); tools run in a worker process (``environments.tool_worker``), so each is a function
    defined at module level (a lambda or a local function raises ``ConfigError`` here).

    Args:
        tools: the tools: Python functions (type hints and a docstring give the JSON schema) or import paths
            ``"pkg.module:function"``.
        reward: the reward source scoring the final answer (as ``PPOModule``'s ``reward``).
        system_prompt: a system message before the prompt (none by default).
        tool_format: ``auto`` (from the chat template), ``hermes``, ``llama3`` or ``mistral``.
        max_turns: assistant turns per episode (tool-calling turns included).
        max_total_tokens: tokens after the prompt per episode.
        tool_timeout: wall-clock seconds per tool call.
        max_tool_output_chars: characters of a tool result kept.
    """

    def __init__(
        self,
        tools: Sequence[Callable | str],
        reward: Any,
        system_prompt: str | None = None,
        tool_format: str = "auto",
        max_turns: int = 4,
        max_total_tokens: int = 2048,
        tool_timeout: float = 5.0,
        max_tool_output_chars: int = 2000,
    ):
        self.functions = {fn.__name__: fn for fn in map(_resolve, tools)}
        self._schemas = tool_schemas(list(self.functions.values()))
        self.reward = build_reward_source(reward)
        self.system_prompt, self.tool_format = system_prompt, tool_format
        self.limits = EpisodeLimits(max_turns=max_turns, max_total_tokens=max_total_tokens)
        self.tool_limits = ToolLimits(timeout=tool_timeout, max_output_chars=max_tool_output_chars)

    @property
    def tools(self) -> list[dict]:
        return self._schemas

    def for_template(self, chat_template: str | None) -> None:
        """Resolve ``tool_format="auto"`` from the chat template (``ToolTemplateError`` when it takes no tools)."""
        detected = detect_tool_format(chat_template)
        self.tool_format = detected if self.tool_format == "auto" else self.tool_format

    def spawn(self) -> ToolEnvironment:
        import copy

        return copy.copy(self)  # the functions and the reward source are shared

    def reset(self, prompt: str, metadata: dict) -> list[dict]:
        self.prompt, self.metadata = prompt, metadata
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    def step(self, turn: AssistantTurn) -> EpisodeStep:
        calls = parse_tool_calls(turn.raw_text, self.tool_format)
        if calls:
            messages, errors = run_calls(calls, self.functions, self.tool_limits, self.tool_format)
            return EpisodeStep(messages, metrics={"tool_calls": float(len(calls)), "tool_errors": float(errors)})
        # checked as a reward source's scores; no timeout of its own: the step it runs in has the run's
        (score,), _ = score_responses(self.reward, [self.prompt], [turn.text], [self.metadata], timeout=None)
        return EpisodeStep(done=True, reward=score, metrics={"tool_calls": 0.0, "tool_errors": 0.0})


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large (at most 64)")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, e.g. "(3 + 4) * 12 / 5".
    """
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    value = _evaluate(ast.parse(expression, mode="eval").body)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


def run_python(code: str) -> str:
    """Run Python code in a sandbox (no network, a private temporary folder, 5 s) and return what it prints.

    Args:
        code: the Python program; print the values you need.
    """
    result = run_tests(code, ["None"], SandboxLimits(timeout=5.0, output_bytes=2000))
    text = result.output
    if result.timed_out:
        text += "\nerror: the program did not finish within 5 s"
    elif result.error:
        text += f"\nerror: {result.error}"
    return text.strip() or "(no output)"
