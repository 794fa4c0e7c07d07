"""What every benchmark shares: TRL's interpreter (``--trl-python`` / ``TRL_PYTHON``) and the header line
printed before the figures (command, date, thread count, versions).

    parser = argparse.ArgumentParser(...)
    add_trl_python(parser)                 # --trl-python, default $TRL_PYTHON; --skip-trl
    args = parser.parse_args()
    require_trl_python(parser, args)       # a usage error saying how to make one when it is missing
    print_header(args.threads, trl_python=None if args.skip_trl else args.trl_python, size=args.size)
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
    if os.path.realpath(python) == os.path.realpath(sys.executable):
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
