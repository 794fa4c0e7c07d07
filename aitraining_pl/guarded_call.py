"""Calling user code that may hang or end the process: a wall-clock timeout and ``os._exit`` caught.

``guarded_call(fn, args, timeout)`` runs ``fn(*args)`` in a daemon worker thread that carries the caller's
context (``contextvars``, torch's grad and inference modes, the current CUDA device) and waits at most
``timeout`` seconds (``None``: no limit). A call that has not returned by then raises ``CallTimeout``; the
thread is left running (Python cannot stop a thread) and the caller is expected to end the run. ``os._exit``
called from that thread raises ``ExitCalled`` instead of ending the process silently; every other thread and
every forked child still exits normally. A call made from inside a guarded call with no timeout runs directly.

A SIGTERM that arrives while the main thread waits for the call (a scheduler preempting the run) runs the handler
installed before (Lightning's, which records it) and then raises ``CallInterrupted``, a Lightning
``SIGTERMException``: the run stops as Lightning stops it between steps (the command line exits with status 143),
instead of waiting for a call that may never return. Without a Python handler SIGTERM ends the process as usual.

``exits_watched()`` covers the threads the function starts: while it is open, ``os._exit`` from any thread of this
process other than the main thread raises ``ExitCalled`` in that thread (which ends it) and is recorded in the list
it yields, for the caller to fail loudly (the agent environment stops the run with one line naming the thread).

Limits: a function that installs signal handlers (``signal.signal`` works only in the main thread) fails in
the worker thread; ``posix._exit`` or a crash of the interpreter still ends the process (only a subprocess could
see it); a function that swallows ``BaseException`` can hide ``ExitCalled``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException


class CallTimeout(Exception):
    """The call did not return within the timeout."""


class ExitCalled(SystemExit):
    """The call ran ``os._exit(code)``; ``code`` is the status it asked for."""


class CallInterrupted(SIGTERMException):
    """SIGTERM arrived while waiting for the call (see the module docstring)."""


_real_exit = os._exit
_guarded: set[int] = set()  # idents of the worker threads whose os._exit raises
_watches: list[list] = []  # open ``exits_watched`` lists: (thread name, code) of each os._exit they caught
_lock = threading.Lock()


def _exit(code: int) -> None:
    if os.getpid() == _pid:
        if threading.get_ident() in _guarded:
            raise ExitCalled(code)
        if _watches and threading.current_thread() is not threading.main_thread():
            with _lock:
                for seen in _watches:
                    seen.append((threading.current_thread().name, code))
            raise ExitCalled(code)
    _real_exit(code)


@contextlib.contextmanager
def exits_watched():
    """While open, ``os._exit`` from a thread of this process other than the main one raises ``ExitCalled`` in that
    thread instead of ending the process, and is recorded in the yielded list as (thread name, code)."""
    global _pid
    seen: list[tuple[str, int]] = []
    with _lock:
        _pid = os.getpid()
        os._exit = _exit
        _watches.append(seen)
    try:
        yield seen
    finally:
        with _lock:
            _watches.remove(seen)


_pid = os.getpid()
_SLICE = 0.25  # seconds between the main thread's looks at pending signals while it waits


@contextlib.contextmanager
def _sigterm_interrupts():
    """In the main thread, while the caller waits: SIGTERM runs the previous Python handler, then raises
    ``CallInterrupted`` (out of ``_join``, which gives the main thread a chance to handle it at least every
    ``_SLICE`` seconds)."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return

    def interrupt(signum, frame) -> None:
        previous(signum, frame)
        raise CallInterrupted()

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _join(worker: threading.Thread, timeout: float | None) -> None:
    """``worker.join(timeout)`` in slices of at most ``_SLICE`` seconds: a signal the kernel hands to another thread
    is handled (by the main thread) only when the main thread runs Python code, which one long join never does."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while worker.is_alive():
        left = _SLICE if deadline is None else min(_SLICE, deadline - time.monotonic())
        if left <= 0:
            return
        worker.join(left)


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
    with _sigterm_interrupts():
        worker.start()
        _join(worker, timeout)
    if worker.is_alive():
        raise CallTimeout(f"did not return within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
