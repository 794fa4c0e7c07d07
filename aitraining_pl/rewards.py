"""Reward sources for PPO: what scores a batch of sampled responses.

**The reward-source protocol.** A reward source is any callable

    source(prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]

(the seed's ``reward_fn(prompts, responses, metadata)`` signature) returning one finite float per response.
``metadata[i]`` holds the extra columns of prompt ``i`` (e.g. a math problem's answer); it is ``{}`` when
the prompt data has none. A function written for TRL, ``fn(prompts, completions, **kwargs)``, works too: it gets
each extra column by name (``ColumnKeywordReward``).

A source may also expose the per-component scores of its *last* call as an attribute
``last_components: dict[str, list[float]]`` (each list as long as ``responses``; ``None`` where a component did
not apply); the online modules log each component's mean as ``train/reward/<name>``. RL environments act as
reward sources by implementing this protocol.

An exception (``SystemExit`` included), ``os._exit``, a call that does not return within the timeout (the
online modules' ``reward_timeout``, default ``DEFAULT_REWARD_TIMEOUT`` = 600 s), a result of the wrong length,
a value that is not a number, or a non-finite value stops the run with a ``RewardError`` naming the source and
the first bad index (see ``score_responses``); the command line prints it as one line.

Reward sources are named in YAML by ``build_reward_source``:

- ``"package.module:function"`` or ``"package.module.function"``: a callable by import path;
- a folder path or hub id (``org/name``): a reward model, either saved by ``RewardModule``
  (``reward_config.json``; ``aitraining_pl.models.reward``) or any ``AutoModelForSequenceClassification``
  with one label (``aitraining_pl.models.sequence_classifier``: re-tokenized with its own tokenizer and chat
  template); see ``aitraining_pl.models.reward_sources.load_reward_source``;
- ``{"class_path": "package.module.Class", "init_args": {...}}``: an object built from a class, e.g. an
  RL environment;
- ``{"components": {name: {"source": <any of the above>, "weight": w, "kwargs": {...}}, ...}}``: the
  weighted sum of named components (``WeightedRewards``).
- ``{"url": "http://...", "timeout": ..., "retries": ..., "headers": {...}}``: a reward server over HTTP, and
  ``{"base_url": "http://.../v1", "model": ..., "template": ...}``: an LLM judge behind an OpenAI-compatible
  endpoint (``aitraining_pl.remote_rewards``: ``RemoteReward``, ``JudgeReward``).

``kwargs`` bind keyword arguments of a function source (``functools.partial``) and are the constructor
arguments of a reward-model source (``batch_size``, ``max_length``, ``trust_remote_code``, ...).

Remote code: a reward model's own code runs only when ``kwargs`` say ``trust_remote_code: true``; nothing in
a saved folder (``reward_config.json``, ``config.json``'s ``auto_map``) can turn it on.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from aitraining_pl.errors import RewardError  # noqa: F401 - re-exported: raised by every check below
from aitraining_pl.guarded_call import CallInterrupted, CallTimeout, ExitCalled, guarded_call


@runtime_checkable
class RewardSource(Protocol):
    """``(prompts, responses, metadata) -> list[float]``; optional attribute ``last_components``."""

    def __call__(self, prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]: ...


# ---------------------------------------------------------------------------------------------------------
# Built-in reward functions (for the quickstart and tests). Each follows the protocol.


def char_fraction_reward(prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
    """Share of a response's characters that are in ``metadata["target_chars"]`` (default: lowercase vowels).

    Empty responses score 0. Easy for a tiny random model to increase, hence the quickstart's reward.
    """
    scores = []
    for response, meta in zip(responses, metadata):
        targets = set((meta or {}).get("target_chars") or "aeiou")
        scores.append(sum(c in targets for c in response) / len(response) if response else 0.0)
    return scores


def char_length_reward(prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
    """Response length in characters divided by ``metadata["target_length"]`` (default 100), capped at 1."""
    return [min(1.0, len(r) / float((m or {}).get("target_length") or 100)) for r, m in zip(responses, metadata)]


def exact_answer_reward(prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
    """1.0 when a response is exactly ``metadata["answer"]`` (surrounding spaces and a final full stop aside),
    0.5 when its last number is the answer but other text surrounds it (``"14 + 7 = 21"``), else 0.0: the real-model
    quickstart's task (``quickstart_arithmetic.jsonl``), answering with just the number."""
    scores = []
    for response, meta in zip(responses, metadata):
        answer = float((meta or {})["answer"])
        numbers = _NUMBER.findall(response)
        text = response.strip().rstrip(".").strip()
        exact = _NUMBER.fullmatch(text) is not None and float(text) == answer
        scores.append(1.0 if exact else 0.5 if numbers and float(numbers[-1]) == answer else 0.0)
    return scores


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def short_answer_reward(prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
    """The share of a response's words that are ``metadata["answer"]``: 1.0 for just the answer (``"Paris."``),
    ``k / n`` for an ``n``-word response holding the ``k``-word answer (``"The capital of France is Paris."``: 1/6),
    0.0 without it. Words are split on whitespace, compared case-insensitively, with punctuation at their edges
    dropped (a hyphen kept: ``"-3"``) and tokens without a letter or digit (``"="``, ``"-"``) not counted.

    The real-model quickstart's reward (``configs/quickstart/grpo_smollm2.yaml``, ``quickstart_capitals.jsonl``):
    answer with one word. Graded, so a chat model that answers in sentences gets a signal from every shorter
    sample that keeps the answer, and a right answer outranks a short wrong one (0)."""
    scores = []
    for response, meta in zip(responses, metadata):
        answer, words = _words(str((meta or {})["answer"])), _words(response)
        k = len(answer)
        found = k > 0 and any(words[i : i + k] == answer for i in range(len(words) - k + 1))
        scores.append(k / len(words) if found else 0.0)
    return scores


_EDGE_PUNCTUATION = ".,;:!?\"'`()[]{}*_"


def _words(text: str) -> list[str]:
    """``text``'s words for ``short_answer_reward``: casefolded, edge punctuation dropped, letterless ones out."""
    words = (w.strip(_EDGE_PUNCTUATION).casefold() for w in text.split())
    return [w for w in words if any(c.isalnum() for c in w)]


# ---------------------------------------------------------------------------------------------------------
# Combinators and loaders


class WeightedRewards:
    """The weighted sum of named reward sources; the unweighted component scores of the last call are kept
    in ``last_components`` (logged as ``train/reward/<name>``).

    A component may return ``None`` for a response it does not apply to (as in TRL): that response's total is the
    weighted sum of the other components, and the component's logged mean leaves it out. A response no component
    scores gets 0, with a warning.

    Args:
        components: name -> reward source.
        weights: name -> weight (default 1.0 for each component).
    """

    def __init__(self, components: Mapping[str, Callable], weights: Mapping[str, float] | None = None):
        if not components:
            raise ValueError("WeightedRewards needs at least one component")
        unknown = set(weights or {}) - set(components)
        if unknown:
            raise ValueError(f"weights given for unknown components: {', '.join(sorted(unknown))}")
        self.components = dict(components)
        self.weights = {name: float((weights or {}).get(name, 1.0)) for name in self.components}
        self.last_components: dict[str, list[float]] = {}

    def __call__(self, prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
        self.last_components = {}
        total: list[float | None] = [None] * len(responses)
        for name, source in self.components.items():
            scores = _checked_call(source, prompts, responses, metadata, name=name, allow_none=True)
            self.last_components[name] = scores
            total = [t if s is None else (t or 0.0) + self.weights[name] * s for t, s in zip(total, scores)]
        unscored = [i for i, t in enumerate(total) if t is None]
        if unscored:
            import warnings

            warnings.warn(
                f"every reward component returned None for {len(unscored)} of {len(responses)} responses (first: "
                f"index {unscored[0]}); they score 0",
                UserWarning,
                stacklevel=2,
            )
        return [0.0 if t is None else t for t in total]


class ColumnKeywordReward:
    """A reward function written for TRL (``fn(prompts, completions, **kwargs)``, each extra dataset column a
    keyword argument holding one value per response) as a reward source: called as ``fn(prompts=...,
    completions=..., <column>=[...], ...)`` with every key of the rows' ``metadata`` (the prompt data's extra
    columns; a row without the key gives ``None``). ``build_reward_source`` wraps any function with a
    ``completions`` parameter this way; ``completion_ids`` and ``trainer_state`` are not passed.

    Args:
        func: the TRL-style reward function.
    """

    def __init__(self, func: Callable):
        self.func = func  # named in errors by ``_source_name``

    @staticmethod
    def wants_keywords(obj: Any) -> bool:
        """Whether ``obj`` is a function with TRL's ``completions`` parameter."""
        import inspect

        try:
            return callable(obj) and "completions" in inspect.signature(obj).parameters
        except (TypeError, ValueError):
            return False

    def __call__(self, prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float | None]:
        keys = dict.fromkeys(k for row in metadata for k in (row or {}))
        columns = {k: [(row or {}).get(k) for row in metadata] for k in keys if k not in ("prompts", "completions")}
        return self.func(prompts=prompts, completions=responses, **columns)


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def import_object(path: str) -> Any:
    """``"pkg.mod:name"`` or ``"pkg.mod.name"`` -> the object."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RewardError(repr(path), "not an import path like 'package.module:function' nor a reward-model folder")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(f"reward source {path!r}", f"cannot import module {module_name!r}: {err}") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(f"reward source {path!r}", f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _as_reward_error(build: Callable[..., Callable]) -> Callable[..., Callable]:
    """Failures of building a source from its description (a missing or corrupt reward-model folder, a bad
    spec) raised as ``RewardError`` naming the source, or the weights file of a corrupt folder."""

    @functools.wraps(build)
    def checked(spec: Any, **kwargs: Any) -> Callable:
        from aitraining_pl.models.loading import is_load_error, one_line, where_load_failed

        try:
            return build(spec, **kwargs)
        except RewardError:
            raise
        except Exception as err:  # noqa: BLE001 - only load errors (OS, value, safetensors) are converted
            if not is_load_error(err):
                raise
            folder = os.path.expanduser(spec) if isinstance(spec, str) else ""
            where = where_load_failed(folder, err) if folder else None
            raise RewardError(where or f"reward source {str(spec)[:80]!r}", f"cannot build: {one_line(err)}") from err

    return checked


@_as_reward_error
def build_reward_source(spec: Any, *, kwargs: Mapping[str, Any] | None = None) -> RewardSource:
    """A reward source from its YAML/Python description (see the module docstring for the forms).

    A callable is returned as is (with ``kwargs`` bound if given).
    """
    kwargs = dict(kwargs or {})
    if callable(spec):
        return _as_source(spec, kwargs)
    if isinstance(spec, str):
        if os.path.isdir(os.path.expanduser(spec)) or (not spec.startswith((".", "~")) and _HUB_ID.fullmatch(spec)):
            from aitraining_pl.models.reward_sources import load_reward_source

            return load_reward_source(spec, **kwargs)
        if "/" in spec or os.sep in spec:
            raise ValueError(f"reward model folder {spec!r} does not exist (and it is not a hub id 'org/name')")
        obj = import_object(spec)
        if isinstance(obj, type):
            return obj(**kwargs)
        if not callable(obj):
            raise ValueError(f"reward source {spec!r} is not callable")
        return _as_source(obj, kwargs)
    if isinstance(spec, Mapping):
        if "class_path" in spec:
            _check_class_path_keys(spec)
            cls = import_object(spec["class_path"])
            return cls(**{**dict(spec.get("init_args") or {}), **kwargs})
        if "components" in spec:
            components, weights = {}, {}
            for name, item in spec["components"].items():
                item = item if isinstance(item, Mapping) else {"source": item}
                components[name] = build_reward_source(item["source"], kwargs=item.get("kwargs"))
                weights[name] = float(item.get("weight", 1.0))
            return WeightedRewards(components, weights)
        if "source" in spec:
            return build_reward_source(spec["source"], kwargs={**dict(spec.get("kwargs") or {}), **kwargs})
        if "url" in spec or "base_url" in spec:  # a reward server or an LLM judge over HTTP
            from aitraining_pl.remote_rewards import build_remote_source

            return build_remote_source({**spec, **kwargs})
    raise ValueError(
        f"cannot build a reward source from {spec!r}: give an import path, a reward-model folder, "
        "{'class_path': ..., 'init_args': ...}, {'components': {name: {'source': ..., 'weight': ...}}}, "
        "{'url': ...} (a reward server) or {'base_url': ..., 'model': ...} (an LLM judge)"
    )


def _check_class_path_keys(spec: Mapping[str, Any]) -> None:
    """``ValueError`` naming a key of a ``{class_path, init_args}`` reward that is neither (it would be dropped):
    where a command-line override ``--model.init_args.reward.init_args.NAME`` puts its value."""
    extra = [str(k) for k in spec if k not in ("class_path", "init_args")]
    if extra:
        name = extra[0]
        raise ValueError(
            f"reward {{class_path: {spec['class_path']}}}: key {name!r} is neither class_path nor init_args, so it "
            f"would be ignored (a command-line --model.init_args.reward.init_args.{name} lands there): write it "
            f"under init_args in the config, or give the whole reward on the command line: --model.init_args.reward "
            f"'{{class_path: {spec['class_path']}, init_args: {{{name}: ...}}}}'"
        )


def _as_source(func: Callable, kwargs: Mapping[str, Any]) -> Callable:
    """A callable with ``kwargs`` bound; a TRL-style function (``completions`` parameter) wrapped in
    ``ColumnKeywordReward``."""
    bound = functools.partial(func, **kwargs) if kwargs else func
    return ColumnKeywordReward(bound) if ColumnKeywordReward.wants_keywords(func) else bound


def _source_name(source: Any) -> str:
    inner = source
    while hasattr(inner, "func"):  # functools.partial, ColumnKeywordReward
        inner = inner.func
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def _checked_call(
    source: Callable,
    prompts: Sequence[str],
    responses: Sequence[str],
    metadata: Sequence[dict],
    name: str | None = None,
    allow_none: bool = False,
    timeout: float | None = None,
) -> list[float]:
    where = f"reward source {name or _source_name(source)!r}"
    try:
        result = guarded_call(source, (list(prompts), list(responses), list(metadata)), timeout)
    except (RewardError, CallInterrupted):  # a component of a combined source, already named; SIGTERM
        raise
    except CallTimeout:
        raise RewardError(where, f"did not return within {timeout:g} s (reward_timeout)") from None
    except (Exception, SystemExit) as err:  # SystemExit (or os._exit) from a reward source is an error
        first = _first_failing(source, prompts, responses, metadata, timeout)
        at = f" at index {first}" if first is not None else ""
        raise RewardError(where, f"{describe_failure(err)}{at}") from err
    try:
        items = list(result)
    except TypeError:
        raise RewardError(where, f"returned {type(result).__name__}, not a list of floats") from None
    if len(items) != len(responses):
        raise RewardError(where, f"returned {len(items)} scores for {len(responses)} responses")
    scores = []
    for i, item in enumerate(items):
        if item is None and allow_none:  # a component that does not apply to this response
            scores.append(None)
            continue
        try:
            score = float(item) if not isinstance(item, (str, bytes)) else None
        except (TypeError, ValueError):
            score = None
        if score is None:
            kind = type(item).__name__
            hint = " (None is allowed for a component of a weighted reward)" if item is None else ""
            raise RewardError(where, f"returned a {kind} ({item!r:.40}) at index {i}, not a float{hint}")
        if not math.isfinite(score):
            raise RewardError(where, f"returned a non-finite score ({score}) at index {i}")
        scores.append(score)
    return scores


def describe_failure(err: BaseException) -> str:
    """How a call of user code failed, in a few words: ``called os._exit(0)``, ``raised ValueError: ...``."""
    if isinstance(err, ExitCalled):
        return f"called os._exit({err.code!r})"
    if isinstance(err, SystemExit):
        return f"raised SystemExit (sys.exit({err.code!r}))"
    return f"raised {type(err).__name__}: {' '.join(str(err).split())[:200]}"


def _first_failing(
    source: Callable,
    prompts: Sequence[str],
    responses: Sequence[str],
    metadata: Sequence[dict],
    timeout: float | None = None,
) -> int | None:
    """The first index whose response alone makes ``source`` raise or time out (None if each passes alone)."""
    for i in range(len(responses)):
        try:
            guarded_call(source, ([prompts[i]], [responses[i]], [metadata[i]]), timeout)
        except CallInterrupted:
            raise
        except (Exception, SystemExit):
            return i
    return None


#: seconds one call of a reward source may take by default (``reward_timeout`` of the online modules).
DEFAULT_REWARD_TIMEOUT = 600.0


def score_responses(
    source: Callable,
    prompts: Sequence[str],
    responses: Sequence[str],
    metadata: Sequence[dict],
    timeout: float | None = DEFAULT_REWARD_TIMEOUT,
) -> tuple[list[float], dict[str, list[float]]]:
    """Call a reward source and check its result. The call runs in a worker thread (``guarded_call``) that
    may take at most ``timeout`` seconds (``None``: no limit), and where ``os._exit`` raises.

    Returns:
        ``(scores, components)``: one float per response, and the source's ``last_components`` (or ``{}``).

    Raises:
        RewardError: the source raised, exited (``sys.exit`` or ``os._exit``), did not return within
            ``timeout``, returned the wrong number of scores, a value that is not a number, or a NaN/inf score;
            named with the first bad index. After an exception the source is called again on one response at a
            time to find that index.
    """
    scores = _checked_call(source, prompts, responses, metadata, timeout=timeout)
    components = dict(getattr(source, "last_components", None) or {})
    for name, values in components.items():
        if len(values) != len(responses):
            raise RewardError(f"reward component {name!r} has {len(values)} scores for {len(responses)} responses")
    return scores, components


def __getattr__(name: str) -> Any:
    if name in ("RewardModelSource", "load_reward_source"):  # the reward-model sources live in ``models``
        from aitraining_pl.models import reward_sources

        return getattr(reward_sources, name)
    if name in ("RemoteReward", "JudgeReward"):  # the HTTP sources live in ``remote_rewards``
        from aitraining_pl import remote_rewards

        return getattr(remote_rewards, name)
    if name == "length_reward":  # renamed in 0.2: the environments' default reward counts words, this one characters
        import warnings

        warnings.warn(
            "aitraining_pl.rewards.length_reward is deprecated and will be removed in the next release: use "
            "aitraining_pl.rewards.char_length_reward (the same function)",
            DeprecationWarning,
            stacklevel=2,
        )
        return char_length_reward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
