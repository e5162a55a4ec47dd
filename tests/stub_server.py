"""A local OpenAI-compatible chat-completions server for the tests and scripts/bench_synth.py.

It answers ``POST /v1/chat/completions`` on 127.0.0.1 after a fixed latency, and can misbehave on
request: directives written inside any message as ``[[...]]`` make it fail the first calls of that
prompt (the same messages), so retries, backoff and malformed-output handling are exercised over
real HTTP.

Directives (comma-separated inside one ``[[...]]``):

- ``429*2``: the first 2 calls of this prompt get HTTP 429 (any status code works: ``500*1``, ...);
  a 429 carries ``Retry-After: 0``;
- ``retry_ms=300``: error responses also carry ``retry-after-ms: 300``;
- ``bad`` / ``bad*1``: the answer is not JSON, always / for the first answered call only;
- ``html`` / ``html*1``: HTTP 200 with an HTML page instead of a chat completion (a gateway's login
  page), always / for the first call only;
- ``slow=0.5*1``: the first call sleeps 0.5 s more before answering.

Structured output (``structured=``): ``"ignore"`` (default) answers as if ``response_format`` were
absent, with a model that follows the prompt's JSON contract to the letter; ``"drop"`` ignores it too, as
``transformers serve`` does (HTTP 200), with a chat model's habit: the JSON comes inside a Markdown fence,
so it is not the bare JSON an enforcing server returns (the parser still reads it); ``"accept"`` enforces
it (a ``json_schema`` needs ``name``, ``schema`` and ``strict``; HTTP 400 otherwise): the answer is an
instance of the schema, built from the reply's fields where they fit (the same grounded items, so they
pass the quality gates as in the other modes), each list cut to the schema's ``maxItems``, a JSON object for
``json_object``; ``"no_bounds"`` does the same but answers HTTP 400 to a schema holding ``minItems`` or
``maxItems``, as a server accepting only the strict subset does; ``"refuse"`` answers HTTP 400 to any request
carrying it, as a server without structured output does.

Truncation: with ``cut_at_max_tokens=True``, an answer longer than the request's ``max_tokens`` (in
:func:`stub_tokens`) is cut there, with ``finish_reason`` ``length``, as a server stops at the limit; a ``reply``
function may also return ``(text, finish_reason)``, and ``status`` (body -> HTTP status) answers a status of the
test's choosing.

Other routes: ``GET /v1/models`` lists the model (with the ``models_info`` fields, e.g. vLLM's
``max_model_len``) and ``GET /props`` answers ``props`` (llama.cpp's ``n_ctx``, ``total_slots``), or 404
when it is ``None``. With ``tokenize="llama.cpp"``, ``POST /apply-template`` (``{"messages"}`` ->
``{"prompt"}``) and ``POST /tokenize`` (``{"content"}`` -> ``{"tokens"}``) answer as llama.cpp's server;
with ``tokenize="vllm"``, ``POST /tokenize`` (``{"model", "messages"}`` or ``{"model", "prompt"}`` ->
``{"count", "max_model_len", "tokens"}``) answers as vLLM; both count with :func:`stub_tokens` over
:func:`stub_template`, as the ``usage.prompt_tokens`` of every answer does. Other paths get 404.

For faults of any shape: ``raw_reply`` (body -> bytes) replaces the whole HTTP body of a chat answer
(status 200, ``Content-Type: application/json``); ``stall=True`` takes every request and never answers
(until the server stops); :class:`RawSocketServer` answers bytes that are not HTTP at all.

Usage::

    with StubServer(latency=0.05) as server:
        config = LLMConfig(base_url=server.base_url, model="stub")
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_DIRECTIVE = re.compile(r"\[\[(.*?)\]\]")
_STUB_TOKEN = re.compile(r"<\|im_(?:start|end)\|>|\w+|[^\w\s]|[\x1c-\x1f]")  # \s takes in \x1c-\x1f: not spaces


def stub_template(messages: list[dict[str, Any]]) -> str:
    """The stub model's chat template (ChatML), with the generation prompt."""
    turns = "".join(f"<|im_start|>{m.get('role', '')}\n{m.get('content', '')}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def stub_tokens(text: str) -> list[int]:
    """The stub model's tokenizer: a word, a punctuation mark, a control character or a ChatML marker is one token
    (ids: a hash)."""
    return [int(hashlib.sha256(t.encode("utf-8")).hexdigest()[:6], 16) for t in _STUB_TOKEN.findall(text)]


def cut_at(text: str, max_tokens: int) -> str | None:
    """``text`` cut after its ``max_tokens``-th token (:func:`stub_tokens`), or None when it is not longer."""
    ends = [match.end() for match in _STUB_TOKEN.finditer(text)]
    return text[: ends[max_tokens - 1] if max_tokens else 0] if len(ends) > max_tokens else None


_TAGGED = re.compile(r"<(excerpt|document|book|document \d+)>\n(.*?)\n</\1>", re.DOTALL)
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_NAME = re.compile(r"\b[A-Z][a-z]+ [A-Z][a-z]+\b")


def _sentences(body: dict[str, Any]) -> list[str]:
    """Sentences (4 words or more) of the text inside the prompt's tags, else of the whole prompt."""
    prompt = "\n".join(str(m.get("content", "")) for m in body.get("messages", []))
    texts = [match.group(2) for match in _TAGGED.finditer(prompt)] or [prompt]
    found = [s.strip() for text in texts for s in _SENTENCE.split(text) if len(s.split()) >= 4]
    return list(dict.fromkeys(found)) or [prompt.strip() or "The text is empty."]


def default_reply(body: dict[str, Any]) -> str:
    """A well-formed JSON answer carrying every field the synth_data prompts ask for, grounded in the prompt's
    text so that it passes the quality gates: each answer is a sentence of the text (chosen by a hash of the
    prompt), each question quotes its first words; each biography gathers the sentences naming one of the two
    names (capitalised word pairs) the text mentions most."""
    sentences = _sentences(body)
    digest = int(hashlib.sha256("".join(sentences).encode("utf-8")).hexdigest()[:8], 16)
    chosen: dict[str, str] = {}
    for offset in range(len(sentences)):
        sentence = sentences[(digest + offset * 7) % len(sentences)]
        chosen.setdefault(" ".join(sentence.split()[:6]), sentence)
        if len(chosen) == 3:
            break
    counts: dict[str, int] = {}
    for name in _NAME.findall(" ".join(sentences)):
        counts[name] = counts.get(name, 0) + 1
    names = sorted(counts, key=lambda n: (-counts[n], n))[:2]
    return json.dumps(
        {
            "qa_pairs": [
                {"question": f'Which sentence of the text begins with the words "{start}"?', "answer": sentence}
                for start, sentence in chosen.items()
            ],
            "biographies": [
                {"name": name, "biography": " ".join([s for s in sentences if name in s][:6])} for name in names
            ],
        }
    )


def junk_reply(body: dict[str, Any]) -> str:
    """:func:`default_reply`'s grounded items plus one bad item per quality gate (placeholder, prompt echo,
    refusal, too short, ungrounded, near-duplicate, unfinished, a statement for a question, a tautology, a
    restatement of the question; for biographies: too short, a name not in the book, a biography of someone else):
    what a weak model writes. ``python tests/stub_server.py --junk`` serves it."""
    good = json.loads(default_reply(body))
    pairs, bios = good["qa_pairs"], good["biographies"]
    first = pairs[0]
    pairs = pairs + [
        {"question": "...", "answer": "..."},
        {
            "question": "Every question must be self-contained: name the people, places or things it asks about?",
            "answer": first["answer"],
        },
        {
            "question": "What does the text say about the harbour master?",
            "answer": "I'm sorry, but the text does not mention a harbour master.",
        },
        {"question": ".-", "answer": first["answer"]},
        {
            "question": "Which colour was the dragon that guarded the glass mountain?",
            "answer": "A purple dragon guarded the glass mountain beside a silver lake.",
        },
        {"question": first["question"].replace("Which sentence", "Which sentence exactly"), "answer": first["answer"]},
        {"question": first["question"], "answer": first["answer"].rstrip(".!?") + ", and the"},
        {"question": "The keeper of the lighthouse wrote every storm in a ledger.", "answer": first["answer"]},
        {"question": "What is the blue ledger of the keeper?", "answer": "The blue ledger is the blue ledger."},
        {"question": "When was the harbour wall repaired?", "answer": "The harbour wall was repaired."},
    ]
    if bios:
        name, text = bios[0]["name"], bios[0]["biography"]
        bios = bios + [
            {"name": "Zed Quorrin", "biography": text.replace(name, "Zed Quorrin") + " Zed Quorrin left the town."},
            {"name": name + " Junior", "biography": name},
        ]
        if len(bios) > 3:
            other = bios[1]
            bios.append({"name": name, "biography": f"{other['biography']} {name} was mentioned once."})
    return json.dumps({"qa_pairs": pairs, "biographies": bios})


class StubServer:
    """OpenAI-compatible stub on 127.0.0.1 (a random free port) in a background thread.

    Args:
        latency: seconds every request takes before its answer.
        reply: body -> assistant text for answered calls (default :func:`default_reply`), or ``(text,
            finish_reason)``.
        status: body -> the HTTP status to answer with (200: answer; default: always 200, directives aside).
        cut_at_max_tokens: cut every answer at the request's ``max_tokens`` (finish_reason ``length``).

    Attributes:
        calls: total requests received; ``statuses`` counts them by HTTP status;
        ``prompt_calls`` counts them per prompt hash; ``auth_headers`` holds every
        Authorization header received (tests check the key was sent and never written).
    """

    def __init__(
        self,
        latency: float = 0.0,
        reply: Callable[[dict[str, Any]], str] = default_reply,
        structured: str = "ignore",
        models_info: dict[str, Any] | None = None,
        props: dict[str, Any] | None = None,
        tokenize: str | None = None,
        raw_reply: Callable[[dict[str, Any]], bytes] | None = None,
        stall: bool = False,
        status: Callable[[dict[str, Any]], int] | None = None,
        cut_at_max_tokens: bool = False,
    ):
        assert structured in ("ignore", "drop", "accept", "no_bounds", "refuse"), structured
        assert tokenize in (None, "llama.cpp", "vllm"), tokenize
        self.latency = latency
        self.reply = reply
        self.structured = structured
        self.models_info = models_info or {}
        self.props = props
        self.tokenize = tokenize
        self.raw_reply = raw_reply
        self.stall = stall
        self.status = status
        self.cut_at_max_tokens = cut_at_max_tokens
        self.tokenize_calls: list[str] = []  # paths of the tokenizer requests (/tokenize, /apply-template)
        self._stopped = threading.Event()
        self.response_formats: list[Any] = []  # the response_format of every chat request (None: absent)
        self.chat_bodies: list[dict[str, Any]] = []  # every chat request's JSON body, as received
        self.gets: list[str] = []  # paths of the GET requests
        self.lock = threading.Lock()
        self.calls = 0
        self.statuses: Counter[int] = Counter()
        self.prompt_calls: Counter[str] = Counter()
        self._bad_served: Counter[str] = Counter()
        self.auth_headers: list[str] = []
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "start the server first"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> StubServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                # answer in one segment: no Nagle / delayed-ACK stall between headers and body
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                with server.lock:
                    server.gets.append(self.path)
                if server.stall:
                    server._stopped.wait()
                    return
                if self.path == "/v1/models":
                    self.reply_with(
                        200, {"object": "list", "data": [{"id": "stub", "object": "model", **server.models_info}]}
                    )
                elif self.path == "/props" and server.props is not None:
                    self.reply_with(200, server.props)
                else:
                    self.reply_with(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                if server.stall:
                    server._stopped.wait()
                    return
                if self.path in ("/tokenize", "/apply-template"):
                    self.reply_with(*server._tokenize(self.path, body))
                elif self.path == "/v1/chat/completions":
                    self.reply_with(*server._answer(body, self.headers.get("Authorization", "")))
                else:
                    self.reply_with(404, {"error": {"message": f"no route {self.path}"}})

            def reply_with(self, status: int, payload: Any, *extra: dict[str, str]) -> None:
                headers = {"Content-Type": "application/json", **(extra[0] if extra else {})}
                if isinstance(payload, bytes):  # a raw body (raw_reply), sent as it is
                    data = payload
                elif isinstance(payload, str):  # a raw page, not JSON
                    data, headers["Content-Type"] = payload.encode("utf-8"), "text/html"
                else:
                    data = json.dumps(payload).encode("utf-8")
                if status == 429:
                    headers.setdefault("Retry-After", "0")
                self.send_response(status)
                for name, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # the default backlog (5) drops bursts of concurrent connects
            daemon_threads = True

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _tokenize(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """``/tokenize`` and ``/apply-template`` as llama.cpp's server or vLLM answer them (``tokenize``)."""
        with self.lock:
            self.tokenize_calls.append(path)
        if self.tokenize == "llama.cpp" and path == "/apply-template":
            return 200, {"prompt": stub_template(body.get("messages", []))}
        if self.tokenize == "llama.cpp" and path == "/tokenize":
            return 200, {"tokens": stub_tokens(body["content"]) if "content" in body else []}
        if self.tokenize == "vllm" and path == "/tokenize":
            text = stub_template(body["messages"]) if "messages" in body else body.get("prompt", "")
            tokens = stub_tokens(text)
            return 200, {
                "count": len(tokens),
                "max_model_len": self.models_info.get("max_model_len"),
                "tokens": tokens,
            }
        return 404, {"error": {"message": f"no route {path}"}}

    def _structured_error(self, response_format: Any) -> str | None:
        """Why this server refuses ``response_format`` (``None``: it is accepted)."""
        if response_format is None or self.structured in ("ignore", "drop"):
            return None
        if self.structured == "refuse":
            return f"response_format of type {response_format.get('type')!r} is not supported by this server"
        bounds = [word for word in ("minItems", "maxItems") if f'"{word}"' in json.dumps(response_format)]
        if self.structured == "no_bounds" and bounds:
            return f"Invalid schema for response_format: {bounds[0]!r} is not permitted"
        if response_format.get("type") == "json_object":
            return None
        spec = response_format.get("json_schema")
        if response_format.get("type") != "json_schema" or not isinstance(spec, dict):
            return f"invalid response_format {response_format!r}"
        missing = [key for key in ("name", "schema", "strict") if key not in spec]
        return f"response_format.json_schema lacks {missing}" if missing else None

    def _answer(self, body: dict[str, Any], authorization: str) -> tuple[Any, ...]:
        """``(status, payload[, headers])``: payload is a JSON body, or a ``str`` sent as an HTML page."""
        response_format = body.get("response_format")
        with self.lock:
            self.response_formats.append(response_format)
            self.chat_bodies.append(body)
        refused = self._structured_error(response_format)
        if refused is not None:
            with self.lock:
                self.calls += 1
                self.statuses[400] += 1
            return 400, {"error": {"message": refused, "type": "invalid_request_error", "param": "response_format"}}
        messages = body.get("messages", [])
        prompt = json.dumps(messages, sort_keys=True)
        prompt_hash = hashlib.sha256(prompt.encode("utf-8")).hexdigest()
        directives = [d.strip() for group in _DIRECTIVE.findall(prompt) for d in group.split(",") if d.strip()]
        with self.lock:
            self.calls += 1
            self.prompt_calls[prompt_hash] += 1
            call_index = self.prompt_calls[prompt_hash]
            self.auth_headers.append(authorization)
        delay = self.latency
        status = self.status(body) if self.status is not None else 200
        bad = html = False
        headers: dict[str, str] = {}
        for directive in directives:
            name, _, times = directive.partition("*")
            limit = int(times) if times else None
            if name.isdigit() and call_index <= (limit or 1):
                status = int(name)
            elif name.startswith("slow=") and call_index <= (limit or 1):
                delay += float(name[len("slow=") :])
            elif name == "bad":
                bad = limit is None or self._bad_served[prompt_hash] < limit
            elif name == "html":
                html = limit is None or call_index <= limit
            elif name.startswith("retry_ms="):
                headers["retry-after-ms"] = name[len("retry_ms=") :]
        if delay:
            time.sleep(delay)
        with self.lock:
            self.statuses[status] += 1
            if status == 200 and bad:
                self._bad_served[prompt_hash] += 1
        if status != 200:
            return status, {"error": {"message": f"injected HTTP {status}", "type": "stub", "code": status}}, headers
        if html:
            return 200, "<html><body>Please sign in</body></html>"
        if self.raw_reply is not None:
            return 200, self.raw_reply(body)
        content = "this is {not json" if bad else self.reply(body)
        finish_reason = "stop"
        if isinstance(content, tuple):
            content, finish_reason = content
        if not bad and self.structured in ("accept", "no_bounds") and response_format is not None:
            content = json.dumps(_enforced(response_format, content))
        elif not bad and self.structured == "drop":
            content = f"```json\n{content}\n```"
        max_tokens = body.get("max_tokens")
        cut = cut_at(content, max_tokens) if self.cut_at_max_tokens and isinstance(max_tokens, int) else None
        if cut is not None:
            content, finish_reason = cut, "length"
        prompt_tokens = len(stub_tokens(stub_template(messages)))
        completion_tokens = max(1, len(stub_tokens(content)))
        return 200, {
            "id": f"chatcmpl-{prompt_hash[:12]}-{call_index}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "stub"),
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }


def _enforced(response_format: dict[str, Any], content: str) -> Any:
    """What a server enforcing ``response_format`` answers for the reply ``content``: an instance of the schema (a
    JSON object for ``json_object``), taking the reply's values where they have the schema's type."""
    try:
        reply = json.loads(content)
    except ValueError:
        reply = content
    if response_format.get("type") != "json_schema":
        return reply if isinstance(reply, dict) else {"text": content}
    return _instance(response_format["json_schema"]["schema"], reply)


def _instance(schema: dict[str, Any], hint: Any) -> Any:
    """An instance of ``schema`` (object, array of at most ``maxItems``, string), from ``hint`` where its type fits."""
    kind = schema.get("type")
    if kind == "object":
        hint = hint if isinstance(hint, dict) else {}
        properties = schema.get("properties", {})
        return {key: _instance(properties.get(key, {"type": "string"}), hint.get(key)) for key in schema["required"]}
    if kind == "array":
        items = hint if isinstance(hint, list) else [None]
        return [_instance(schema["items"], item) for item in items][: schema.get("maxItems")]
    return hint if isinstance(hint, str) and hint.strip() else "OK"


class RawSocketServer:
    """A TCP server on 127.0.0.1 that reads a request and answers ``payload``, bytes that are not HTTP, then closes
    the connection (a wrong port, a proxy speaking another protocol)."""

    def __init__(self, payload: bytes):
        self.payload = payload
        self._socket: socket.socket | None = None

    @property
    def base_url(self) -> str:
        assert self._socket is not None, "start the server first"
        return f"http://127.0.0.1:{self._socket.getsockname()[1]}/v1"

    def __enter__(self) -> RawSocketServer:
        self._socket = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._socket is not None
        self._socket.close()

    def _serve(self) -> None:
        assert self._socket is not None
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            with connection:
                connection.recv(65536)
                connection.sendall(self.payload)


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted: ``python tests/stub_server.py --latency 0.05``.

    Prints the base URL as its first line (point ``--llm-base-url`` at it).
    """
    import argparse

    parser = argparse.ArgumentParser(description="OpenAI-compatible stub server on 127.0.0.1")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per request")
    parser.add_argument(
        "--structured",
        choices=["ignore", "drop", "accept", "no_bounds", "refuse"],
        default="ignore",
        help="what it does with response_format (see the module docstring)",
    )
    parser.add_argument("--junk", action="store_true", help="answer with bad items too (junk_reply)")
    parser.add_argument(
        "--tokenize", choices=["llama.cpp", "vllm"], help="serve a tokenizer route as that server does"
    )
    args = parser.parse_args(argv)
    with StubServer(
        latency=args.latency,
        reply=junk_reply if args.junk else default_reply,
        structured=args.structured,
        tokenize=args.tokenize,
    ) as server:
        print(server.base_url, flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
