"""Quality gates on LLM-written items (QA pairs, biographies): deterministic text checks, one function each (table:
docs/synth.md). The first that fails rejects the item with its reason code (:data:`REASONS`) and a detail message."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from ..config import StrictModel
from .registry import QAPair, get_task

REASONS = tuple(  # the gates' reason codes, in the order the gates run
    "placeholder prompt_echo refusal too_short unfinished not_a_question tautology restates_question wrong_subject "
    "ungrounded near_duplicate".split()
)
GateName = Literal[REASONS]  # one of REASONS


class QualityConfig(StrictModel):
    """Thresholds of the quality gates (``quality:`` in the synth config)."""

    enabled: bool = Field(True, description="run the gates on every LLM-written item (false: keep everything parsed)")
    disable: list[GateName] = Field(
        default_factory=list, description=f"gates to switch off, by reason code ({', '.join(REASONS)})"
    )
    echo_words: int = Field(6, ge=3, description="consecutive instruction words that make a prompt echo")
    min_question_words: int = Field(3, ge=0, description="real words a question needs ('Who founded Brenn?' has 3)")
    min_answer_words: int = Field(1, ge=0, description="real words an answer needs (1: a year or a name is fine)")
    min_biography_words: int = Field(12, ge=0, description="real words a biography needs")
    restatement_coverage: float = Field(
        0.75,
        gt=0,
        le=1,
        description="share of its question's content words an answer adding none of its own must repeat to be a "
        "restatement (lower: fewer answers that pick one option of the question are kept)",
    )
    min_grounded_fraction: float = Field(
        0.5, ge=0, le=1, description="share of an answer's content words that must occur in the text asked about"
    )
    max_question_similarity: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Jaccard similarity of normalised word sets at which a question repeats an earlier one",
    )


@dataclass(frozen=True)
class Rejection:
    """Why one item was dropped: ``reason`` is one of :data:`REASONS`; ``detail`` is for people."""

    reason: str
    detail: str


@dataclass
class Verdict:
    """The items (QA pairs, or biography turns) kept, in order, and the rejected ones with their reasons."""

    kept: list[QAPair] = field(default_factory=list)
    rejected: list[tuple[QAPair, Rejection]] = field(default_factory=list)


STOP_WORDS = frozenset(
    """
a about above after again against all also am an and any are as at be because been before being below between
both but by can could did do does doing done down during each either else ever every few for from further had has
have having he her here hers herself him himself his how however i if in into is it its itself just least less
let like made make many may me might more most much must my myself neither no nor not now of off often on once
one only or other our ours ourselves out over own per perhaps quite rather same shall she should since so some
still such than that the their theirs them themselves then there these they this those though through thus to
too under until up upon us very was we were what whatever when where whether which while who whom whose why will
with within without would yes yet you your yours yourself none nothing nobody
people person someone somebody anyone everyone
according answer answered mentioned named called described text document documents passage excerpt book story
first second third last earlier later earliest latest before after total sum number numbers times count both
together respectively compared whereas different difference differences similar similarity similarities common
also named namely including include includes included
""".split()
)

_UNITS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty"
).split()
_TENS = "thirty forty fifty sixty seventy eighty ninety".split()
NUMBER_WORDS = {word: str(n) for n, word in enumerate(_UNITS)} | {word: str(10 * n) for n, word in enumerate(_TENS, 3)}
NUMBER_WORDS["hundred"] = "100"

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
_THOUSANDS = re.compile(r"(?<=\d)[,_ ](?=\d{3}\b)")


def words(text: str) -> list[str]:
    """Real words of ``text``, lower-cased, inner apostrophes kept, thousands separators dropped (5,326 -> 5326)."""
    return _WORD.findall(_THOUSANDS.sub("", text.lower()))


def stem(word: str) -> str:
    """A crude suffix stripper ("lived", "lives", "living" -> "liv"); number words become digits."""
    word = NUMBER_WORDS.get(word, word)
    if word.isdigit():
        return word
    word = re.sub(r"['’]s$", "", word)
    for suffix, replacement in (("ied", "y"), ("ies", "y"), ("ing", ""), ("ed", ""), ("ly", ""), ("s", "")):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith("ss"):
            word = word[: len(word) - len(suffix)] + replacement
            break
    return word[:-1] if word.endswith("e") and len(word) > 3 else word


def content_stems(text: str, drop_numbers: bool = False) -> list[str]:
    """Stems of ``text``'s content words (stop words removed), in order, without repeats."""
    stems = (stem(word) for word in words(text) if word not in STOP_WORDS)
    return list(dict.fromkeys(s for s in stems if not (drop_numbers and s.isdigit())))


def jaccard(a: str, b: str) -> float:
    """Jaccard similarity of the stemmed word sets of two texts (stop words kept: they carry the question)."""
    x, y = {stem(w) for w in words(a)}, {stem(w) for w in words(b)}
    return len(x & y) / len(x | y) if x | y else 1.0


def numbers(text: str) -> set[str]:
    """The numbers of ``text`` (digits and number words, normalised)."""
    return {token for token in map(stem, words(text)) if token.isdigit()}


_PLACEHOLDER_WORDS = frozenset(
    "question|answer|string|text|name|biography|placeholder|example|todo|tbd|tba|n/a|na|xxx|your question|your answer|"
    "your question here|your answer here|question here|answer here|insert question|insert answer|lorem ipsum|null|"
    "undefined".split("|")
)  # not "none": "None." answers "which ... both?" correctly
_PUNCTUATION_ONLY = re.compile(r"[\s.…_\-–—?!*#/\\|,:;'\"`~]*")
_BRACKETED = re.compile(r"\s*[<\[{]\s*[A-Za-z _\-]{1,40}\s*[>\]}]\s*")
_JSON_FORMAT = re.compile(r"\"\s*(?:qa_pairs|question|answer|biographies|biography|name)\s*\"\s*:")
_SOURCE = r"(?:given |provided )?(?:text|passage|excerpt|document|book|context|story)"  # "the provided text"
_REFUSALS = [
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        r"\bas an ai\b",
        r"\b(?:large )?language model\b",
        r"\bi(?:'m| am) (?:sorry|unable|not able)\b",
        r"\bi (?:cannot|can't|can ?not|won't|am unable to)\b",
        r"\bi apologi[sz]e\b",
        r"^\s*(?:sure|certainly|of course|okay|ok|absolutely)\b[^.!?\n]{0,40}\bhere (?:is|are)\b",
        r"^\s*here (?:is|are) (?:the |some |a few |\d+ )?(?:question|answer|biograph|pair)",
        rf"\b(?:the|this|that) {_SOURCE} (?:does not|doesn't|did not|didn't|do not) "
        r"(?:mention|say|state|specify|provide|contain|include|tell|give|describe)",
        r"\b(?:is|are|was|were) not (?:explicitly )?(?:mentioned|stated|specified|provided|given|described|included) "
        rf"in the {_SOURCE}",
        r"\bnot enough information\b",
        rf"\bno mention of\b[^.]{{0,80}}\b(?:in|within) the {_SOURCE}",
        r"\bno information (?:is |was )?(?:given|provided|available)\b",
    )
]


def placeholder(text: str) -> str | None:
    """Why ``text`` is a placeholder, or None."""
    stripped = text.strip()
    if _PUNCTUATION_ONLY.fullmatch(stripped) and ("..." in stripped or "…" in stripped or not stripped):
        return f"{stripped!r} is a placeholder"
    if _BRACKETED.fullmatch(stripped):
        return f"{stripped!r} is a template slot"
    if " ".join(words(stripped)) in _PLACEHOLDER_WORDS or stripped.lower().rstrip(".") in _PLACEHOLDER_WORDS:
        return f"{stripped!r} is a placeholder word"
    if "lorem ipsum" in stripped.lower():
        return "contains 'lorem ipsum'"
    return None


def echo_grams(instructions: str, evidence: str, n: int) -> set[tuple[str, ...]]:
    """Word n-grams of the prompt's instructions that do not occur in the evidence text."""
    inst, ev = words(instructions), words(evidence)
    grams = {tuple(inst[i : i + n]) for i in range(len(inst) - n + 1)}
    return grams - {tuple(ev[i : i + n]) for i in range(len(ev) - n + 1)}


def prompt_echo(text: str, grams: set[tuple[str, ...]], n: int) -> str | None:
    """Why ``text`` copies the prompt (an instruction n-gram of ``grams``, or the JSON format), or None."""
    if _JSON_FORMAT.search(text):
        return "contains the prompt's JSON format"
    found = words(text)
    echo = next((found[i : i + n] for i in range(len(found) - n + 1) if tuple(found[i : i + n]) in grams), None)
    return f"copies the prompt's instructions: {' '.join(echo)!r}" if echo else None


def refusal(text: str) -> str | None:
    """The refusal or meta-answer phrase in ``text``, or None."""
    match = next((found for found in (pattern.search(text) for pattern in _REFUSALS) if found), None)
    return f"refusal or meta-answer: {match.group(0).strip()!r}" if match else None


_DANGLING = frozenset(
    "a an the and or but nor of than its their whose my our your because although whereas including".split()
)  # words a sentence does not end on ("his", "her", "in", "for" may: "the book was his", "what it was made for")
_OPEN_END = re.compile(r"[,;:(\[{\-–—/&]$")
_PAIRS = (("(", ")"), ("[", "]"), ("{", "}"), ("“", "”"))


def unfinished(text: str) -> str | None:
    """Why ``text`` stops mid-sentence (a dangling last word, an open clause or bracket), or None."""
    stripped = text.strip()
    found = words(stripped)
    if not found:
        return None
    if _OPEN_END.search(stripped):
        return f"ends on {stripped[-1]!r}: {_tail(stripped)!r}"
    if found[-1] in _DANGLING and stripped[-1].isalpha():
        return f"stops on {found[-1]!r}: {_tail(stripped)!r}"
    for opening, closing in _PAIRS:
        if stripped.count(opening) > stripped.count(closing):
            return f"leaves {opening!r} open: {_tail(stripped)!r}"
    if stripped.count('"') % 2:
        return f"leaves a '\"' open: {_tail(stripped)!r}"
    return None


def too_short(text: str, minimum: int) -> str | None:
    """Why ``text`` has fewer than ``minimum`` real words, or None."""
    count = len(words(text))
    return f"{count} real word(s) ({text.strip()[:60]!r}), minimum {minimum}" if count < minimum else None


def _tail(text: str, width: int = 40) -> str:
    return text if len(text) <= width else "..." + text[-width:]


QUESTION_WORDS = frozenset(
    "who whom whose what which when where why how is are was were do does did can could should would will shall has "
    "have had may might must".split()
)
REQUESTS = frozenset(
    """name list describe explain give identify state summarize summarise compare contrast outline tell write find
    count determine calculate compute provide specify rank order sort arrange put trace discuss define enumerate
    indicate show quote cite estimate mention recount characterize characterise classify match select choose pick
    complete translate rewrite paraphrase""".split()
)  # the verbs of a question phrased as a request ("Name the river that ...", "List the three ...")
_LEADING = frozenset({"please", "briefly", "now", "then", "also", "so", "and"})
_PREPOSITIONS = frozenset("in on at to for from by of with about into under during after before since".split())


def not_a_question(question: str) -> str | None:
    """Why ``question`` is a statement rather than a question (``?``, a question word, "In which ...") or a request
    ("Name ...", "Based on Document 2, list ..."), or None."""
    stripped = question.strip().rstrip("\"'”’)]*»").rstrip()
    if stripped.endswith("?") or not words(stripped):
        return None
    for index, clause in enumerate(re.split(r"[,;:]|\.\s", stripped)):
        first, second, *_ = [*itertools.dropwhile(_LEADING.__contains__, words(clause)), "", ""]  # "": no word
        asks = first in QUESTION_WORDS or (first in _PREPOSITIONS and second in QUESTION_WORDS)
        if first in REQUESTS or (index == 0 and asks):
            return None
    return f"a statement, not a question or a request: {_tail(stripped, 60)!r}"


_LINKS = frozenset({"and", "or", "nor", "versus", "vs"})
_COPULAS = frozenset({"is", "are", "was", "were", "means", "equals", "remains", "remained", "becomes", "became"})
_RELATIVES = frozenset({"that", "which", "who"})
_SKIPPED = frozenset({"not", "also", "still", "just", "a", "an", "the", "simply", "really", "always", "only"})
_IDIOMS = frozenset(
    "more less again over on round through by around further better worse faster higher slower lower".split()
)  # "more and more", "over and over": a word said twice on purpose


def tautology(text: str) -> str | None:
    """Why ``text`` is a tautology or a loop, or None: "a lake that is a lake", "between X and X", "in 1903, in 1903,
    in 1903", or content words mostly one word said four times or more."""
    found = words(text)
    content = [w for w in found if w not in STOP_WORDS]
    for i, word in enumerate(found):
        if word in _LINKS and (phrase := _said_again(found, i, i + 1)) and phrase not in _IDIOMS:
            return f"compares {phrase!r} with itself ({phrase!r} {word} {phrase!r})"
        if word in _COPULAS or (word in _RELATIVES and i + 1 < len(found) and found[i + 1] in _COPULAS):
            start = i + 1 if word in _COPULAS else i + 2
            while start < len(found) and found[start] in _SKIPPED:
                start += 1
            if phrase := _said_again(found, i, start):
                return f"says that {phrase!r} is {phrase!r}"
    for length in range(1, 5):  # a phrase said three times in a row: a loop
        for i in range(len(found) - 3 * length + 1):
            gram = found[i : i + length]
            if gram * 3 == found[i : i + 3 * length] and _has_content(gram):
                return f"repeats {' '.join(gram)!r} in a loop"
    if content:
        word, count = Counter(content).most_common(1)[0]
        if count >= 4 and count * 2 >= len(content):
            return f"{count} of its {len(content)} content words are {word!r}"
    return None


def _said_again(found: list[str], end: int, start: int) -> str | None:
    """The longest phrase (<= 4 words, a content word among them) ending before ``found[end]`` and said again from
    ``found[start]``, or None."""
    for length in range(4, 0, -1):
        phrase = found[max(0, end - length) : end]
        if len(phrase) == length and phrase == found[start : start + length] and _has_content(phrase):
            return " ".join(phrase)
    return None


def _has_content(found: Sequence[str]) -> bool:
    return any(w not in STOP_WORDS for w in found)


_FILLER = frozenset(
    stem(w) for w in "something anything thing things certain various specific particular kind sort type way".split()
)  # words that add nothing to a restated question ("In 1874 something happened.")
_POLARITY = frozenset("yes no not never neither nor none nobody nothing true false correct incorrect".split())


def restates_question(question: str, answer: str, coverage: float) -> str | None:
    """Why ``answer`` only restates ``question`` (all its content words are the question's, and at least ``coverage``
    of them), or None; a yes or no, a negation, or one option the question names adds something."""
    answer_words = words(answer)
    if any(w in _POLARITY or w.endswith("n't") for w in answer_words if w not in words(question)):
        return None
    asked = content_stems(question)
    said = [s for s in content_stems(answer) if s not in _FILLER]
    if not asked or not said or any(s not in asked for s in said):
        return None
    share = len(said) / len(asked)
    if share + 1e-9 < coverage:
        return None
    original = {stem(w): w for w in answer_words}
    shown = ", ".join(repr(original.get(s, s)) for s in said[:8])
    return f"adds nothing to its question: all its content words ({shown}) are the question's ({share:.0%} of them)"


def ungrounded(
    answer: str, evidence_stems: set[str], min_fraction: float, drop_numbers: bool, question: str = ""
) -> str | None:
    """Why ``answer`` is not grounded (the missing content words), or None; ``question``'s words are not counted."""
    asked = {stem(w) for w in words(question)}
    if not (stems := [s for s in content_stems(answer, drop_numbers) if s not in asked]):
        return None
    missing = [s for s in stems if s not in evidence_stems]
    present = 1 - len(missing) / len(stems)
    if present + 1e-9 >= min_fraction and not any(s.isdigit() for s in missing):
        return None
    original = {stem(w): w for w in words(answer)}
    shown = ", ".join(repr(original.get(s, s)) for s in missing[:12]) + (" ..." if len(missing) > 12 else "")
    need = f"need {min_fraction:.0%}" + (", and every number" if not drop_numbers else "")
    return (
        f"{len(missing)} of {len(stems)} content words not in the text asked about ({present:.0%} present, "
        f"{need}): {shown}"
    )


def _name_tokens(name: str, others: Iterable[str]) -> list[str]:
    """Words of ``name`` that tell it apart from the ``others`` (a shared family name does not)."""
    shared = {w for other in others for w in words(other)}
    own = [w for w in words(name) if w not in STOP_WORDS and len(w) >= 2]
    return [w for w in own if w not in shared] or own


def name_words(text: str) -> list[str]:
    """Words of ``text`` with possessives dropped ("Marten's" -> "marten"), to find names."""
    return [re.sub(r"['’]s$", "", word) for word in words(text)]


def wrong_subject(name: str, biography: str, others: Sequence[str], evidence_words: set[str]) -> str | None:
    """Why the biography is not about ``name`` (absent from it or the book, or another name more frequent), or None."""
    if not (tokens := _name_tokens(name, others)):
        return f"the requested name {name!r} has no letters"
    counts = Counter(name_words(biography))
    own = max(counts[t] for t in tokens)
    if not own:
        return f"the biography never names {name!r}"
    if not any(t in evidence_words for t in tokens):
        return f"{name!r} does not occur in the book"
    for other in others:
        theirs = max((counts[t] for t in _name_tokens(other, [name, *[o for o in others if o != other]])), default=0)
        if theirs > own:
            return f"mostly about {other!r} ({theirs} mentions) rather than {name!r} ({own})"
    return None


class QualityGates:
    """Applies the gates of a :class:`QualityConfig` and counts, per task, the items ``checked``, the ``rejected``
    ones per reason, and the ``unused`` ones (passed, beyond the number a job asked for)."""

    def __init__(self, config: QualityConfig | None = None):
        self.config = config or QualityConfig()
        self.checked: Counter[str] = Counter()
        self.rejected: dict[str, Counter[str]] = {}
        self.unused: Counter[str] = Counter()

    def on(self, gate: str) -> bool:
        return self.config.enabled and gate not in self.config.disable

    def check(
        self,
        task: str,
        items: Sequence[QAPair],
        evidence: str,
        instructions: str = "",
        subjects: Sequence[str] | None = None,
    ) -> Verdict:
        """Judge the items of one answer of ``task``, asked about ``evidence`` by a prompt whose ``instructions`` (the
        prompt without the evidence) they must not copy; ``subjects``: for biographies, each item's requested name.
        Each item gets the first gate it fails, in the order of :data:`REASONS`."""
        if not self.config.enabled:
            return Verdict(kept=list(items))
        self.checked[task] += len(items)
        cfg, computed_numbers = self.config, get_task(task).computed_numbers
        qa = subjects is None  # QA pairs, else biographies (whose question is longpeft's own)
        evidence_words = set(name_words(evidence))
        evidence_stems = {stem(w) for w in evidence_words}
        grams = echo_grams(instructions, evidence, cfg.echo_words) if instructions else set()
        minimum = dict(question=cfg.min_question_words, answer=cfg.min_answer_words, biography=cfg.min_biography_words)
        per_field: dict[str, Callable[[str, str], str | None]] = {  # gate -> why(label, text), for each field
            "placeholder": lambda label, text: placeholder(text),
            "prompt_echo": lambda label, text: prompt_echo(text, grams, cfg.echo_words) if grams else None,
            "refusal": lambda label, text: refusal(text),
            "too_short": lambda label, text: too_short(text, minimum[label]),
            "unfinished": lambda label, text: unfinished(text),
            "not_a_question": lambda label, text: not_a_question(text) if label == "question" and qa else None,
            "tautology": lambda label, text: tautology(text),
        }
        per_item: dict[str, Callable[[QAPair, str], str | None]] = {  # gate -> why(item, its subject)
            "restates_question": lambda item, name: (
                restates_question(item.question, item.answer, cfg.restatement_coverage) if qa else None
            ),
            "wrong_subject": lambda item, name: (
                None if qa else wrong_subject(name, item.answer, [s for s in subjects if s != name], evidence_words)
            ),
            "ungrounded": lambda item, name: ungrounded(
                item.answer, evidence_stems, cfg.min_grounded_fraction, computed_numbers, item.question
            ),
        }

        def first_failure(item: QAPair, name: str | None) -> Rejection | None:
            fields = {"question": item.question, "answer" if qa else "biography": item.answer}
            for gate in filter(self.on, REASONS[:-1]):
                if gate in per_field:
                    whys = ((label, per_field[gate](label, text)) for label, text in fields.items())
                    why = next((f"{label}: {found}" for label, found in whys if found), None)
                else:
                    why = per_item[gate](item, name)
                if why:
                    return Rejection(gate, why)
            return None

        failures = [first_failure(item, None if qa else subjects[index]) for index, item in enumerate(items)]
        return self._judge(task, items, [], failures)

    def check_repeats(self, task: str, items: Sequence[QAPair], earlier_questions: Sequence[str]) -> Verdict:
        """The ``near_duplicate`` gate alone, against questions kept for the same context from other answers."""
        return self._judge(task, items, earlier_questions, [None] * len(items))

    def _judge(
        self, task: str, items: Sequence[QAPair], earlier: Sequence[str], failures: Sequence[Rejection | None]
    ) -> Verdict:
        """Keep or reject each item: its failure, else ``near_duplicate`` against ``earlier`` and the kept ones."""
        verdict, kept_questions = Verdict(), list(earlier)
        for item, rejection in zip(items, failures):
            if rejection is None and self.on("near_duplicate"):
                rejection = self._duplicate(item.question, kept_questions)
            if rejection is None:
                verdict.kept.append(item)
                kept_questions.append(item.question)
            else:
                self.rejected.setdefault(task, Counter())[rejection.reason] += 1
                verdict.rejected.append((item, rejection))
        return verdict

    def _duplicate(self, question: str, kept: Sequence[str]) -> Rejection | None:
        for earlier in kept:  # questions naming different numbers differ
            similarity = jaccard(question, earlier)
            if similarity >= self.config.max_question_similarity and numbers(question) == numbers(earlier):
                return Rejection("near_duplicate", f"repeats {earlier[:80]!r} (similarity {similarity:.2f})")
        return None

    def report(self) -> dict[str, Any]:
        """JSON-ready counts: items checked, kept and unused, rejections by reason overall and per task."""
        total: Counter[str] = sum(self.rejected.values(), Counter())
        checked = sum(self.checked.values())
        return {
            "enabled": self.config.enabled,
            "checked": checked,
            "kept": checked - sum(total.values()),
            "unused": sum(self.unused.values()),
            "rejected": {reason: total[reason] for reason in REASONS if total[reason]},
            "rejected_per_task": {
                task: {r: counts[r] for r in REASONS if counts[r]} for task, counts in sorted(self.rejected.items())
            },
        }
