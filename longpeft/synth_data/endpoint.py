"""What an OpenAI-compatible server says about itself: context length and parallel slots.

Servers report these in different places, and most report nothing (OpenAI's API does not); every
lookup is tolerant: an unreachable route, a non-JSON body or a missing field means "not reported".

- vLLM and SGLang: ``GET /v1/models`` lists each model with ``max_model_len``; other servers use
  ``context_length``, ``max_context_length`` or ``context_window`` there;
- llama.cpp's server (``llama-server``): ``GET /props`` (at the server root, beside ``/v1``) gives the
  context of one slot as ``default_generation_settings.n_ctx`` (older builds: top-level ``n_ctx``) and
  the number of slots (requests decoded at once) as ``total_slots``. ``/v1/models`` also carries
  ``meta.n_ctx_train``, the model's training context, which is not what the server accepts: not used.

Stdlib only (``urllib``, through :mod:`.http_json`): the lookups run before the chat client starts and must not
depend on its HTTP library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .http_json import NoHttpAnswer, http_json

MODEL_CONTEXT_FIELDS = ("max_model_len", "context_length", "max_context_length", "context_window")


@dataclass
class EndpointInfo:
    """What the server reported; ``None`` where it reported nothing.

    Attributes:
        models: model ids listed by ``/v1/models``.
        context_tokens: tokens one request may hold (prompt and completion), as the server reports it.
        context_source: where ``context_tokens`` came from, e.g. ``"/v1/models max_model_len"``.
        slots: requests the server decodes at once (llama.cpp's ``total_slots``); more wait in its queue.
    """

    models: list[str] = field(default_factory=list)
    context_tokens: int | None = None
    context_source: str | None = None
    slots: int | None = None


def server_root(base_url: str) -> str:
    """``http://host:8080/v1`` -> ``http://host:8080`` (llama.cpp serves ``/props`` at the root)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def get_json(url: str, api_key: str | None, timeout: float) -> Any:
    """The decoded JSON body of ``GET url``, or ``None`` when anything goes wrong (status, network, body)."""
    try:
        answer = http_json(url, None, api_key, timeout)
        return answer.json() if answer.status_code == 200 else None
    except (NoHttpAnswer, ValueError):
        return None


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
            tokens = _positive_int(entry.get(name))
            if tokens is not None:
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
