"""JSON over HTTP with the standard library, for the requests made outside the chat client (the server's facts,
its tokenizer, the endpoint check). :func:`http_json` returns every HTTP answer, whatever its status; anything else
raises :class:`NoHttpAnswer`. The ``timeout`` bounds each blocking step (connecting, each read), as ``urllib`` does.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from .llm_http import body_excerpt


class NoHttpAnswer(Exception):
    """No HTTP answer came back. ``kind``: ``"timeout"`` (connected or not, nothing within the timeout),
    ``"unreachable"`` (refused, unknown host, reset) or ``"not_http"`` (bytes that are not an HTTP answer)."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class HttpAnswer:
    """One HTTP answer: ``status_code`` and the ``raw`` body; :attr:`body` (the decoded JSON, else the text) is what
    :func:`.llm_http.server_reason` reads."""

    url: str
    status_code: int
    raw: bytes

    def __str__(self) -> str:  # what an error message quotes when the body says nothing
        return f"HTTP {self.status_code} from {self.url}" + ("" if self.raw else ", empty body")

    def json(self) -> Any:
        """The body as JSON (UTF-8); ``ValueError`` when it is not."""
        return json.loads(self.raw.decode("utf-8"))

    @property
    def body(self) -> Any:
        try:
            return self.json()
        except ValueError:
            return self.raw.decode("utf-8", errors="replace")

    def excerpt(self, limit: int = 160) -> str:
        return body_excerpt(self.raw, limit)


def http_json(url: str, payload: Any = None, api_key: str | None = None, timeout: float = 10.0) -> HttpAnswer:
    """``GET url`` (``payload`` ``None``) or ``POST url`` with ``payload`` as JSON, the key as a bearer token; see
    the module docstring."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = None
    if payload is not None:
        data = json.dumps(payload).encode("utf-8")
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (the configured endpoint)
            return HttpAnswer(url, response.status, response.read())
    except urllib.error.HTTPError as error:
        try:
            raw = error.read()
        except (OSError, http.client.HTTPException):
            raw = b""
        return HttpAnswer(url, error.code, raw)
    except (TimeoutError, urllib.error.URLError) as error:
        if isinstance(getattr(error, "reason", error), TimeoutError):  # bare, or wrapped by urllib
            raise NoHttpAnswer(f"no answer within {timeout:g} s", "timeout") from error
        raise NoHttpAnswer(f"cannot connect ({error.reason})", "unreachable") from error
    except http.client.RemoteDisconnected as error:
        raise NoHttpAnswer("the server closed the connection without answering", "unreachable") from error
    except http.client.HTTPException as error:
        raise NoHttpAnswer(
            f"an answer that is not HTTP ({type(error).__name__}: {body_excerpt(str(error), 120)})", "not_http"
        ) from error
    except OSError as error:
        raise NoHttpAnswer(f"the connection failed ({type(error).__name__}: {error})", "unreachable") from error
