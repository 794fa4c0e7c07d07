"""An LLM judge behind an OpenAI-compatible chat endpoint as a reward source."""

from __future__ import annotations

import json
import re
import string
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aitraining_pl.errors import RewardError
from aitraining_pl.remote_rewards.transport import HTTPEndpoint, public_url

#: ``JudgeReward``'s default prompt: a 0-10 rating with the number last.
DEFAULT_JUDGE_TEMPLATE = (
    "Rate how well the response answers the prompt, from 0 (useless) to 10 (perfect).\n\n"
    "Prompt:\n{prompt}\n\nResponse:\n{completion}\n\n"
    "Explain briefly, then end with the rating as a number alone on the last line."
)

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)"
#: the default ``score_pattern``: the last number, read with the scale it is given on ("7/10", "8 out of 10")
DEFAULT_SCORE_PATTERN = rf"({_NUMBER})(?:\s*(?:/|out\s+of)\s*(?P<scale>{_NUMBER}))?"


def parse_judge_score(answer: str, pattern: re.Pattern, score_range: Sequence[float], normalize: bool = True) -> float:
    """The score in a judge's answer: the *last* match of ``pattern`` in ``answer`` (its first group when the pattern
    has groups) read as a number, which must lie in ``score_range = [low, high]``; mapped to ``(s - low) / (high -
    low)`` in [0, 1] when ``normalize``, else returned as is. A pattern with a group named ``scale`` (the default,
    ``DEFAULT_SCORE_PATTERN``: "7/10", "8 out of 10") reads the scale the score is given on, which must be ``high``:
    "Rating: 7/10" is 7, and "4/5" against ``[0, 10]`` is refused rather than read as 4 out of 10.

    Raises:
        ValueError: no match, a match that is not a number, a score on another scale, or a score outside the range
            (the message says which).
    """
    matches = list(pattern.finditer(answer))
    if not matches:
        raise ValueError(f"no score matching {pattern.pattern!r}")
    last = matches[-1]
    text = last.group(1) if pattern.groups else last.group(0)
    try:
        score = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"the score {text!r} is not a number") from None
    low, high = score_range
    scale = last.groupdict().get("scale")
    if scale is not None and float(scale) != high:
        raise ValueError(f"the score {last.group(0)!r} is on a scale of {scale}, not score_range's {high:g}")
    if not (low <= score <= high):  # NaN fails too
        raise ValueError(f"the score {score:g} is outside score_range [{low:g}, {high:g}]")
    return (score - low) / (high - low) if normalize else score


class JudgeReward:
    """An LLM judge as a reward source: each response is rated by a model served behind an OpenAI-compatible
    ``POST {base_url}/chat/completions`` (vLLM, TGI, SGLang, llama.cpp, OpenAI), ``max_concurrency`` requests at a
    time, and its answer parsed into a score by ``parse_judge_score``.

    The request is ``{"model", "messages": [system?, {"role": "user", "content": template filled in}],
    "temperature", "max_tokens"?}``; the score is read from ``choices[0].message.content``. An answer without a
    score, or one outside ``score_range``, stops the run with one line naming the row and quoting the answer
    (``on_unparseable: error``), or scores 0 with a warning (``on_unparseable: zero``).

    Args:
        base_url: the server's OpenAI base URL, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model's name (the request's ``model``).
        template: the user message; ``{prompt}``, ``{completion}`` and any metadata key of the row (e.g.
            ``{answer}``) are filled in (``str.format``: write literal braces as ``{{`` and ``}}``). Default
            ``DEFAULT_JUDGE_TEMPLATE`` (a 0-10 rating, the number last).
        system: an optional system message.
        api_key_env: name of the environment variable holding the API key, sent as ``Authorization: Bearer ...``
            (never written in the config).
        score_pattern: a regular expression for the score; its last match counts (its first group if it has one;
            a group named ``scale`` must match ``score_range``'s high). Default: the last number in the answer, with
            its scale where one is written ("7/10", "8 out of 10": ``DEFAULT_SCORE_PATTERN``).
        score_range: ``[low, high]`` a score must lie in (default ``[0, 10]``).
        normalize: map scores to [0, 1] (``(s - low) / (high - low)``; default) or keep the judge's scale.
        on_unparseable: ``error`` (default) or ``zero``: what an answer without a score in range gives.
        temperature: sampling temperature of the judge (default 0).
        max_tokens: the judge's answer length limit (default: the server's).
        max_concurrency: requests in flight at once (default 4).
        timeout, retries, backoff, headers: as ``HTTPEndpoint``'s, per request (defaults 60 s, 2, 0.5 s, none).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        template: str = DEFAULT_JUDGE_TEMPLATE,
        system: str | None = None,
        api_key_env: str | None = None,
        score_pattern: str | None = None,
        score_range: Sequence[float] = (0.0, 10.0),
        normalize: bool = True,
        on_unparseable: str = "error",
        temperature: float = 0.0,
        max_tokens: int | None = None,
        max_concurrency: int = 4,
        timeout: float = 60.0,
        retries: int = 2,
        backoff: float = 0.5,
        headers: Mapping[str, Any] | None = None,
    ):
        name = f"judge {model!r}"
        where = f"{name} {public_url(str(base_url))}"
        if api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(api_key_env)):
            raise RewardError(where, f"api_key_env must name an environment variable, got {api_key_env!r}")
        headers = {**dict(headers or {}), **({"Authorization": f"Bearer ${{{api_key_env}}}"} if api_key_env else {})}
        self.endpoint = HTTPEndpoint(
            str(base_url).rstrip("/") + "/chat/completions", timeout, retries, backoff, headers, name=name
        )
        where = self.endpoint.where
        try:
            self.fields = {f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(template) if f}
            self.pattern = re.compile(score_pattern if score_pattern is not None else DEFAULT_SCORE_PATTERN)
        except (ValueError, re.error) as err:
            raise RewardError(where, f"bad template or score_pattern: {err}") from None
        if "" in self.fields:
            raise RewardError(where, "the template has a positional field '{}': name it ({prompt}, {completion}, ...)")
        low, high = (float(v) for v in score_range)
        if not low < high:
            raise RewardError(where, f"score_range must be [low, high] with low < high, got {list(score_range)}")
        if on_unparseable not in ("error", "zero"):
            raise RewardError(where, f"on_unparseable must be 'error' or 'zero', got {on_unparseable!r}")
        if not (isinstance(max_concurrency, int) and max_concurrency >= 1):
            raise RewardError(where, f"max_concurrency must be an integer >= 1, got {max_concurrency!r}")
        self.model, self.template, self.system = str(model), template, system
        self.score_range, self.normalize, self.on_unparseable = (low, high), bool(normalize), on_unparseable
        self.sampling = {"temperature": float(temperature), **({"max_tokens": max_tokens} if max_tokens else {})}
        self.max_concurrency = max_concurrency

    def __repr__(self) -> str:
        return f"JudgeReward({self.model!r}, {public_url(self.endpoint.url)!r})"

    def __call__(self, prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
        requests = [self._request(i, p, r, m) for i, (p, r, m) in enumerate(zip(prompts, responses, metadata))]
        if not requests:
            return []
        pool = ThreadPoolExecutor(min(self.max_concurrency, len(requests)), thread_name_prefix="judge")
        try:
            futures = [pool.submit(self._ask, i, request) for i, request in enumerate(requests)]
            answers = [future.result() for future in futures]  # the first failing row, in row order
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        scores, unparsed = [], []
        for i, answer in enumerate(answers):
            try:
                scores.append(parse_judge_score(answer, self.pattern, self.score_range, self.normalize))
            except ValueError as err:
                if self.on_unparseable == "error":
                    why = f"{err} in the answer to row {i}: {self.endpoint.quote(answer)} (on_unparseable: error)"
                    raise RewardError(self.endpoint.where, why) from None
                scores.append(0.0)
                unparsed.append(i)
        if unparsed:
            warnings.warn(
                f"{self.endpoint.where}: {len(unparsed)} of {len(answers)} answers had no score in range (first: row "
                f"{unparsed[0]}, {self.endpoint.quote(answers[unparsed[0]])}); they score 0 (on_unparseable: zero)",
                UserWarning,
                stacklevel=2,
            )
        return scores

    def _request(self, row: int, prompt: str, completion: str, metadata: dict | None) -> dict:
        """The chat request rating one row."""
        values = {**dict(metadata or {}), "prompt": prompt, "completion": completion}
        missing = sorted(self.fields - set(values))
        if missing:
            why = f"template field {{{missing[0]}}} is not prompt, completion or a metadata key of row {row}"
            raise RewardError(self.endpoint.where, why)
        try:
            content = self.template.format_map(values)
        except (KeyError, IndexError, AttributeError, ValueError, TypeError) as err:
            raise RewardError(self.endpoint.where, f"cannot fill the template for row {row}: {err}") from None
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": content}
        ]
        return {"model": self.model, "messages": messages, **self.sampling}

    def _ask(self, row: int, request: dict) -> str:
        """The judge's answer text for one row."""
        try:
            answer = self.endpoint.post(request)
        except RewardError as err:
            raise RewardError(err.where, f"{err.why} (row {row})") from None
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            why = (
                f"the answer to row {row} has no choices[0].message.content: {self.endpoint.quote(json.dumps(answer))}"
            )
            raise RewardError(self.endpoint.where, why)
        return content
