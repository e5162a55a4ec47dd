"""Probe (evaluation) prompts of exact token lengths, assembled in token space: passkey, needle-in-a-haystack (single,
multi key / value / query), variable tracking, common-word extraction and topic retrieval. A haystack of whole
filler sentences fills what the fixed text leaves; needles go in at the sentence boundary nearest the requested depth
(0 = start of the haystack, 1 = end). Deterministic given the seed. The eval tasks: :mod:`longpeft.eval.builtin`."""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PASSKEY_FILLER = "The grass is green.|The sky is blue.|The sun is yellow.|Here we go.|There and back again.".split("|")
# Short whole sentences that make up the last few tokens of a haystack exactly (see ProbeBuilder.haystack).
PAD_FILLER = ["Yes.", "Go on.", "So it goes.", *PASSKEY_FILLER]
_SUBJECTS = "river|old mill|council|market|north road|harbor|village school|orchard|bridge|library".split("|")
_VERBS = "was repaired|opened early|stayed quiet|was painted|grew busy|was measured|was cleaned|closed late".split("|")
_TIMES = (
    "in spring|after the storm|every morning|last year|before the festival|at dusk|in winter|on market day"
).split("|")
_DETAILS = (
    "and people talked about it for days|while the bells rang|as the carts went by|and nobody minded|"
    "under a grey sky|with little fuss|as it had for years|and the work went on"
).split("|")
_KEY_WORDS = (
    "amber basalt cedar dune ember fjord glacier harbor iris juniper kelp lagoon meadow nectar orchid "
    "pebble quartz raven saffron tundra umber violet willow yarrow zephyr"
).split()
_TOPIC_WORDS = (
    "astronomy beekeeping calligraphy dinosaurs economics falconry geology hiking impressionism jazz "
    "knitting lighthouses mushrooms navigation origami pottery quilting robotics sailing tea "
    "volcanoes whales xylophones yoga zoology"
).split()
_SYLLABLES = (
    "ba be bi bo bu da de di do du ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu ra re ri ro "
    "ru sa se si so su ta te ti to tu va ve vi vo vu"
).split()


def require_tokens(tokenizer: Any) -> None:
    """Fail clearly when ``tokenizer`` turns ordinary text into no ids (length-targeted builders would otherwise loop
    or divide by zero)."""
    if not tokenizer.encode("The pass key is 12345. The grass is green.", add_special_tokens=False):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(f"the tokenizer {name} encodes text to no token ids; use the model's own tokenizer")


@dataclass
class Probe:
    """One evaluation prompt of its eval ``task``: ``input_ids``, exactly ``length`` token ids (special tokens
    included); ``answers`` the continuation must contain, scored by ``metric`` (``"exact"``, ``"contains"`` or
    ``"recall"``: :func:`longpeft.eval.scoring.score`); ``depth``: the requested needle depth in [0, 1] (None: no
    needle); ``needle_positions``: the token offset of each insert, in the order made; ``metadata``: keys, topics."""

    task: str
    input_ids: list[int]
    answers: list[str]
    metric: str
    length: int
    depth: float | None
    needle_positions: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ProbeBuilder:
    """Builds probes of exact token lengths for one transformers tokenizer, deterministic given ``seed``. With
    ``chat``, a prompt is one user turn of the tokenizer's chat template (the answer cue ends it) followed by the
    generation prompt."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat: bool = False, seed: int = 0):
        require_tokens(tokenizer)
        self.tokenizer, self.chat, self.rng = tokenizer, chat, random.Random(seed)
        self.single_answer_metric = "contains" if chat else "exact"
        self._encoded: dict[str, list[int]] = {}
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ConfigError(
                    "chat prompts (--chat, chat=True) need a tokenizer with a chat_template; leave chat "
                    "off for base models"
                )
            marker = "\u2063PROBE\u2063"
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
            )
            self.head, self.tail = (self.encode(part) for part in text.split(marker))
        else:
            self.head, self.tail = self.special_prefix(), []

    def encode(self, text: str) -> list[int]:
        if text not in self._encoded:
            self._encoded[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return self._encoded[text]

    def special_prefix(self) -> list[int]:
        """Special tokens the tokenizer puts before a text (e.g. BOS), without any it appends."""
        ids = self.tokenizer("", add_special_tokens=True)["input_ids"]
        eos = self.tokenizer.eos_token_id
        return [i for i in ids if i != eos]

    def filler_sentence(self, kind: str) -> str:
        if kind == "passkey":
            return self.rng.choice(PASSKEY_FILLER)
        return (
            f"The {self.rng.choice(_SUBJECTS)} {self.rng.choice(_VERBS)} "
            f"{self.rng.choice(_TIMES)} {self.rng.choice(_DETAILS)}."
        )

    def haystack(self, n_tokens: int, kind: str) -> tuple[list[int], list[int]]:
        """Filler of exactly ``n_tokens`` tokens made of whole sentences (random ones of ``kind``, then the fewest
        ``PAD_FILLER`` ones that fill the rest), and the token offsets where sentences start (``n_tokens`` last);
        ConfigError when ``n_tokens`` is no sum of whole filler sentences."""
        sentences: list[list[int]] = []
        total = 0
        while total + len(sentence := self.encode(" " + self.filler_sentence(kind))) <= n_tokens:
            sentences.append(sentence)
            total += len(sentence)
        while (pad := self.pad_sentences(n_tokens - total)) is None and sentences:
            total -= len(sentences.pop())
        if pad is None:
            shortest = min(len(self.encode(" " + s)) for s in PAD_FILLER)
            raise ConfigError(
                f"{n_tokens} filler tokens cannot be made of whole filler sentences (the shortest has {shortest} "
                "tokens); use a probe length a few tokens longer"
            )
        pieces = sentences + pad
        starts = list(itertools.accumulate((len(piece) for piece in pieces), initial=0))
        return [i for piece in pieces for i in piece], starts

    def pad_sentences(self, n_tokens: int) -> list[list[int]] | None:
        """The fewest ``PAD_FILLER`` sentences (token ids) whose lengths sum to exactly ``n_tokens``, or None."""
        pool = [self.encode(" " + s) for s in PAD_FILLER]
        fewest: list[list[int] | None] = [[]] + [None] * n_tokens  # fewest[t]: pool indices summing to t
        for t in range(1, n_tokens + 1):
            sums = [
                fewest[t - len(p)] + [k]
                for k, p in enumerate(pool)
                if 0 < len(p) <= t and fewest[t - len(p)] is not None
            ]
            fewest[t] = min(sums, key=len, default=None)
        found = fewest[n_tokens]
        return None if found is None else [pool[k] for k in found]

    def frame(self, instruction: str, question: str) -> tuple[list[int], list[int]]:
        """The fixed start (``[head] instruction``) and end (``question [tail]``) of a prompt, as new lists."""
        return self.head + self.encode(instruction), self.encode(" " + question) + self.tail

    def assemble(
        self, length: int, instruction: str, inserts: Sequence[tuple[float, str]], question: str, kind: str = "essay"
    ) -> tuple[list[int], list[int]]:
        """``(input_ids, insert_token_positions)`` of a prompt of exactly ``length`` tokens: [head] instruction,
        haystack, question [tail], with each of ``inserts`` (``(depth, text)``) at the haystack's sentence start
        nearest its depth (in order for equal depths)."""
        ids, end = self.frame(instruction, question)
        insert_ids = [self.encode(" " + text) for _, text in inserts]
        n_hay = length - len(ids) - len(end) - sum(map(len, insert_ids))
        if n_hay < 0:
            raise ConfigError(
                f"probe length {length} is shorter than its fixed text ({length - n_hay} tokens: instruction, "
                "needles, question); use a longer length"
            )
        hay, starts = self.haystack(n_hay, kind)
        boundaries = [min(starts, key=lambda s: abs(s - depth * n_hay)) for depth, _ in inserts]
        positions, cursor = [0] * len(inserts), 0
        for k in sorted(range(len(inserts)), key=lambda k: (boundaries[k], k)):
            ids += hay[cursor : boundaries[k]]
            cursor = boundaries[k]
            positions[k] = len(ids)
            ids += insert_ids[k]
        ids += hay[cursor:] + end
        assert len(ids) == length, (len(ids), length)
        return ids, positions

    def number(self, digits: int) -> str:
        return str(self.rng.randrange(10 ** (digits - 1), 10**digits)) if digits > 1 else str(self.rng.randrange(10))

    @staticmethod
    def unique(used: set[str], draw: Callable[[], str]) -> str:
        """The first ``draw()`` not in ``used``, added to it."""
        value = draw()
        while value in used:
            value = draw()
        used.add(value)
        return value

    def variable_name(self, used: set[str]) -> str:
        return self.unique(used, lambda: "".join(self.rng.choice(string.ascii_uppercase) for _ in range(5)))

    def pseudo_word(self, used: set[str], syllables: int = 3) -> str:
        return self.unique(used, lambda: "".join(self.rng.choice(_SYLLABLES) for _ in range(syllables)))

    def passkey(self, length: int, depth: float, digits: int = 5) -> Probe:
        key = self.number(digits)
        instruction = (
            "There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about it."
        )
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        ids, pos = self.assemble(
            length, instruction, [(depth, needle)], "What is the pass key? The pass key is", "passkey"
        )
        return Probe("passkey", ids, [key], self.single_answer_metric, length, depth, pos, {"needle_position": pos[0]})

    def niah(
        self, length: int, depth: float, n_keys: int = 1, n_values: int = 1, n_queries: int = 1, digits: int = 7
    ) -> Probe:
        """RULER-style needles "The special magic number for <key> is: <value>.": ``n_keys`` distinct keys
        (distractors beyond the ``n_queries`` asked), ``n_values`` values each, spread evenly over ``[depth, 1]``."""
        if n_queries > n_keys:
            raise ConfigError(f"n_queries ({n_queries}) cannot exceed n_keys ({n_keys})")
        used: set[str] = set()
        keys = [self.unique(used, lambda: "-".join(self.rng.sample(_KEY_WORDS, 2))) for _ in range(n_keys)]
        values = {k: [self.number(digits) for _ in range(n_values)] for k in keys}
        needles = [f"The special magic number for {k} is: {v}." for k in keys for v in values[k]]
        self.rng.shuffle(needles)
        spread = [depth + (1 - depth) * i / max(len(needles), 1) for i in range(len(needles))]
        asked = self.rng.sample(keys, n_queries)
        if n_queries == 1 and n_values == 1:
            question = f"What is the special magic number for {asked[0]}? The special magic number for {asked[0]} is:"
            metric = self.single_answer_metric
        else:
            what = ", ".join(asked)
            question = f"What are all the special magic numbers for {what}? The special magic numbers for {what} are:"
            metric = "recall"
        instruction = (
            "Some special magic numbers are hidden in the following text. Memorize them. I will quiz you about them."
        )
        ids, pos = self.assemble(length, instruction, list(zip(spread, needles)), question)
        answers = [v for k in asked for v in values[k]]
        return Probe("niah_single", ids, answers, metric, length, depth, pos, {"keys": keys, "asked": asked})

    def variable_tracking(self, length: int, n_chains: int = 1, n_hops: int = 4, digits: int = 5) -> Probe:
        """RULER variable tracking: ``VAR A = 12345``, ``VAR B = VAR A``, ...; name all variables holding the value."""
        used: set[str] = set()
        chains = []
        for _ in range(n_chains):
            names = [self.variable_name(used) for _ in range(n_hops + 1)]
            chains.append((self.number(digits), names))
        inserts = []
        for value, names in chains:
            statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
            depths = sorted(self.rng.uniform(0.0, 1.0) for _ in statements)
            inserts += list(zip(depths, statements))
        value, names = chains[0]
        instruction = "Memorize and track the chain(s) of variable assignment hidden in the following text."
        question = (
            f"Question: Find all variables that are assigned the value {value} in the text above. Answer: According "
            f"to the chain(s) of variable assignment in the text above, {len(names)} variables are assigned the value "
            f"{value}, they are:"
        )
        ids, pos = self.assemble(length, instruction, sorted(inserts, key=lambda x: x[0]), question)
        return Probe("variable_tracking", ids, names, "recall", length, None, pos, {"value": value})

    def common_words(self, length: int, n_common: int = 10, rare_freq: int = 1) -> Probe:
        """RULER common-word extraction: a numbered word list; name the ``n_common`` most frequent words. They make
        up about half of the list (each at least 3 times, and 3x as often as any other word)."""
        instruction = "Below is a numbered list of words. In these words, some appear more often than others."
        question = (
            f"Question: What are the {n_common} most common words in the above list? Answer: The top {n_common} "
            "words that appear most often in the list are:"
        )
        per_item = len(self.encode(" 100. kabemi"))
        fixed = sum(map(len, self.frame(instruction, question)))
        n_items = max((length - fixed) // per_item + 2, 1)
        common_freq = max(3 * rare_freq, 3, n_items // (2 * n_common))
        if n_common * common_freq > n_items:
            raise ConfigError(
                f"length {length} is too short for {n_common} common words appearing {common_freq} times each; "
                "use a longer length (--lengths), or fewer common words (n_common)"
            )
        used: set[str] = set()
        common = [self.pseudo_word(used) for _ in range(n_common)]
        words = [w for w in common for _ in range(common_freq)]
        while len(words) < n_items:
            words += [self.pseudo_word(used)] * rare_freq
        self.rng.shuffle(words)
        # More rare words after the shuffled list in case the estimate was short (the cut drops the tail).
        more = (self.pseudo_word(used) for _ in itertools.count())
        items = (f"{i + 1}. {w}" for i, w in enumerate(itertools.chain(words, more)))
        ids = self.assemble_list(length, instruction, items, question)
        return Probe("common_words", ids, common, "recall", length, None, [], {"common_freq": common_freq})

    def assemble_list(self, length: int, instruction: str, items: Iterable[str], question: str) -> list[int]:
        """Prompt of exactly ``length`` tokens whose body is ``items`` (cut at the end to fit)."""
        start, end = self.frame(instruction, question)
        n_body = length - len(start) - len(end)
        if n_body < 0:
            raise ConfigError(f"probe length {length} is shorter than its fixed text; use a longer length")
        body: list[int] = []
        for item in items:
            if len(body) >= n_body:
                break
            body.extend(self.encode(" " + item))
        if len(body) < n_body:
            raise ConfigError(f"not enough list items to fill {length} tokens")
        ids = start + body[:n_body] + end
        assert len(ids) == length
        return ids

    def topic_retrieval(self, length: int, n_topics: int = 5) -> Probe:
        """LongChat topic retrieval: several conversations on different topics; name the first one."""
        topics = self.rng.sample(_TOPIC_WORDS, n_topics)
        instruction = (
            f"Below is a record of our previous conversation on {n_topics} different topics. The USER asked to "
            "discuss a topic and we talked about it."
        )
        inserts = [
            (i / n_topics, f"USER: I would like to discuss the topic of {t}. ASSISTANT: Sure, let us talk about {t}.")
            for i, t in enumerate(topics)
        ]
        question = "What is the first topic we discussed? Only give the topic name. The first topic we discussed is"
        ids, pos = self.assemble(length, instruction, inserts, question)
        return Probe(
            "topic_retrieval", ids, [topics[0]], self.single_answer_metric, length, None, pos, {"topics": topics}
        )
