"""How many tokens a chat request's prompt holds at the endpoint, for the client's check against the endpoint's
context and for ``synth --plan``. :func:`prompt_counter` takes the first that works (docs/synth.md): the server's
own tokenizer (vLLM's ``POST /tokenize`` with the messages; llama.cpp's ``POST /apply-template`` then ``/tokenize``,
or each message's content alone without ``/apply-template``), ``llm.tokenizer`` with its chat template, or an
estimate of one token per word, which counts no more than the server does (tokenizers that split text at whitespace
never put two words in one token). Never the training tokenizer: the endpoint serves another model.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .endpoint import NoHttpAnswer, http_json, server_root
from .llm_http import body_excerpt
from .llm_request import LLMConfig

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
