"""The HTTP transport of the remote reward sources: JSON POSTs with a timeout, retries and secret headers, and the
check of returned scores (see ``aitraining_pl.remote_rewards``)."""

from __future__ import annotations

import base64
import http.client
import json
import math
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Mapping
from typing import Any

from aitraining_pl.errors import RewardError

_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SECRET_HEADER = re.compile(r"authorization|key|token|secret|password|cookie", re.IGNORECASE)


def public_url(url: str) -> str:
    """``url`` without credentials, query or fragment (``http://u:p@h:1/p?k=v`` -> ``http://h:1/p``): safe to
    print."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # not a number: refused by ``HTTPEndpoint``
        port = ":?"
    return f"{parts.scheme}://{host}{port}{parts.path}"


def expand_headers(headers: Mapping[str, Any] | None, where: str) -> dict[str, str]:
    """Header values with each ``${ENV_NAME}`` replaced by that environment variable.

    Raises:
        RewardError: a referenced variable is not set (naming the header and the variable, not a value).
    """

    def value(name: str, text: str) -> str:
        def lookup(match: re.Match) -> str:
            if match.group(1) not in os.environ:
                raise RewardError(where, f"header {name!r} reads ${{{match.group(1)}}}, which is not set")
            return os.environ[match.group(1)]

        if not _ENV_REFERENCE.search(text) and _SECRET_HEADER.search(name):
            warnings.warn(
                f"{where}: header {name!r} is written in the config, so it is saved with the run's hyperparameters; "
                "write ${ENV_NAME} to read it from the environment",
                UserWarning,
                stacklevel=4,
            )
        return _ENV_REFERENCE.sub(lookup, text)

    return {str(name): value(str(name), str(text)) for name, text in (headers or {}).items()}


def _check_options(where: str, timeout: float, retries: int, backoff: float) -> None:
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise RewardError(where, f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not (isinstance(retries, int) and not isinstance(retries, bool) and retries >= 0):
        raise RewardError(where, f"retries must be an integer >= 0, got {retries!r}")
    if not (isinstance(backoff, (int, float)) and backoff >= 0):
        raise RewardError(where, f"backoff must be a number of seconds >= 0, got {backoff!r}")


def _jsonable(value: Any) -> Any:
    """A metadata value JSON cannot write (a tensor, a numpy value, a date): its ``tolist()``, else its text."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is answered as its status (``HTTP 307 (not retried)``): the secret headers never follow it."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class HTTPEndpoint:
    """POSTs JSON to one URL with a timeout, retries with exponential backoff and secret headers (see the module
    docstring), and returns the parsed JSON answer of an HTTP 200.

    Args:
        url: ``http://`` or ``https://`` address of the endpoint.
        timeout: seconds to wait for the server (per connect and per read).
        retries: further attempts after a connection error, a timeout, an HTTP 5xx or 429.
        backoff: seconds before the first retry; doubled before each next one.
        headers: extra request headers; values may read environment variables as ``${ENV_NAME}``.
        name: what the endpoint is, for messages (``"remote reward"``, ``"judge 'model'"``).
    """

    def __init__(
        self,
        url: str,
        timeout: float = 30.0,
        retries: int = 2,
        backoff: float = 0.5,
        headers: Mapping[str, Any] | None = None,
        name: str = "remote reward",
    ):
        parts = urllib.parse.urlsplit(str(url))
        self.url = str(url)
        self.where = f"{name} {public_url(self.url)}"
        if parts.scheme not in ("http", "https") or not parts.hostname or ":?" in public_url(self.url):
            raise RewardError(f"{name} {public_url(self.url)!r}", "the url must be http://host[:port]/path or https://")
        _check_options(self.where, timeout, retries, backoff)
        self.timeout, self.retries, self.backoff = float(timeout), retries, float(backoff)
        self._headers = {"Content-Type": "application/json", **expand_headers(headers, self.where)}
        referenced = [os.environ[n] for v in (headers or {}).values() for n in _ENV_REFERENCE.findall(str(v))]
        # urllib does not read ``user:password@``: it is sent as basic auth, and the request goes to the bare host
        self._target = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        if parts.password:
            warnings.warn(
                f"{self.where}: the url holds a password, so it is saved with the run's hyperparameters; send it in "
                "headers as ${ENV_NAME} instead",
                UserWarning,
                stacklevel=3,
            )
        if parts.username is not None:
            pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            self._headers.setdefault("Authorization", "Basic " + base64.b64encode(pair.encode()).decode())
            referenced.append(urllib.parse.unquote(parts.password or ""))
        referenced += [value for _, value in urllib.parse.parse_qsl(parts.query)]  # query values: may be keys
        values = [v for k, v in self._headers.items() if k != "Content-Type"] + referenced
        self._secrets = sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)  # masked in quotes

    def __repr__(self) -> str:  # never the header values
        return f"HTTPEndpoint({public_url(self.url)!r}, headers={sorted(self._headers)})"

    def quote(self, raw: bytes | str) -> str:
        """The start of a server's answer on one line, with every header value replaced by ``***``."""
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return repr(" ".join(text.split())[:120])

    def post(self, payload: Any) -> Any:
        """The parsed JSON answer to ``payload``.

        Raises:
            RewardError: no answer after the retries, an HTTP status other than 200, or an answer that is not JSON.
        """
        data = json.dumps(payload, default=_jsonable).encode()
        attempts = self.retries + 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self._target, data=data, headers=self._headers, method="POST")
            try:
                with _OPENER.open(request, timeout=self.timeout) as response:
                    status, body = response.status, response.read(MAX_ANSWER_BYTES + 1)
            except urllib.error.HTTPError as err:
                status, body = err.code, err.read(MAX_ANSWER_BYTES + 1)
            except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out (URLError, TimeoutError)
                reason = getattr(err, "reason", err)
                timed_out = isinstance(reason, TimeoutError) or "timed out" in str(reason)
                failure = f"no answer within {self.timeout:g} s" if timed_out else f"connection failed ({reason})"
                if attempt + 1 < attempts:
                    continue
                raise RewardError(
                    self.where, f"{failure} after {attempts} attempts (retries: {self.retries})"
                ) from None
            if len(body) > MAX_ANSWER_BYTES:
                raise RewardError(
                    self.where,
                    f"HTTP {status} with an answer of more than {MAX_ANSWER_BYTES >> 20} MiB (read no further)",
                )
            if status == 200:
                try:
                    return json.loads(body)
                except ValueError:
                    raise RewardError(self.where, f"HTTP 200 but the answer is not JSON: {self.quote(body)}") from None
            if (status >= 500 or status == 429) and attempt + 1 < attempts:
                continue
            tried = f"after {attempts} attempts (retries: {self.retries})" if status >= 500 or status == 429 else ""
            raise RewardError(self.where, f"HTTP {status} {tried or '(not retried)'}: {self.quote(body)}")
        raise AssertionError("unreachable")


#: the longest answer a reward server or judge may send; a longer one is refused, read no further than this
MAX_ANSWER_BYTES = 16 << 20


def check_scores(where: str, values: Any, count: int, what: str = "scores", allow_none: bool = False) -> list:
    """``values`` as a list of ``count`` finite floats (``None`` kept where ``allow_none``).

    Raises:
        RewardError: not a list, the wrong length, a value that is not a number (a string or a bool), or NaN/inf;
            naming the first bad index.
    """
    if not isinstance(values, list):
        raise RewardError(where, f'the answer\'s "{what}" is a {type(values).__name__}, not a list')
    if len(values) != count:
        raise RewardError(where, f"returned {len(values)} {what} for {count} responses")
    for i, value in enumerate(values):
        if value is None and allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RewardError(where, f'returned {value!r:.40} at index {i} of "{what}", not a number')
        if not math.isfinite(value):
            raise RewardError(where, f'returned a non-finite score ({value}) at index {i} of "{what}"')
    return [None if v is None else float(v) for v in values]
