"""Bounded Hub downloads, torch-free: after :func:`longpeft.files.hub_preflight`, every download request of the
process waits at most ``LONGPEFT_HUB_TIMEOUT`` seconds of the Hub's silence, then ends in one HubTimeoutError.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .errors import ConfigError, HubTimeoutError

HUB_TIMEOUT_VARIABLE = "LONGPEFT_HUB_TIMEOUT"
DEFAULT_HUB_TIMEOUT = 30.0  # seconds


def hub_timeout() -> float:
    """``LONGPEFT_HUB_TIMEOUT``: seconds (default 30) to wait on a silent Hub; a ConfigError unless a number > 0."""
    text = os.environ.get(HUB_TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_HUB_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(
            f"{HUB_TIMEOUT_VARIABLE}={text!r}: give the seconds to wait on a silent Hub, a number > 0 "
            f"(default {DEFAULT_HUB_TIMEOUT:g})"
        )
    return value


class _HubWait:
    """How long the Hub has sent nothing while requests (of any thread) waited on it; any answer or byte resets it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.silent_since: float | None = None  # when the Hub last sent something, while requests wait in vain
        self.gave_up: str | None = None  # the message once the wait ran out: later requests are refused at once

    def ask_again(self) -> None:
        """Forget an earlier silence (a new pre-check): requests are sent again."""
        with self.lock:
            self.silent_since, self.gave_up = None, None

    def answered(self) -> None:
        with self.lock:
            self.silent_since = None

    def budget(self, url: Any) -> float:
        """Seconds a request for ``url`` may wait now; refuses it when the wait has run out."""
        limit = hub_timeout()
        with self.lock:
            waited = 0.0 if self.silent_since is None else time.monotonic() - self.silent_since
            if self.gave_up is None and waited >= limit:
                self.gave_up = _silent_hub_message(url, limit)
            if self.gave_up is not None:
                raise HubTimeoutError(self.gave_up)
        return max(limit - waited, 0.05)

    def timed_out(self, url: Any, waiting_since: float, error: BaseException) -> None:
        """A request for ``url`` waiting since ``waiting_since`` got nothing: a HubTimeoutError once the Hub has been
        silent for the whole wait; before, the library's own error goes on (its retries run in the time left)."""
        limit = hub_timeout()
        with self.lock:
            if self.silent_since is None or waiting_since < self.silent_since:
                self.silent_since = waiting_since
            if time.monotonic() - self.silent_since < limit * 0.99:  # a socket's timeout may end a hair early
                return
            self.gave_up = _silent_hub_message(url, limit)
        raise HubTimeoutError(self.gave_up) from error


_HUB_WAIT = _HubWait()
ask_again = _HUB_WAIT.ask_again


XET_TIMEOUTS = ("HF_XET_CLIENT_CONNECT_TIMEOUT", "HF_XET_CLIENT_READ_TIMEOUT")  # hf_xet's own knobs
_RESOLVE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/[^/]+/(.+)$")
_API = re.compile(r"^/api/(models|datasets|spaces)/([^/]+/[^/]+?)(/tree/.*|/revision/.*|/paths-info/.*)?$")


def _silent_hub_message(url: Any, limit: float) -> str:
    """One line for a Hub at ``url`` silent for ``limit`` seconds: the repo, the file, the endpoint, what to do."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(str(url))
    server, path = f"{parts.scheme}://{parts.netloc}", unquote(parts.path)
    file, api = _RESOLVE.match(path), _API.match(path)
    if file:
        kind = f"{file.group(1)[:-1]} " if file.group(1) else ""
        doing = f"while downloading {file.group(3)} of {kind}{file.group(2)}"
    elif api:
        kind = "" if api.group(1) == "models" else f"{api.group(1)[:-1]} "
        listing = (api.group(3) or "").startswith(("/tree", "/paths-info"))
        doing = f"while {'listing the files of' if listing else 'asking about'} {kind}{api.group(2)}"
    else:
        doing = f"while downloading {path.rsplit('/', 1)[-1] or path} (a file the Hub sent the download to)"
    return (
        f"the Hub at {server} sent nothing for {limit:g} s {doing}; check the network and HF_ENDPOINT, raise "
        f"{HUB_TIMEOUT_VARIABLE} on a slow link, or give a local folder (a rerun resumes what was downloaded)"
    )


def bound_hub_requests() -> None:
    """Bound every later GET and HEAD request huggingface_hub sends in this process (uploads are left alone) by
    :func:`hub_timeout` of the Hub's silence; then it and every later one end in a HubTimeoutError until the next
    :func:`ask_again`. Installed once, around the client factory in use; hf_xet's own client gets the same connect
    and read timeouts (:data:`XET_TIMEOUTS`) unless set.
    """
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    factory = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)
    if getattr(factory, "bounded_by_longpeft", False):
        return
    wait = f"{max(round(hub_timeout() * 1000), 1)}ms"  # hf_xet reads durations as humantime text
    for name in XET_TIMEOUTS:
        os.environ.setdefault(name, wait)
    bounded = functools.partial(_bounded_client, factory)
    bounded.bounded_by_longpeft = True  # type: ignore[attr-defined]
    set_client_factory(bounded)


def _bounded_client(make_client: Callable[[], Any]) -> Any:
    """A client of ``make_client`` whose ``send`` of GET and HEAD requests keeps the :class:`_HubWait` clock."""
    client = make_client()
    library = sys.modules[type(client).__module__.split(".")[0]]  # httpx, or httpx2 (huggingface_hub >= 2)
    send = client.send

    def bounded_send(request: Any, **kwargs: Any) -> Any:
        if request.method not in ("GET", "HEAD"):
            return send(request, **kwargs)
        left = _HUB_WAIT.budget(request.url)
        timeouts = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {
            kind: left if timeouts.get(kind) is None else min(timeouts[kind], left)
            for kind in ("connect", "read", "write", "pool")
        }
        started = time.monotonic()
        try:
            response = send(request, **kwargs)
        except library.TimeoutException as error:
            _HUB_WAIT.timed_out(request.url, started, error)
            raise
        if kwargs.get("stream"):  # a download: its headers alone are no progress, its bytes are
            response.stream = _watched_body(library, response.stream, request.url, started)
        else:
            _HUB_WAIT.answered()
        return response

    client.send = bounded_send
    return client


def _watched_body(library: Any, stream: Any, url: Any, requested: float) -> Any:
    """``stream``, a download's body asked for at ``requested`` (``time.monotonic()``), whose bytes reset the
    :class:`_HubWait` clock and whose read timeouts count as silence since the last byte."""

    class Watched(library.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            last = requested
            try:
                for chunk in stream:
                    _HUB_WAIT.answered()
                    last = time.monotonic()
                    yield chunk
            except library.TimeoutException as error:
                _HUB_WAIT.timed_out(url, last, error)
                raise

        def close(self) -> None:
            stream.close()

    return Watched()
