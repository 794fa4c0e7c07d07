"""What both hub adapters share: importing an optional package with one line naming its extra, and one background
event loop that runs a hub's coroutines for the synchronous episode loop."""

from __future__ import annotations

import asyncio
import importlib
import threading
from collections.abc import Coroutine
from types import ModuleType
from typing import Any

from aitraining_pl.errors import ConfigError

_LOOP: asyncio.AbstractEventLoop | None = None
_LOCK = threading.Lock()


def require(module: str, extra: str, who: str) -> ModuleType:
    """Import ``module`` (a hub package) or raise one ``ConfigError`` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".")[0]
        raise ConfigError(who, f"needs {package!r} ({err}): pip install 'aitraining-pl[{extra}]'") from None


def background_loop() -> asyncio.AbstractEventLoop:
    """The process's hub event loop, running in a daemon thread (started on first use). Coroutines of hub
    environments run there, so ``reset`` / ``step`` may be called from any thread (``guarded_call``'s included)."""
    global _LOOP
    with _LOCK:
        if _LOOP is None or _LOOP.is_closed():
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="aitraining-pl-hubs", daemon=True).start()
        return _LOOP


def run_sync(coroutine: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
    """Run ``coroutine`` on the hub loop and wait for its result (its exception is raised here)."""
    return asyncio.run_coroutine_threadsafe(coroutine, background_loop()).result(timeout)
