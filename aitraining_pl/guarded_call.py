"""Calling user code that may hang or end the process: a wall-clock timeout and ``os._exit`` caught.

``guarded_call(fn, args, timeout)`` runs ``fn(*args)`` in a daemon worker thread that carries the caller's
context (``contextvars``, torch's grad and inference modes, the current CUDA device) and waits at most
``timeout`` seconds (``None``: no limit). A call that has not returned by then raises ``CallTimeout``; the
thread is left running (Python cannot stop a thread) and the caller is expected to end the run. ``os._exit``
called from that thread raises ``ExitCalled`` instead of ending the process silently; every other thread and
every forked child still exits normally. A call made from inside a guarded call with no timeout runs directly.

Limits: a function that installs signal handlers (``signal.signal`` works only in the main thread) fails in
the worker thread; ``os._exit`` from a thread the function starts, or ``posix._exit``, still ends the process;
a function that swallows ``BaseException`` can hide ``ExitCalled``.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


class CallTimeout(Exception):
    """The call did not return within the timeout."""


class ExitCalled(SystemExit):
    """The call ran ``os._exit(code)``; ``code`` is the status it asked for."""


_real_exit = os._exit
_guarded: set[int] = set()  # idents of the worker threads whose os._exit raises
_lock = threading.Lock()


def _exit(code: int) -> None:
    if threading.get_ident() in _guarded and os.getpid() == _pid:
        raise ExitCalled(code)
    _real_exit(code)


_pid = os.getpid()


def guarded_call(fn: Callable, args: Sequence[Any], timeout: float | None) -> Any:
    """``fn(*args)`` with a timeout and ``os._exit`` raising ``ExitCalled`` (see the module docstring)."""
    global _pid
    if timeout is None and threading.get_ident() in _guarded:
        return fn(*args)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    context, outcome = contextvars.copy_context(), {}

    def work() -> None:
        ident = threading.get_ident()
        with _lock:
            _guarded.add(ident)
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                outcome["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the caller as is
            outcome["error"] = err
        finally:
            with _lock:
                _guarded.discard(ident)

    with _lock:
        _pid = os.getpid()
        os._exit = _exit
    worker = threading.Thread(target=context.run, args=(work,), daemon=True, name="aitraining_pl guarded call")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise CallTimeout(f"did not return within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
