"""Offline procedural corpus: chronicles ("story") and annual reports ("report") of made-up towns living from one
topic (a harbor, an observatory, ...), deterministic given the seed. Fact sentences are scattered through filler, each
fact recorded with its question, exact answer and character span, so QA about any slice is right by construction.
Documents of one topic share vocabulary, so text clustering groups them."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_VOCABULARY = {  # topic -> word list -> its comma-separated items
    "harbor": {
        "places": "harbor, pier, lighthouse, dock, boathouse, fish market, sea wall, ferry landing",
        "objects": "anchor, net, rope, lantern, compass, oar, buoy, sail",
        "professions": "sailor, fisher, boatbuilder, harbor pilot, net maker",
        "structures": "breakwater, slipway, customs house, signal tower, ice house, rope walk",
        "sights": "gulls circled over the water, the tide pulled at the moorings, salt dried on the decks",
    },
    "mountain": {
        "places": "pass, quarry, ridge, mine entrance, mountain hut, ice field, stone bridge, cable station",
        "objects": "pickaxe, helmet, sled, ladder, drill, cable, boot, crampon",
        "professions": "miner, guide, stonecutter, surveyor, cable operator",
        "structures": "tunnel, shelter, avalanche fence, ore mill, water channel, rope bridge",
        "sights": "snow lay on the high slopes, rocks rattled down the scree, the air was thin and cold",
    },
    "orchard": {
        "places": "orchard, cider press, barn, grove, apple store, packing shed, beehive field, farm gate",
        "objects": "basket, ladder, crate, pruning knife, barrel, cart, sieve, hoe",
        "professions": "farmer, beekeeper, cider maker, gardener, fruit picker",
        "structures": "irrigation pond, drying kiln, granary, greenhouse, windmill, seed store",
        "sights": "blossom covered the rows of trees, bees hummed over the clover, ripe fruit bent the branches",
    },
    "observatory": {
        "places": "observatory, dome, star chart room, telescope deck, clock room, archive, lecture hall, courtyard",
        "objects": "telescope, lens, star chart, sextant, notebook, chronometer, mirror, globe",
        "professions": "astronomer, clockmaker, lens grinder, archivist, instrument maker",
        "structures": "meridian hall, radio mast, library wing, weather station, guest house, map room",
        "sights": "the night sky was clear, a comet crossed the northern sky, the dome turned slowly",
    },
    "railway": {
        "places": "station, signal box, engine shed, platform, goods yard, ticket hall, water tower, junction",
        "objects": "whistle, timetable, lamp, ticket punch, coal shovel, brake lever, flag, wheel",
        "professions": "engine driver, signal keeper, porter, ticket clerk, track inspector",
        "structures": "viaduct, turntable, footbridge, waiting room, coal depot, branch line",
        "sights": "steam drifted over the platform, the rails hummed before a train, smoke rose from the shed",
    },
    "library": {
        "places": "library, reading room, print shop, bindery, map hall, book market, scriptorium, garden court",
        "objects": "ledger, quill, printing plate, catalogue, bookplate, ink pot, folio, reading lamp",
        "professions": "librarian, printer, bookbinder, translator, copyist",
        "structures": "east gallery, rare book vault, paper mill, reading tower, type foundry, book bridge",
        "sights": "dust floated in the light of the windows, pages rustled in the quiet, ink dried on fresh sheets",
    },
}
Vocabulary = dict[str, list[str]]  # one topic's word lists
TOPICS: dict[str, Vocabulary] = {
    topic: {key: items.split(", ") for key, items in lists.items()} for topic, lists in _VOCABULARY.items()
}


TOPIC_DESCRIPTIONS = {
    "harbor": "a town living from its harbor and the sea",
    "mountain": "a mountain town living from its mines and quarries",
    "orchard": "a farming town living from its orchards",
    "observatory": "a town built around its observatory",
    "railway": "a town built around its railway junction",
    "library": "a town known for its library and printing",
}

FIRST_NAMES = (
    "Ada Bram Cora Dane Elsa Finn Greta Hugo Ines Jonas Kira Lars Mila Nils Olga Pavel Rosa Sven Tara Ulf "
    "Vera Wim Yara Zeno Alma Boris Clea Dario Edda Felix Gina Hanno Ilse Jorge Lena Milo Nora Otto Petra Rudi"
).split()
LAST_NAMES = (
    "Ashby Brandt Castell Dorn Ebner Falk Grell Hale Ivers Janek Kell Lorne Marsh Nagel Orme Pike Quist Rook "
    "Sand Thorn Ulm Vance Wolde Yates Zorn Abel Birk Crane Drost Esk Fenn Gast Holm Jarl Kade Lund Moss Noll"
).split()
TOWN_PARTS = (
    "Ash Brook Cold Deep Elm Fair Gold High Iron Lark Mill North Oak Red Stone Thorn West Wind".split(),
    "ford haven wick dale mere stead bury field port holm ton gate".split(),
)
ADJECTIVES = "red blue green silver golden black white copper amber grey bronze violet".split()
ANIMALS = "dog cat horse goat parrot owl rabbit tortoise".split()
PET_NAMES = "Biscuit Pepper Juniper Clover Pebble Thistle Marlow Sprocket Nutmeg Willow Cinder Mosby".split()
STREETS = "Mill Church Market Bridge Garden Station Harbor Castle Orchard Chapel Well Tanner".split()
GENERAL_PROFESSIONS = ["doctor", "teacher", "baker", "carpenter", "judge"]
EVENT_VERBS = ["built", "repaired", "opened", "closed", "painted", "rebuilt"]
TIMES = ["in the morning", "at noon", "in the evening", "after the rain", "before dawn", "on market day"]
ADVERBS = ["slowly", "quietly", "steadily", "without pause", "as usual", "with great care"]

FACT_KINDS = ("code", "profession", "street", "event")


@dataclass(frozen=True)
class Fact:
    """One fact written into a document: ``fact_id`` ``"<doc_id>:<n>"``; its ``kind`` (``code``, ``profession``,
    ``street``, ``event``, ``founded``, ``population``, or a main character's ``birth_year``, ``birthplace``,
    ``profession``, ``sibling`` or ``pet``); its ``subject`` (a person, ``"blue lantern at the pier"``, ...); its
    ``value``, the exact answer as written, to ``question``; the ``sentence`` stating it, at ``start:end`` of the
    text; ``detail``: more fields (the verb of an event, the animal of a pet, ...)."""

    fact_id: str
    kind: str
    subject: str
    value: str
    question: str
    sentence: str
    start: int
    end: int
    detail: tuple[tuple[str, str], ...] = ()

    def get(self, key: str) -> str:
        return dict(self.detail)[key]


@dataclass
class Character:
    """A main character: a name and the attributes its facts state."""

    name: str
    attributes: dict[str, str]


@dataclass
class Document:
    """A source document: ``doc_id`` (the prefix of its fact ids), ``title`` (the first line of procedural texts),
    ``text`` and ``kind`` (``"story"`` or ``"report"``; ``"text"`` for a file). A procedural one carries its ground
    truth: its ``topic`` (a key of :data:`TOPICS`), every fact in order of appearance, its main characters (one
    fact per attribute, many mentions) and its ``profile`` (``town``, ``founded``, ``population``, ``topic``)."""

    doc_id: str
    title: str
    text: str
    kind: str = "text"
    topic: str | None = None
    facts: list[Fact] = field(default_factory=list)
    characters: list[Character] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)


class _Writer:
    """Accumulates sentences into paragraphs while recording each fact's character span."""

    def __init__(self, doc_id: str, title: str):
        self.doc_id = doc_id
        self.parts: list[str] = [title, "\n\n"]
        self.length = len(title) + 2
        self.facts: list[Fact] = []
        self.in_paragraph = 0

    def sentence(self, text: str, *facts: tuple[str, str, str, str], **detail: str) -> None:
        """Write ``text``, which states each of ``facts`` (kind, subject, value, question), with ``detail``."""
        if self.in_paragraph:
            self.parts.append(" ")
            self.length += 1
        start = self.length
        self.parts.append(text)
        self.length += len(text)
        self.in_paragraph += 1
        for kind, subject, value, question in facts:
            assert value in text, (value, text)
            fact_id = f"{self.doc_id}:{len(self.facts)}"
            self.facts.append(
                Fact(fact_id, kind, subject, value, question, text, start, self.length, tuple(sorted(detail.items())))
            )

    def end_paragraph(self) -> None:
        if self.in_paragraph:
            self.parts.append("\n\n")
            self.length += 2
            self.in_paragraph = 0

    def text(self) -> str:
        return "".join(self.parts).rstrip() + "\n"


def _take_name(names: list[str]) -> str:
    """The next of a document's unique person names (every name, shuffled once per document)."""
    if not names:
        raise RuntimeError("document too long for the name pool; lower the fact rate")
    return names.pop()


def article(word: str) -> str:
    """``"a baker"`` / ``"an astronomer"``."""
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def town_name(rng: random.Random) -> str:
    return rng.choice(TOWN_PARTS[0]) + rng.choice(TOWN_PARTS[1])


def generate_document(
    seed: int,
    n_sentences: int = 400,
    kind: str | None = None,
    topic: str | None = None,
    fact_kinds: Sequence[str] = FACT_KINDS,
    fact_rate: float = 0.15,
    n_characters: int = 4,
    doc_id: str | None = None,
) -> Document:
    """One document, all of it following from ``seed``: the town's profile, then ``n_sentences`` sentences (~10
    words each) in paragraphs of 4 to 8: the facts of ``n_characters`` main characters (birth year and place,
    profession, sibling, pet) spread over it, scattered facts of ``fact_kinds`` (:data:`FACT_KINDS`) in
    ``fact_rate`` of the sentences, and filler. ``kind`` (``"story"`` or ``"report"``) and ``topic`` are random when
    None; ``doc_id`` defaults to ``"doc-<seed>"``."""
    rng = random.Random(seed)
    kind = kind or rng.choice(["story", "report"])
    topic = topic or rng.choice(sorted(TOPICS))
    if kind not in ("story", "report"):
        raise ValueError(f"kind must be 'story' or 'report', got {kind!r}")
    if topic not in TOPICS:
        raise ValueError(f"unknown topic {topic!r}; choose one of {sorted(TOPICS)}")
    if n_sentences < 4 * n_characters:
        raise ValueError(f"n_sentences ({n_sentences}) must be at least 4 per main character ({4 * n_characters})")
    if unknown := sorted(set(fact_kinds) - set(FACT_KINDS)):
        raise ValueError(f"unknown fact kinds {unknown}; choose from {FACT_KINDS}")
    doc_id = doc_id or f"doc-{seed}"
    vocab = TOPICS[topic]
    town = town_name(rng)
    title = f"The Chronicle of {town}" if kind == "story" else f"Annual Report of {town}"
    professions = vocab["professions"] + GENERAL_PROFESSIONS
    names = [f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES]
    rng.shuffle(names)
    writer = _Writer(doc_id, title)
    profile = _write_profile(writer, rng, town, topic)
    characters = [_main_character(rng, names, professions) for _ in range(n_characters)]
    slots: dict[int, tuple[Character, str]] = {}  # sentence -> each character's facts, at distinct sentences
    for character in characters:
        for attribute in ("birth", "profession", "sibling", "pet"):
            slot = rng.randrange(n_sentences)
            while slot in slots:
                slot = rng.randrange(n_sentences)
            slots[slot] = (character, attribute)

    used: set[tuple[str, ...]] = set()
    paragraph_left = rng.randint(4, 8)
    for index in range(n_sentences):
        if index in slots:
            _character_sentence(writer, *slots[index])
        elif fact_kinds and rng.random() < fact_rate:
            _fact_sentence(writer, rng, rng.choice(list(fact_kinds)), vocab, names, used)
        else:
            writer.sentence(_filler(rng, kind, town, vocab, characters))
        paragraph_left -= 1
        if paragraph_left == 0:
            writer.end_paragraph()
            paragraph_left = rng.randint(4, 8)
    writer.end_paragraph()
    return Document(doc_id, title, writer.text(), kind, topic, writer.facts, characters, profile)


def _write_profile(writer: _Writer, rng: random.Random, town: str, topic: str) -> dict[str, Any]:
    """The opening paragraph: the town's founding year and population (two facts) and its topic; returns the
    document's ``profile``."""
    founded, population = rng.randint(1200, 1890), rng.randint(800, 60000)
    writer.sentence(
        f"{town} was founded in {founded}.", ("founded", town, str(founded), f"In which year was {town} founded?")
    )
    writer.sentence(
        f"Today {town} has {population} inhabitants.",
        ("population", town, str(population), f"How many inhabitants does {town} have?"),
    )
    writer.sentence(f"It is {TOPIC_DESCRIPTIONS[topic]}.")
    writer.end_paragraph()
    return {"town": town, "founded": founded, "population": population, "topic": topic}


def _main_character(rng: random.Random, names: list[str], professions: list[str]) -> Character:
    """A main character: a name and a sibling from ``names``, a birth year and place, a profession and a pet."""
    name, animal = _take_name(names), rng.choice(ANIMALS)
    attributes = {
        "birth_year": str(rng.randint(1700, 1990)),
        "birthplace": town_name(rng),
        "profession": rng.choice(professions),
        "sibling": _take_name(names),
        "pet": rng.choice(PET_NAMES),
        "pet_animal": animal,
    }
    return Character(name, attributes)


def _character_sentence(writer: _Writer, character: Character, attribute: str) -> None:
    name, a = character.name, character.attributes
    if attribute == "birth":
        writer.sentence(
            f"{name} was born in {a['birthplace']} in {a['birth_year']}.",
            ("birth_year", name, a["birth_year"], f"In which year was {name} born?"),
            ("birthplace", name, a["birthplace"], f"Where was {name} born?"),
        )
    elif attribute == "profession":
        writer.sentence(
            f"{name} made a living as {article(a['profession'])}.",
            ("profession", name, a["profession"], f"What was {name}'s profession?"),
            main="yes",
        )
    elif attribute == "sibling":
        writer.sentence(
            f"{name} had a sibling named {a['sibling']}.",
            ("sibling", name, a["sibling"], f"What was the name of {name}'s sibling?"),
        )
    else:
        animal, question = a["pet_animal"], f"What was the name of {name}'s {a['pet_animal']}?"
        writer.sentence(
            f"{name} kept {article(animal)} called {a['pet']}.", ("pet", name, a["pet"], question), animal=animal
        )


def _fresh(rng: random.Random, used: set[tuple[str, ...]], *choices: Sequence[str]) -> tuple[str, ...] | None:
    """One item of each of ``choices``, drawn again while the draw is in ``used`` (then added to it); None when 20
    draws were all used."""
    for _ in range(20):
        drawn = tuple(rng.choice(items) for items in choices)
        if drawn not in used:
            used.add(drawn)
            return drawn
    return None


def _fact_sentence(
    writer: _Writer, rng: random.Random, kind: str, vocab: Vocabulary, names: list[str], used: set[tuple[str, ...]]
) -> None:
    """A scattered fact of ``kind`` (``used``: the objects and structures already written about); filler when 20
    draws find only used ones."""
    if kind == "profession":
        name, profession = _take_name(names), rng.choice(vocab["professions"] + GENERAL_PROFESSIONS)
        writer.sentence(
            f"{name} worked as {article(profession)}.",
            ("profession", name, profession, f"What was {name}'s profession?"),
        )
    elif kind == "street":
        name, street = _take_name(names), rng.choice(STREETS)
        writer.sentence(
            f"{name} lived on {street} Street.",
            ("street", name, f"{street} Street", f"On which street did {name} live?"),
        )
    elif kind == "code" and (drawn := _fresh(rng, used, ADJECTIVES, vocab["objects"], vocab["places"])):
        subject, number = "{} {} at the {}".format(*drawn), str(rng.randint(1000, 99999))
        writer.sentence(
            f"The {subject} is marked with the number {number}.",
            ("code", subject, number, f"What number is the {subject} marked with?"),
        )
    elif kind == "event" and (drawn := _fresh(rng, used, ADJECTIVES, vocab["structures"])):
        structure, verb, year = " ".join(drawn), rng.choice(EVENT_VERBS), str(rng.randint(1700, 1990))
        writer.sentence(
            f"In {year}, the council {verb} the {structure}.",
            ("event", structure, year, f"In which year did the council {verb} the {structure}?"),
            verb=verb,
        )
    else:
        writer.sentence(_filler(rng, "report", "the town", vocab, []))


def _filler(rng: random.Random, kind: str, town: str, vocab: Vocabulary, characters: list[Character]) -> str:
    place, other = rng.sample(vocab["places"], 2)
    obj = rng.choice(vocab["objects"])
    options = [
        f"Near the {place}, {rng.choice(vocab['sights'])}.",
        f"People met at the {place} {rng.choice(TIMES)} to talk about the {obj}.",
        f"{article(rng.choice(ADJECTIVES)).capitalize()} {obj} lay by the {place}.",
        f"Work at the {place} went on {rng.choice(ADVERBS)}.",
        f"The road from the {place} to the {other} was busy {rng.choice(TIMES)}.",
        f"Every {rng.choice(vocab['professions'])} in {town} knew the way to the {place}.",
    ]
    if characters:
        name = rng.choice(characters).name
        options.append(f"{name} walked to the {place} {rng.choice(TIMES)}.")
        options.append(f"{name} spoke with {article(rng.choice(vocab['professions']))} about the {obj}.")
    sentence = rng.choice(options)
    if kind == "report" and rng.random() < 0.25:
        sentence = "The records note that " + sentence[0].lower() + sentence[1:]
    return sentence


def corpus_texts(n: int = 40, seed: int = 0, n_sentences: int = 120) -> list[str]:
    """``n`` procedural texts to train a tokenizer on, covering every topic and both kinds: documents followed by
    their questions and answers (the QA builders' wording)."""
    rng, topics, texts = random.Random(seed), sorted(TOPICS), []
    for index in range(n):
        kind, topic = ("story", "report")[index % 2], topics[index % len(topics)]
        document = generate_document(seed=rng.randrange(2**31), n_sentences=n_sentences, topic=topic, kind=kind)
        qa = "\n".join(f"{fact.question} {fact.value}." for fact in document.facts)
        texts.append(f"{document.text}\n{qa}\n")
    return texts
