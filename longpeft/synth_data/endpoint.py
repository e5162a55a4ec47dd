"""The server's routes outside the chat client (docs/synth.md), over HTTP with the standard library:
:func:`http_json` (every HTTP answer, whatever its status; :class:`NoHttpAnswer` for anything else; its ``timeout``
bounds each blocking step), :func:`discover` (the context and slots the server reports in ``GET /v1/models`` and
llama.cpp's ``GET /props``; a failure means "not reported") and :func:`prompt_counter` (a prompt's tokens at the
endpoint: the server's tokenizer routes, else ``llm.tokenizer``, else an estimate of one token per word that errs
short; never the training tokenizer, as the endpoint serves another model).
"""

from __future__ import annotations

import http.client
import json
import re
import unicodedata
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .llm_http import body_excerpt
from .llm_request import LLMConfig


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

    @property
    def body(self) -> Any:
        try:
            return json.loads(self.raw.decode("utf-8"))
        except ValueError:
            return self.raw.decode("utf-8", errors="replace")


def http_json(url: str, payload: Any = None, api_key: str | None = None, timeout: float = 10.0) -> HttpAnswer:
    """``GET url`` (``payload`` ``None``) or ``POST url`` with ``payload`` as JSON, the key as a bearer token."""
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


MODEL_CONTEXT_FIELDS = ("max_model_len", "context_length", "max_context_length", "context_window")


@dataclass
class EndpointInfo:
    """What the server reported; ``None`` where it reported nothing."""

    models: list[str] = field(default_factory=list)  # the model ids /v1/models lists
    context_tokens: int | None = None  # tokens one request may hold, prompt and completion
    context_source: str | None = None  # where from: "/v1/models max_model_len"
    slots: int | None = None  # requests decoded at once (llama.cpp's total_slots); more wait in its queue


def server_root(base_url: str) -> str:
    """``http://host:8080/v1`` -> ``http://host:8080`` (llama.cpp serves ``/props`` at the root)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def get_json(url: str, api_key: str | None, timeout: float) -> Any:
    """The decoded body of ``GET url`` (the JSON, else the text), or ``None`` for another status or no answer."""
    try:
        answer = http_json(url, None, api_key, timeout)
    except NoHttpAnswer:
        return None
    return answer.body if answer.status_code == 200 else None


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_models(body: Any, model: str, info: EndpointInfo) -> None:
    """Fill ``info`` from a ``/v1/models`` body: the listed ids and, for ``model`` (else the only model listed),
    its context length."""
    entries = body.get("data") if isinstance(body, dict) else None
    if not isinstance(entries, list):
        return
    entries = [e for e in entries if isinstance(e, dict)]
    info.models = [str(e.get("id")) for e in entries if e.get("id") is not None]
    chosen = [e for e in entries if e.get("id") == model] or (entries if len(entries) == 1 else [])
    for entry in chosen[:1]:
        for name in MODEL_CONTEXT_FIELDS:
            if (tokens := _positive_int(entry.get(name))) is not None:
                info.context_tokens, info.context_source = tokens, f"/v1/models {name}"
                return


def read_props(body: Any, info: EndpointInfo) -> None:
    """Fill ``info`` from llama.cpp's ``/props`` body (slot context and slot count); its slot context wins over
    ``/v1/models`` (it is what one request may use)."""
    if not isinstance(body, dict):
        return
    settings = body.get("default_generation_settings")
    for source, holder in (("default_generation_settings.n_ctx", settings), ("n_ctx", body)):
        tokens = _positive_int(holder.get("n_ctx")) if isinstance(holder, dict) else None
        if tokens is not None:
            info.context_tokens, info.context_source = tokens, f"/props {source}"
            break
    info.slots = _positive_int(body.get("total_slots"))


def discover(base_url: str, model: str, api_key: str | None, timeout: float = 10.0) -> EndpointInfo:
    """Ask the server at ``base_url`` about itself (two GETs, ``timeout`` seconds each); never raises."""
    info = EndpointInfo()
    read_models(get_json(base_url.rstrip("/") + "/models", api_key, timeout), model, info)
    read_props(get_json(server_root(base_url) + "/props", api_key, timeout), info)
    return info


Messages = Sequence[dict[str, Any]]

ESTIMATED = "estimated at one token per word, an under-count"
_WORD = re.compile(r"[^ \t\n\r\f\v]+")
SAMPLE = [{"role": "user", "content": "How many tokens does this short sentence hold?"}]  # the probe of /tokenize


class TokenizeError(Exception):
    """A tokenizer route failed or answered another shape; the message names the URL and quotes the answer."""


@dataclass
class PromptCounter:
    """Counts the tokens of a request's messages (``list[{"role", "content"}]``)."""

    how: str  # what counts them, as console lines and reject reasons say it
    count_messages: Callable[[Messages], int]  # raises TokenizeError when it cannot count

    def count(self, messages: Messages) -> tuple[int, str]:
        """``(tokens, how counted)``. Once :attr:`count_messages` fails, this and every later count is the estimate,
        and ``how`` says why (a silent server would cost its timeout per prompt)."""
        try:
            return self.count_messages(messages), self.how
        except TokenizeError as error:
            self.how, self.count_messages = f"{ESTIMATED}, as the tokenizer failed ({error})", estimate_tokens
            return estimate_tokens(messages), self.how


def estimate_tokens(messages: Messages) -> int:
    """One token per word of the messages' contents: a run of characters between ASCII whitespace that holds a
    character a tokenizer keeps (not only Unicode categories C*, which normalizers may drop)."""
    words = (word for message in messages for word in _WORD.findall(str(message.get("content", ""))))
    return sum(any(not unicodedata.category(character).startswith("C") for character in word) for word in words)


def prompt_counter(config: LLMConfig, api_key: str | None) -> PromptCounter:
    """The counter for ``config``'s endpoint (module docstring): asks the server's tokenizer routes once with a
    sample (each request ``config.lookup_timeout`` at most), then loads ``config.tokenizer`` if set; a missing
    tokenizer folder or Hub repo raises naming ``llm.tokenizer``."""
    server, why_not = server_counter(config.base_url, config.model, api_key, config.lookup_timeout)
    if server is not None:
        return server
    if config.tokenizer:
        return local_counter(config.tokenizer)
    return PromptCounter(f"{ESTIMATED} ({why_not}; llm.tokenizer unset)", estimate_tokens)


def server_counter(base_url: str, model: str, api_key: str | None, timeout: float) -> tuple[PromptCounter | None, str]:
    """``(a counter on the server's tokenizer routes (vLLM's, else llama.cpp's), "")``, or ``(None, why not)``
    when it has none; a server that does not answer at all is not asked twice."""
    root = server_root(base_url)

    def post(route: str, payload: dict[str, Any], field: str, kind: type) -> Any:
        url = root + route
        try:
            answer = http_json(url, payload, api_key, timeout)
        except NoHttpAnswer as error:
            raise TokenizeError(f"{url}: {error}") from error
        body = answer.body if answer.status_code == 200 else None  # decoded JSON, else text
        value = body.get(field) if isinstance(body, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TokenizeError(
                f"{url}: HTTP {answer.status_code} {body_excerpt(answer.raw, 120)}, no {field!r} of the shape"
            )
        return value

    def vllm(messages: Messages) -> int:
        return post("/tokenize", {"model": model, "messages": list(messages)}, "count", int)

    def llama_cpp(messages: Messages) -> int:
        prompt = post("/apply-template", {"messages": list(messages)}, "prompt", str)
        return len(post("/tokenize", {"content": prompt}, "tokens", list))

    def llama_cpp_each(messages: Messages) -> int:
        return sum(
            len(post("/tokenize", {"content": str(message.get("content", ""))}, "tokens", list))
            for message in messages
        )

    routes = (
        ("vLLM POST /tokenize, chat template applied", vllm),
        ("llama.cpp POST /apply-template and /tokenize", llama_cpp),
        ("llama.cpp POST /tokenize of each message's content, not the chat template's tokens", llama_cpp_each),
    )
    for how, count in routes:
        try:
            if count(SAMPLE) > 0:
                return PromptCounter(f"counted by the server's tokenizer ({how})", count), ""
        except TokenizeError as error:
            if isinstance(error.__cause__, NoHttpAnswer):  # nothing answers there: the other routes would wait too
                return None, f"the server's /tokenize did not answer: {error}"
    return None, "the server offers no /tokenize"


def local_counter(name: str) -> PromptCounter:
    """A counter on the tokenizer ``name`` (``llm.tokenizer``: a folder or a Hub id), loaded now."""
    from transformers import AutoTokenizer

    from ..files import check_model_source

    check_model_source(
        name, "llm.tokenizer", "; give the endpoint model's tokenizer (a folder or a Hub id), or unset it"
    )
    tokenizer = AutoTokenizer.from_pretrained(name)

    def ids(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    if getattr(tokenizer, "chat_template", None):

        def templated(messages: Messages) -> int:
            try:
                text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
            except Exception as error:  # the template is the model's code (Jinja): e.g. a role it does not take
                raise TokenizeError(f"llm.tokenizer {name}'s chat template: {type(error).__name__}: {error}") from None
            return ids(text)

        return PromptCounter(f"counted with llm.tokenizer {name} (its chat template applied)", templated)
    return PromptCounter(
        f"counted with llm.tokenizer {name} (each message's content; it has no chat template)",
        lambda messages: sum(ids(str(message.get("content", ""))) for message in messages),
    )
