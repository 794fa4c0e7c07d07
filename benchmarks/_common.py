"""What every benchmark shares: TRL's interpreter (``--trl-python`` / ``TRL_PYTHON``) and the header line
printed before the figures (command, date, thread count, versions).

    parser = argparse.ArgumentParser(...)
    add_trl_python(parser)                 # --trl-python, default $TRL_PYTHON; --skip-trl
    args = parser.parse_args()
    require_trl_python(parser, args)       # a usage error saying how to make one when it is missing
    print_header(args.threads, trl_python=None if args.skip_trl else args.trl_python, size=args.size)

and ``Split``, the mean seconds per part of a steady-state step (each side of a benchmark times its parts the
same way: ``timed`` wrappers, or the hooks of ``time_module`` / ``time_autograd_function`` / ``time_optimizer``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

#: packages whose versions the header reports (those installed), on this project's side and on TRL's
OUR_PACKAGES = ("aitraining-pl", "torch", "transformers", "lightning", "peft")
TRL_PACKAGES = ("trl", "torch", "transformers", "accelerate", "peft")

_VERSIONS = (
    "import importlib.metadata as m, json, sys\n"
    "v = {}\n"
    "for name in sys.argv[1:]:\n"
    "    try:\n"
    "        v[name] = m.version(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "print(json.dumps(v))"
)


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return "<this project's torch version>"


def how_to_make_trl_python() -> str:
    """The commands that make a TRL interpreter (CONTRIBUTING.md, "Benchmarks")."""
    return (
        f"make one with `python -m venv ../trl-venv && ../trl-venv/bin/pip install torch=={_torch_version()} trl`, "
        "then pass --trl-python ../trl-venv/bin/python or set TRL_PYTHON=../trl-venv/bin/python"
    )


def add_trl_python(parser: argparse.ArgumentParser) -> None:
    """``--trl-python`` (default: the ``TRL_PYTHON`` environment variable) and ``--skip-trl``."""
    parser.add_argument(
        "--trl-python",
        default=os.environ.get("TRL_PYTHON") or None,
        help="python of a virtual environment with TRL installed (default: $TRL_PYTHON)",
    )
    parser.add_argument("--skip-trl", action="store_true", help="time only this project's side (no ratios)")


def require_trl_python(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error (exit 2) unless ``--skip-trl`` or an existing, executable ``--trl-python`` / ``TRL_PYTHON``."""
    if args.skip_trl:
        return
    if not args.trl_python:
        parser.error(f"TRL's interpreter is missing: {how_to_make_trl_python()} (or pass --skip-trl)")
    python = os.path.expanduser(args.trl_python)
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        parser.error(
            f"--trl-python / TRL_PYTHON {args.trl_python!r} is not an executable file: {how_to_make_trl_python()}"
        )
    args.trl_python = python


def versions(python: str, packages: tuple[str, ...]) -> dict[str, str]:
    """Installed versions of ``packages`` under the interpreter ``python`` (missing ones left out)."""
    # abspath, not realpath: a virtual environment's python is a link to the base interpreter, as another one's is
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        found = {}
        for name in packages:
            try:
                found[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                pass
        return found
    out = subprocess.run([python, "-c", _VERSIONS, *packages], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip()[-300:]}


def header(threads: int | None, *, trl_python: str | None = None, **extra: Any) -> dict[str, Any]:
    """What the figures were measured with: the command, the date (UTC), the thread count, the CPU count, the
    Python and package versions of this side and (given ``trl_python``) of TRL's, plus ``extra``."""
    return {
        "header": True,
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "threads": threads,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "versions": versions(sys.executable, OUR_PACKAGES),
        "trl_python": trl_python,
        "trl_versions": versions(trl_python, TRL_PACKAGES) if trl_python else None,
        **extra,
    }


def print_header(threads: int | None, *, trl_python: str | None = None, **extra: Any) -> None:
    """Print ``header(...)`` as the first JSON line of a benchmark's output."""
    print(json.dumps(header(threads, trl_python=trl_python, **extra)), flush=True)


def quiet_trainer(**options: Any):
    """A Lightning ``Trainer`` for timing our side: CPU, one device, fp32, ``max_steps`` given by the caller, no
    logger, checkpoints, progress bar, model summary or validation; ``options`` override or add."""
    import lightning.pytorch as pl

    defaults = dict(
        accelerator="cpu", devices=1, precision="32-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    return pl.Trainer(**{**defaults, **options})


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB since it started: Linux's ``VmHWM`` (``/proc/self/status``).

    Not ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux carries that over ``execve`` from the process that forked, so
    a child started by a parent holding 500 MB reports at least 500 MB whatever it used itself. ``ru_maxrss`` is the
    fallback where there is no ``/proc`` (macOS: bytes, not KiB)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0)


def run_child(command: list[str], threads: int, what: str, **env: str) -> dict[str, Any]:
    """Run one measurement in its own process (offline, ``threads`` threads, ``env`` added) and return the JSON
    of its ``RESULT `` line; ``what`` names it in the error when it fails."""
    env = {
        **os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", **env,
    }  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


class Split:
    """Seconds per part of a step: ``step_start`` / ``step_end`` bracket a step, ``add`` (or a ``timed`` wrapper)
    charges time to a part, and what no part took is charged to ``rest``. Steady state: after ``warmup`` steps.

    Args:
        warmup: steps left out of the summary.
        parts: the timed parts, in the order ``step_split`` reports them.
        rest: the name of the remainder of a step.
    """

    def __init__(self, warmup: int, parts: tuple[str, ...], rest: str = "rest"):
        self.warmup, self.parts, self.rest = warmup, tuple(parts), rest
        self.current: defaultdict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.ends: list[float] = []
        self.closers: list = []  # called at step_end, before the rest is computed (intervals that close late)

    def add(self, part: str, seconds: float) -> None:
        self.current[part] += seconds

    def timed(self, part: str, fn, when=lambda *a, **k: True):
        """``fn`` with its calls (those where ``when(*args, **kwargs)``) charged to ``part``."""

        def wrapper(*args, **kwargs):
            if not when(*args, **kwargs):
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - t0)

        return wrapper

    def step_start(self) -> None:
        self.current, self.t0 = defaultdict(float), time.perf_counter()

    def step_end(self) -> None:
        for close in self.closers:
            close()
        end = time.perf_counter()
        self.ends.append(end)
        parts = dict(self.current)
        parts[self.rest] = end - self.t0 - sum(parts.values())
        self.steps.append(parts)

    def steady(self) -> list[dict[str, float]]:
        return self.steps[self.warmup :]

    def rate(self, units_per_step: float) -> float:
        """Units per second over the steady-state steps (their own time, from each start to its end)."""
        steady = self.steady()
        return units_per_step * len(steady) / sum(sum(s.values()) for s in steady)

    def step_split(self) -> dict[str, float]:
        """Mean seconds per steady-state step in each part and the rest (3 decimals)."""
        steady = self.steady()
        return {k: round(sum(s.get(k, 0.0) for s in steady) / len(steady), 3) for k in (*self.parts, self.rest)}


def time_module(split: Split, part: str, module, until) -> None:
    """Charge ``module``'s forward calls to ``part``, and its backward: from the gradient of its first output
    (``last_hidden_state`` of a transformers model) to the gradient of the output of its submodule ``until`` (the
    input embedding: every block's backward lies between). Tensor hooks only, no parameter hooks."""
    import torch

    state = {"t0": None, "backward": None, "end": None}

    def on_gradient(key):
        def hook(output):
            first = output[0] if isinstance(output, tuple) else getattr(output, "last_hidden_state", output)
            if isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(lambda grad: state.update({key: time.perf_counter()}))

        return hook

    started, ended = on_gradient("backward"), on_gradient("end")

    def before(mod, args, kwargs):
        state["t0"] = time.perf_counter()

    def after(mod, args, kwargs, output):
        split.add(part, time.perf_counter() - state["t0"])
        started(output)

    def close():
        if state["backward"] is not None and state["end"] is not None and state["end"] > state["backward"]:
            split.add(part, state["end"] - state["backward"])
        state["backward"] = state["end"] = None

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True)
    until.register_forward_hook(lambda mod, args, output: ended(output))
    split.closers.append(close)


def time_autograd_function(split: Split, part: str, function) -> None:
    """Charge the forward (``apply``) and the backward (its autograd node) of a ``torch.autograd.Function``
    subclass to ``part``, wherever it is called from."""
    import torch

    apply = function.apply

    def timed_apply(*args, **kwargs):
        t0 = time.perf_counter()
        out = apply(*args, **kwargs)
        split.add(part, time.perf_counter() - t0)
        first = out[0] if isinstance(out, tuple) else out
        node = first.grad_fn if isinstance(first, torch.Tensor) else None
        if node is not None:  # the hooks must not hold the node (a cycle through C++ that would keep the graph)
            started = [0.0]
            node.register_prehook(lambda grads: started.__setitem__(0, time.perf_counter()))
            node.register_hook(lambda inputs, grads: split.add(part, time.perf_counter() - started[0]))
        return out

    function.apply = staticmethod(timed_apply)


def time_optimizer(split: Split, part: str = "optimizer") -> tuple:
    """Charge every ``torch.optim.Optimizer.step`` to ``part``, less the closure it runs first (Lightning runs the
    forward and backward in that closure; the Hugging Face Trainer passes none). Returns the two hooks' handles."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    state = {"t0": 0.0}

    def pre(optimizer, args, kwargs):
        state["t0"] = time.perf_counter()
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            return None

        def timed_closure():
            try:
                return closure()
            finally:
                state["t0"] = time.perf_counter()

        args = (args[0], timed_closure, *args[2:]) if len(args) > 1 else args
        return args, ({**kwargs, "closure": timed_closure} if "closure" in kwargs else kwargs)

    def post(optimizer, args, kwargs):
        split.add(part, time.perf_counter() - state["t0"])

    return register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)
