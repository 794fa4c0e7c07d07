"""The code-generation environment: syntax, style and test-case rewards.

Test cases run in the code sandbox (``aitraining_pl.environments.sandbox``): the response's code runs in a
separate, resource-limited process (on Linux in its own PID, network and read-only mount namespaces, as
``nobody`` when the trainer is root), and each test statement is evaluated by a supervisor process that only
receives the values the candidate's functions return, so printing a result line, replacing builtins or reading
the runner's frames cannot raise the score. See that module's docstring for what it does not protect against.
"""

from __future__ import annotations

import ast
import os
import sys
import warnings
from collections.abc import Sequence
from functools import cache, lru_cache
from typing import Any

from aitraining_pl.environments.sandbox import SandboxLimits, TestRunResult, run_tests  # noqa: F401 (re-export)
from aitraining_pl.environments.text import MultiObjectiveRewardEnv
from aitraining_pl.errors import SandboxError

#: Built-in tasks: (prompt, test cases). Each test case is a Python statement that raises if it fails.
DEFAULT_CODE_TASKS = (
    (
        "Write a Python function add(a, b) that returns the sum of a and b.\n",
        ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"],
    ),
    (
        "Write a Python function is_even(n) that returns True when n is even.\n",
        ["assert is_even(4) is True", "assert is_even(7) is False", "assert is_even(0) is True"],
    ),
    (
        "Write a Python function reverse_string(s) that returns s reversed.\n",
        ["assert reverse_string('abc') == 'cba'", "assert reverse_string('') == ''"],
    ),
    (
        "Write a Python function maximum(xs) that returns the largest number in the list xs.\n",
        ["assert maximum([1, 5, 3]) == 5", "assert maximum([-2, -7]) == -2"],
    ),
    (
        "Write a Python function factorial(n) that returns n! for n >= 0.\n",
        ["assert factorial(0) == 1", "assert factorial(5) == 120"],
    ),
    (
        "Write a Python function count_vowels(s) that returns how many vowels (aeiou) s contains.\n",
        ["assert count_vowels('banana') == 3", "assert count_vowels('xyz') == 0"],
    ),
)


def run_test_cases(code: str, tests: Sequence[str], timeout: float = 5.0) -> TestRunResult:
    """Run ``code`` then each test statement in the sandbox (see ``aitraining_pl.environments.sandbox``) with
    ``timeout`` wall-clock seconds for the whole run; ``0 <= passed <= len(tests)``."""
    result = run_tests(code, tests, SandboxLimits(timeout=timeout))
    if result.error.startswith(("could not start", "the code sandbox does not run")):
        _warn_once(result.error)
    return result


@cache
def check_sandbox(timeout: float = 30.0) -> None:
    """Run ``x = 1`` and one test in the sandbox once per process; raise ``SandboxError`` when the candidate
    cannot start (an interpreter the jail cannot run, a missing standard library), where every test would
    otherwise score 0. Not run where the sandbox does not run at all (``run_test_cases`` warns there)."""
    if os.name != "posix":
        return
    result = run_tests("x = 1", ["assert x == 1"], SandboxLimits(timeout=timeout))
    if result.passed != 1:
        why = result.error or "the probe test failed"
        said = " ".join(result.output.split())[:200]
        raise SandboxError(
            f"code sandbox ({os.path.realpath(sys.executable)})",
            f"the candidate cannot run `x = 1`: {why}{f' (it printed: {said})' if said else ''}; every test "
            "would score 0 (see docs/sandbox.md)",
        )


@cache
def _warn_once(message: str) -> None:
    warnings.warn(f"code sandbox: {message}; every test of the code environment scores 0", stacklevel=3)


def extract_code(response: str) -> str:
    """The first fenced code block of ``response`` (```python ... ```), or the whole response."""
    if "```" in response:
        body = response.split("```", 2)[1]
        first, _, rest = body.partition("\n")
        return rest if first.strip().isidentifier() or not first.strip() else body
    return response


#: ``last_components`` key (logged as ``train/reward/analysis_failed``): 1.0 for a response whose code could not
#: be analysed at all (the parser ran out of recursion depth or memory, e.g. ``x = ---...1``), else 0.0.
ANALYSIS_FAILED = "analysis_failed"


@lru_cache(maxsize=32)
def analyse_code(code: str) -> tuple[ast.Module | None, bool]:
    """``(tree, failed)``: the parsed module, or ``None`` when the code does not parse; ``failed`` is True when
    the parser itself gave up (``RecursionError``, ``MemoryError``, ...) rather than finding a syntax error.
    Never raises: any response is a score, never the end of a run (cached: syntax and style share it)."""
    try:
        return ast.parse(code), False
    except (SyntaxError, ValueError):
        return None, False
    except Exception:  # noqa: BLE001 - RecursionError, MemoryError, OverflowError: the minimum score, counted
        return None, True


def syntax_reward(prompt: str, generated: str, full_text: str) -> float:
    """1.0 when the response's code is non-empty and compiles, else 0.0 (also when it cannot be analysed)."""
    code = extract_code(generated)
    if not code.strip():
        return 0.0
    tree, _ = analyse_code(code)
    if tree is None:
        return 0.0
    try:
        compile(tree, "<response>", "exec")
    except Exception:  # noqa: BLE001 - SyntaxError (e.g. 'return' outside a function), RecursionError
        return 0.0
    return 1.0


def style_reward(prompt: str, generated: str, full_text: str) -> float:
    """Share of PEP 8-like checks passed (0.0 if the code does not parse or cannot be analysed): lines of at
    most 79 characters, no tab indentation, no trailing whitespace, snake_case function names, and a docstring
    on every function."""
    code = extract_code(generated)
    tree, _ = analyse_code(code)
    if tree is None or not code.strip():
        return 0.0
    lines = code.splitlines()
    try:
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        documented = bool(functions) and all(ast.get_docstring(f) for f in functions)
    except Exception:  # noqa: BLE001 - a tree too deep to walk scores the minimum
        return 0.0
    checks = (
        all(len(line) <= 79 for line in lines),
        not any(line.startswith("\t") for line in lines),
        not any(line != line.rstrip() for line in lines),
        all(f.name == f.name.lower() for f in functions),
        documented,
    )
    return sum(checks) / len(checks)


def make_tests_reward(timeout: float):
    """A component scoring the share of ``metadata["tests"]`` passed (0.0 when the prompt has no tests)."""

    def tests_reward(prompt: str, generated: str, full_text: str, metadata: dict[str, Any] | None = None) -> float:
        tests = (metadata or {}).get("tests") or []
        if not tests or not syntax_reward(prompt, generated, full_text):
            return 0.0
        return run_test_cases(extract_code(generated), tests, timeout).fraction

    return tests_reward


class CodeGenerationEnv(MultiObjectiveRewardEnv):
    """A ``MultiObjectiveRewardEnv`` for writing Python functions.

    Components: ``syntax`` (the code compiles), ``style`` (share of simple PEP 8 checks) and ``tests`` (share
    of the prompt's test cases passed, run in the code sandbox with a time limit; see
    ``aitraining_pl.environments.sandbox`` for what that does and does not protect against). A response whose
    code cannot be analysed at all (the parser runs out of recursion depth or memory) scores 0 in each, and
    ``last_components["analysis_failed"]`` (unweighted) counts it, never an exception. The code is the
    first fenced block of the response, or the whole response. As a class it can be named in YAML as a PPO
    reward source.

    Args:
        tokenizer: a Hugging Face tokenizer or a name for ``load_tokenizer`` (only episodes use it).
        prompts: task descriptions; default: the built-in ``DEFAULT_CODE_TASKS``.
        test_cases: one list of Python assert statements per prompt (default: the built-in tasks' tests).
        timeout: wall-clock seconds allowed for one response's test run.
        max_length: maximum tokens of prompt plus response.
        syntax_weight: weight of the syntax component.
        style_weight: weight of the style component.
        tests_weight: weight of the test-case component.

    Raises:
        SandboxError: at construction, when the sandbox cannot start the candidate on this machine (checked
            once per process with ``check_sandbox``) and there are tests to run.
        **kwargs: other ``TextGenerationEnv`` arguments.
    """

    def __init__(
        self,
        tokenizer: Any = "byte",
        prompts: Sequence[str] | None = None,
        test_cases: Sequence[Sequence[str]] | None = None,
        timeout: float = 5.0,
        max_length: int = 512,
        syntax_weight: float = 1.0,
        style_weight: float = 0.1,
        tests_weight: float = 1.0,
        **kwargs: Any,
    ):
        if prompts is None:
            prompts = [p for p, _ in DEFAULT_CODE_TASKS]
            test_cases = [t for _, t in DEFAULT_CODE_TASKS] if test_cases is None else test_cases
        test_cases = list(test_cases) if test_cases is not None else [[] for _ in prompts]
        if len(test_cases) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(test_cases)} lists of test cases")
        if tests_weight and any(test_cases):
            check_sandbox()  # an environment that cannot run the tests fails here, once, not as a reward of 0
        super().__init__(
            tokenizer,
            list(prompts),
            reward_components={"syntax": syntax_reward, "style": style_reward, "tests": make_tests_reward(timeout)},
            reward_weights={"syntax": syntax_weight, "style": style_weight, "tests": tests_weight},
            prompt_metadata=[{"tests": list(t)} for t in test_cases],
            max_length=max_length,
            **kwargs,
        )

    def score(self, prompt: str, generated: str, metadata: dict | None = None) -> tuple[float, dict[str, float]]:
        """The weighted sum of the components, and each component plus ``analysis_failed`` (1.0 when the code
        could not be analysed and scored the minimum; not weighted, logged as ``train/reward/analysis_failed``)."""
        total, parts = super().score(prompt, generated, metadata)
        code = extract_code(self.truncate_at_stop(generated)[0])
        return total, {**parts, ANALYSIS_FAILED: float(analyse_code(code)[1])}


def create_code_generation_env(tokenizer: Any, **kwargs: Any) -> CodeGenerationEnv:
    """The seed's code environment: ``CodeGenerationEnv(tokenizer, **kwargs)`` (syntax, style, tests)."""
    return CodeGenerationEnv(tokenizer, **kwargs)
