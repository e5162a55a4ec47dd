"""A Hugging Face Hub on 127.0.0.1 that misbehaves, for the tests and scripts/probe_bad_inputs.py (no network).

- :func:`silent_hub`: accepts connections (the kernel completes them) and never answers a byte.
- :class:`FakeHub`: answers a repo's info (``/api/models/OWNER/NAME``, ``/api/datasets/...``) as the Hub does, so
  longpeft's bounded pre-check passes; then, by ``mode``:

  - ``"stall"``: the revision's info is answered too; every request about files (a file's metadata, a download, a
    listing) is held open, never answered;
  - ``"stall_body"``: a file's metadata is answered and a download gets its headers, then no byte of its body;
  - ``"trickle"``: every file is :attr:`FakeHub.TRICKLED`, sent a byte every :attr:`FakeHub.TRICKLE_GAP` seconds (a
    slow download that never stalls);
  - ``"answer"``: the repo's other API requests (the revision's info, the file listing) are answered with ``answer``
    (JSON of the wrong shape), files are 404.
  - ``"files"``: a repo holding ``files`` (``{name: bytes}``), served as the Hub serves them (listed in its info,
    downloaded whole); any other file is the Hub's 404 of a missing entry.

  In ``stall_body`` and ``trickle`` a listing is answered (empty). API paths about no repo (huggingface_hub's list
  of agent harnesses, ...) are 404.

:func:`pointed_at` points huggingface_hub (and transformers' shared client of it) in this process at an endpoint,
Hub access allowed; :func:`hub_env` gives the environment of a subprocess that uses it.

Usage::

    with FakeHub("stall") as hub, pointed_at(hub.endpoint):
        main(["synth", "--tokenizer", "owner/name", ...])
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_REPO_API = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+?)(/revision/[^/]+|/(tree|paths-info)/.*|/.*)?$")
_FILE = re.compile(r"^(?:/datasets)?/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
SHA = "0" * 40
FILE_SIZE = 1 << 20  # what a stalled download announces


@contextlib.contextmanager
def silent_hub() -> Iterator[str]:
    """The endpoint (``http://127.0.0.1:PORT``) of a server that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)  # connections are completed by the kernel, never read nor answered
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?")[0]
        self.hub.requests.append(f"{self.command} {path}")
        mode, api, file = self.hub.mode, _REPO_API.match(path), _FILE.match(path)
        tail = (api.group(3) or "") if api else ""
        if mode == "files" and file:
            name = file.group(3)
            self._file(self.hub.files[name], whole=True) if name in self.hub.files else self._missing_entry()
        elif api and (not tail or tail.startswith("/revision/") and mode != "answer"):
            listed = sorted(self.hub.files) if mode == "files" else ["config.json"]
            self._json({"id": api.group(2), "sha": SHA, "siblings": [{"rfilename": name} for name in listed]})
        elif not api and not file:
            self._empty(404)  # no repo's: the agent harnesses, ...
        elif mode == "answer":
            self._json(self.hub.answer) if api else self._empty(404)
        elif mode == "stall":
            self.hub.released.wait()  # never answered
        elif api:
            self._json([]) if api.group(4) else self._empty(404)
        else:
            self._file(b"" if mode == "stall_body" else FakeHub.TRICKLED)

    def _file(self, body: bytes, whole: bool = False) -> None:
        """Headers of a file of ``body`` (an empty body: one that never comes), then its bytes one at a time (all at
        once when ``whole``)."""
        self.send_response(200)
        for name, value in (
            ("Content-Length", str(len(body) or FILE_SIZE)),
            ("ETag", f'"{hashlib.sha1(body).hexdigest() if whole else "1" * 40}"'),  # a blob's name in the cache
            ("X-Repo-Commit", SHA),
            ("Content-Type", "application/octet-stream"),
        ):
            self.send_header(name, value)
        self.end_headers()
        self.wfile.flush()
        if self.command != "GET":
            return
        if whole:
            self.wfile.write(body)
            return
        if not body:
            self.hub.released.wait()  # the body never comes
        for byte in body:
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            self.hub.released.wait(FakeHub.TRICKLE_GAP)

    do_HEAD = do_GET

    def _json(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    def _missing_entry(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "EntryNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class FakeHub:
    """A Hub on 127.0.0.1 in a background thread (see the module docstring for ``mode``); ``requests`` lists the
    requests it received (``"GET /path"``)."""

    TRICKLED = b'{"model_type": "llama"}'  # what "trickle" sends, a byte at a time
    TRICKLE_GAP = 0.15  # seconds between two bytes (23 bytes: longer than the tests' 2 s wait)

    def __init__(self, mode: str = "stall", answer: object = None, files: dict[str, bytes] | None = None) -> None:
        if mode not in ("stall", "stall_body", "trickle", "answer", "files"):
            raise ValueError(f"mode {mode!r}")
        self.mode, self.answer, self.files = mode, answer, dict(files or {})
        self.requests: list[str] = []
        self.released = threading.Event()  # set on exit: held requests end, so the server can close

    def __enter__(self) -> FakeHub:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()  # quick shutdown
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self

    def __exit__(self, *exc) -> None:
        self.released.set()
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def pointed_at(endpoint: str, cache: str | None = None) -> Iterator[None]:
    """huggingface_hub in this process asks ``endpoint`` (Hub access allowed, whatever HF_HUB_OFFLINE said), and so
    does transformers' shared HfApi; what it downloads goes to ``cache`` (default: a temporary folder, never the
    user's cache); everything is put back on exit."""
    import tempfile

    from huggingface_hub import constants

    hub_module = None
    with contextlib.suppress(ImportError):
        import transformers.utils.hub as hub_module
    names = ("HF_HUB_OFFLINE", "ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE", "HF_HUB_CACHE")
    saved = {name: getattr(constants, name) for name in names}
    saved_api = getattr(hub_module, "_hf_api", None)
    temporary = tempfile.TemporaryDirectory() if cache is None else contextlib.nullcontext(cache)
    constants.HF_HUB_OFFLINE = False
    constants.ENDPOINT = endpoint
    constants.HUGGINGFACE_CO_URL_TEMPLATE = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    constants.HF_HUB_CACHE = str(temporary.__enter__())
    if hub_module is not None:
        hub_module._hf_api = None  # built again on first use, with this endpoint
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(constants, name, value)
        if hub_module is not None:
            hub_module._hf_api = saved_api
        temporary.__exit__(None, None, None)


def hub_env(endpoint: str, timeout: float, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a subprocess that asks ``endpoint``, with ``LONGPEFT_HUB_TIMEOUT=timeout``."""
    import os

    return {
        **(base if base is not None else os.environ),
        "HF_ENDPOINT": endpoint,
        "HF_HUB_OFFLINE": "0",
        "LONGPEFT_HUB_TIMEOUT": f"{timeout:g}",
    }
