"""A deterministic knowledge world for multi-hop search, and its corpus: one document per entity.

Countries are real (from `countryinfo`); people, companies and universities are invented from a seed, so an
answer can be found in the corpus but not remembered from pretraining. Every entity belongs to the train or
the held-out split by a stable hash of its name, and relations never cross splits: a question about
held-out entities only ever leads to held-out documents.

Retrieval is kept easy on purpose (a 5M model must learn it): each entity's name is distinctive, its own
document repeats it, and every fact is stated with the value copied verbatim. Near-namesakes (people
sharing a surname or a first name, companies sharing a stem) and event reports that mention entities in
passing are the distractors.
"""

from __future__ import annotations

import hashlib
import random
import re
import unicodedata
from dataclasses import dataclass, field
from functools import lru_cache

import countryinfo

HELDOUT_FRACTION = 0.2

# (subject kind, relation) -> object kind; None where the object is a literal phrase, not an entity.
SCHEMA: dict[tuple[str, str], str | None] = {
    ("person", "born_in"): "country",
    ("person", "works_for"): "company",
    ("person", "studied_at"): "university",
    ("person", "mentor"): "person",
    ("person", "occupation"): None,
    ("company", "headquartered_in"): "country",
    ("company", "founded_by"): "person",
    ("company", "founded_in"): None,
    ("company", "industry"): None,
    ("university", "located_in"): "country",
    ("university", "founded_in"): None,
    ("country", "capital"): None,
    ("country", "region"): None,
    ("country", "currency"): None,
    ("country", "language"): None,
}
ENTITY_RELATIONS = frozenset(rel for (_, rel), obj in SCHEMA.items() if obj is not None)

# Defunct or duplicate records in countryinfo (the same capital under a second name).
SKIP_COUNTRIES = {"Antilles néerlandaises", "Serbia and Montenegro", "Palestine, State of", "Burma"}
# Only currencies and languages with a plain English name get a fact; the rest are left out.
CURRENCIES = {
    "EUR": "euro", "USD": "United States dollar", "XCD": "East Caribbean dollar", "XOF": "West African CFA franc",
    "XAF": "Central African CFA franc", "AUD": "Australian dollar", "GBP": "pound sterling",
    "NZD": "New Zealand dollar", "DKK": "Danish krone", "XPF": "CFP franc", "ILS": "Israeli new shekel",
    "MAD": "Moroccan dirham", "NOK": "Norwegian krone", "SEK": "Swedish krona", "ISK": "Icelandic krona",
    "CHF": "Swiss franc", "PLN": "Polish zloty", "CZK": "Czech koruna", "HUF": "Hungarian forint",
    "RON": "Romanian leu", "BGN": "Bulgarian lev", "UAH": "Ukrainian hryvnia", "RUB": "Russian ruble",
    "TRY": "Turkish lira", "JPY": "Japanese yen", "CNY": "Chinese yuan", "KRW": "South Korean won",
    "INR": "Indian rupee", "PKR": "Pakistani rupee", "IDR": "Indonesian rupiah", "THB": "Thai baht",
    "VND": "Vietnamese dong", "PHP": "Philippine peso", "MYR": "Malaysian ringgit", "SGD": "Singapore dollar",
    "CAD": "Canadian dollar", "MXN": "Mexican peso", "BRL": "Brazilian real", "ARS": "Argentine peso",
    "COP": "Colombian peso", "PEN": "Peruvian sol", "EGP": "Egyptian pound", "NGN": "Nigerian naira",
    "KES": "Kenyan shilling", "ETB": "Ethiopian birr", "GHS": "Ghanaian cedi", "ZAR": "South African rand",
    "SAR": "Saudi riyal", "AED": "UAE dirham", "QAR": "Qatari riyal", "KWD": "Kuwaiti dinar",
    "JOD": "Jordanian dinar", "DZD": "Algerian dinar", "TND": "Tunisian dinar", "KZT": "Kazakhstani tenge",
}
LANGUAGES = {
    "en": "English", "fr": "French", "es": "Spanish", "ar": "Arabic", "pt": "Portuguese", "nl": "Dutch",
    "de": "German", "it": "Italian", "zh": "Chinese", "el": "Greek", "ko": "Korean", "ro": "Romanian",
    "no": "Norwegian", "sv": "Swedish", "da": "Danish", "fi": "Finnish", "is": "Icelandic", "pl": "Polish",
    "cs": "Czech", "sk": "Slovak", "hu": "Hungarian", "ru": "Russian", "uk": "Ukrainian", "bg": "Bulgarian",
    "hr": "Croatian", "sr": "Serbian", "sq": "Albanian", "tr": "Turkish", "ja": "Japanese", "hi": "Hindi",
    "bn": "Bengali", "id": "Indonesian", "ms": "Malay", "th": "Thai", "vi": "Vietnamese", "fa": "Persian",
    "he": "Hebrew", "sw": "Swahili", "am": "Amharic", "et": "Estonian", "lv": "Latvian", "lt": "Lithuanian",
    "ka": "Georgian", "hy": "Armenian", "mn": "Mongolian", "ne": "Nepali", "so": "Somali",
}
OCCUPATIONS = ["engineer", "architect", "economist", "chemist", "journalist", "geologist", "composer", "surgeon",
               "historian", "pilot", "botanist", "lawyer", "physicist", "translator", "designer", "astronomer"]
INDUSTRIES = ["software", "shipbuilding", "biotechnology", "logistics", "renewable energy", "textiles", "mining",
              "aerospace", "food processing", "telecommunications", "robotics", "insurance", "publishing"]
COMPANY_SUFFIXES = ["Systems", "Labs", "Industries", "Holdings", "Group", "Dynamics", "Works", "Partners"]
UNIVERSITY_FORMS = ["University of {}", "{} University", "{} Institute of Technology", "{} State University"]
EVENT_KINDS = ["Forum", "Summit", "Expo", "Symposium", "Congress"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr",
          "v", "z", "th", "sh", "qu"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "i", "o", "ei", "ou", "y"]
CODAS = ["", "", "n", "r", "l", "s", "x", "k", "m", "nd"]


@dataclass(frozen=True)
class Entity:
    name: str
    kind: str  # country | person | company | university
    split: str  # train | heldout
    doc_id: str
    facts: dict[str, str]  # relation -> value as the document writes it: an entity name or a literal phrase
    aliases: tuple[str, ...] = ()  # other names the entity is known by (countries only)
    value_aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # literal relation -> other forms


@dataclass(frozen=True, eq=False)  # compared and hashed by identity, so question pools can be cached per world
class World:
    seed: int
    entities: dict[str, Entity]  # by name; names are unique across kinds
    docs: tuple[dict[str, str], ...]  # the corpus: entity documents, then distractors

    def documents(self) -> list[dict[str, str]]:
        """The corpus in Search-R1 JSONL shape, `{"id": ..., "contents": "\\"Title\\"\\ntext"}`, in a stable order."""
        return [dict(d) for d in self.docs]

    def train_documents(self) -> list[dict[str, str]]:
        """The documents that name no held-out entity: all that training shows a model of this world."""
        names = (re.escape(n) for n, e in self.entities.items() if e.split == "heldout")
        heldout = re.compile(r"\b(" + "|".join(names) + r")\b")
        return [dict(d) for d in self.docs if not heldout.search(d["contents"])]


def split_of(name: str) -> str:
    """An entity's split by a stable hash of its name: "heldout" for about `HELDOUT_FRACTION` of names, else
    "train"."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return "heldout" if h % 1000 < HELDOUT_FRACTION * 1000 else "train"


def fold_accents(text: str) -> str:
    """`text` in ASCII: accents stripped (NFKD), any other non-ASCII character dropped."""
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()


def _is_latin(text: str) -> bool:
    return all(not c.isalpha() or "LATIN" in unicodedata.name(c, "") for c in text)


@lru_cache(maxsize=1)
def _countries() -> tuple[dict, ...]:
    """Country records with a name, capital and region, as plain dicts: name, capital, region, subregion,
    currency (code or None), language (name or None), population, borders (names), aliases."""
    infos = [c.info() for c in countryinfo.all_countries()]
    usable = [i for i in infos if i["name"] not in SKIP_COUNTRIES and not re.search(r"[,(]", i["name"])
              and isinstance(i.get("capital"), str) and i.get("capital") and i.get("region") and i.get("subregion")]
    by_alpha3 = {i["ISO"]["alpha3"]: i["name"] for i in usable if i.get("ISO")}
    records = []
    for i in sorted(usable, key=lambda i: i["name"]):
        alts = [a.strip() for a in (i.get("altSpellings") or []) + [i.get("nativeName") or ""]]
        aliases = [a for a in dict.fromkeys(alts) if len(a) > 3 and not a.isupper() and _is_latin(a) and a != i["name"]]
        code = next((c for c in i.get("currencies") or [] if c in CURRENCIES), None)
        main_language = (i.get("languages") or [None])[0]  # only the first listed: others may be minorities
        records.append({
            "name": i["name"], "capital": i["capital"], "region": i["region"], "subregion": i["subregion"],
            "currency": code, "language": LANGUAGES.get(main_language),
            "population": i.get("population") or 0, "aliases": aliases[:4],
            "borders": [by_alpha3[b] for b in i.get("borders") or [] if b in by_alpha3]})
    return tuple(records)


class _Words:
    """Invented words, each used once across the whole world, so a name's tokens point to few documents."""

    def __init__(self, rng: random.Random, taken: set[str]):
        self.rng, self.taken = rng, taken

    def new(self) -> str:
        while True:
            n = self.rng.choice([2, 2, 2, 3])
            word = "".join(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(n))
            word = (word + self.rng.choice(CODAS)).capitalize()
            if 4 <= len(word) <= 8 and word.lower() not in self.taken:
                self.taken.add(word.lower())
                return word


def _unique_names(n: int, make) -> list[str]:
    names: dict[str, None] = {}  # ordered set: iteration order must not depend on string hashing
    while len(names) < n:
        names.setdefault(make(), None)
    return list(names)


def build_world(seed: int = 0, n_people: int = 1500, n_companies: int = 300, n_universities: int = 120,
                n_events: int = 600) -> World:
    """The world for `seed`: ~240 real countries plus the invented entities, their relations, and a corpus of
    one document per entity plus `n_events` distractor reports (about 2,800 documents with the defaults)."""
    if min(n_people, n_companies, n_universities) < 20:
        raise ValueError("n_people, n_companies and n_universities must each be at least 20, so that both "
                         "splits get entities of every kind")
    rng = random.Random(seed)
    countries = _countries()
    taken = {t for c in countries for t in re.findall(r"\w+", f"{c['name']} {c['capital']}".lower())}
    words = _Words(rng, taken)
    firsts = [words.new() for _ in range(max(20, n_people // 4))]
    surnames = [words.new() for _ in range(max(20, n_people // 3))]  # ~3 people per surname: near-namesakes
    stems = [words.new() for _ in range(max(10, n_companies * 2 // 3))]  # some companies share a stem
    people = _unique_names(n_people, lambda: f"{rng.choice(firsts)} {rng.choice(surnames)}")
    companies = _unique_names(n_companies, lambda: f"{rng.choice(stems)} {rng.choice(COMPANY_SUFFIXES)}")
    universities = [rng.choice(UNIVERSITY_FORMS).format(words.new()) for _ in range(n_universities)]

    kinds = {**{c["name"]: "country" for c in countries}, **dict.fromkeys(people, "person"),
             **dict.fromkeys(companies, "company"), **dict.fromkeys(universities, "university")}
    by_split: dict[tuple[str, str], list[str]] = {}  # (kind, split) -> names
    for name, kind in kinds.items():
        by_split.setdefault((kind, split_of(name)), []).append(name)
    for kind in ("country", "person", "company", "university"):
        for split in ("train", "heldout"):
            if not by_split.get((kind, split)):
                raise ValueError(f"seed {seed} put no {kind} in the {split} split; "
                                 f"use more {kind} entities or another seed")
    facts, value_aliases, founded = _relate(rng, countries, by_split)

    aliases = {c["name"]: tuple(c["aliases"]) for c in countries}
    entities = {name: Entity(name, kind, split_of(name), f"d{i:06d}", facts[name], aliases.get(name, ()),
                             value_aliases[name]) for i, (name, kind) in enumerate(kinds.items())}
    country_info = {c["name"]: c for c in countries}
    by_surname: dict[str, list[str]] = {}
    for person in people:
        by_surname.setdefault(person.split()[1], []).append(person)
    texts = [_describe(rng, e, country_info.get(e.name), founded.get(e.name, [])) for e in entities.values()]
    texts += [_event(rng, words, by_split, by_surname) for _ in range(n_events)]
    docs = tuple({"id": f"d{i:06d}", "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(texts))
    return World(seed, entities, docs)


def _relate(rng: random.Random, countries: tuple[dict, ...], by_split: dict[tuple[str, str], list[str]]
            ) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, tuple[str, ...]]], dict[str, list[str]]]:
    """(facts, value aliases) by entity name, and the companies each founder founded. Objects are drawn from
    the subject's own split; nobody works for a company they founded or mentors themselves, so chains rarely
    loop back (questions skip those that do)."""
    def pick(kind: str, name: str, exclude: tuple[str, ...] = ()) -> str:
        while (other := rng.choice(by_split[kind, split_of(name)])) in exclude:
            pass
        return other

    def names(kind: str) -> list[str]:
        return by_split[kind, "train"] + by_split[kind, "heldout"]

    facts: dict[str, dict[str, str]] = {name: {} for group in by_split.values() for name in group}
    value_aliases: dict[str, dict[str, tuple[str, ...]]] = {name: {} for name in facts}
    for c in countries:
        f = facts[c["name"]]
        f["capital"], f["region"] = c["capital"], c["region"]
        if c["currency"]:
            f["currency"] = CURRENCIES[c["currency"]]
            value_aliases[c["name"]]["currency"] = (c["currency"],)
        if c["language"]:
            f["language"] = c["language"]
    founded: dict[str, list[str]] = {}
    for company in names("company"):
        year = rng.randint(1950, 2020)
        facts[company] |= {"headquartered_in": pick("country", company), "founded_by": pick("person", company),
                           "founded_in": f"{rng.choice(MONTHS)} {year}", "industry": rng.choice(INDUSTRIES)}
        value_aliases[company]["founded_in"] = (str(year),)
        founded.setdefault(facts[company]["founded_by"], []).append(company)
    for uni in names("university"):
        facts[uni] |= {"located_in": pick("country", uni), "founded_in": str(rng.randint(1700, 1995))}
    for person in names("person"):
        facts[person] |= {"occupation": rng.choice(OCCUPATIONS), "born_in": pick("country", person),
                          "studied_at": pick("university", person),
                          "works_for": pick("company", person, tuple(founded.get(person, ())))}
        if rng.random() < 0.7:
            facts[person]["mentor"] = pick("person", person, (person,))
    return facts, value_aliases, founded


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _describe(rng: random.Random, e: Entity, country: dict | None, founded: list[str]) -> tuple[str, str]:
    """(title, text) of an entity's document. The first sentence names the entity, so its name is in the
    document at least twice; the facts follow in a random order, each in one of a few phrasings."""
    f, n = e.facts, e.name
    if e.kind == "country":
        lead = f"{n} is a country in {country['subregion']}."
        sentences = [rng.choice([f"The capital of {n} is {f['capital']}.", f"{f['capital']} is the capital of {n}."]),
                     rng.choice([f"{n} is part of the region {f['region']}.", f"Its region is {f['region']}."])]
        if "currency" in f:
            sentences.append(rng.choice([f"The currency of {n} is the {f['currency']}.",
                                         f"{n} uses the {f['currency']}."]))
        if "language" in f:
            sentences.append(rng.choice([f"The main language of {n} is {f['language']}.",
                                         f"Most people in {n} speak {f['language']}."]))
        if e.aliases:
            sentences.append(f"{n} is also known as {e.aliases[0]}.")
        if country["population"]:
            sentences.append(f"It has a population of about {country['population']:,}.")
        if country["borders"]:
            *others, last = country["borders"]
            sentences.append(f"{n} borders {', '.join(others) + ' and ' if others else ''}{last}.")
    elif e.kind == "person":
        they = rng.choice(["She", "He"])
        lead = f"{n} is {_article(f['occupation'])}."
        sentences = [rng.choice([f"{n} was born in {f['born_in']}.", f"{they} was born in {f['born_in']}."]),
                     rng.choice([f"{n} studied at {f['studied_at']}.", f"{they} graduated from {f['studied_at']}."]),
                     rng.choice([f"{n} works for {f['works_for']}.", f"{they} is employed by {f['works_for']}."])]
        if "mentor" in f:
            sentences.append(rng.choice([f"{n} was mentored by {f['mentor']}.",
                                         f"{they} trained under {f['mentor']}."]))
        sentences += [f"{they} founded {c}." for c in founded]
    elif e.kind == "company":
        lead = f"{n} is {_article(f['industry'])} company."
        sentences = [rng.choice([f"{n} is headquartered in {f['headquartered_in']}.",
                                 f"The head office of {n} is in {f['headquartered_in']}."]),
                     rng.choice([f"{n} was founded by {f['founded_by']}.", f"{f['founded_by']} founded {n}."]),
                     rng.choice([f"It was founded in {f['founded_in']}.",
                                 f"{n} was established in {f['founded_in']}."])]
    else:
        lead = f"{n} is a university."
        sentences = [rng.choice([f"{n} is located in {f['located_in']}.", f"It is a university in {f['located_in']}."]),
                     rng.choice([f"It was founded in {f['founded_in']}.",
                                 f"{n} was established in {f['founded_in']}."])]
    rng.shuffle(sentences)
    return n, " ".join([lead, *sentences])


def _event(rng: random.Random, words: _Words, by_split: dict[tuple[str, str], list[str]],
           by_surname: dict[str, list[str]]) -> tuple[str, str]:
    """A report that names people, a company and a country of one split in passing and states none of their
    facts. Guests come with a near-namesake where one exists, to make the full name in the query matter."""
    split = rng.choice(["train", "train", "train", "train", "heldout"])
    people = by_split["person", split]
    guest = rng.choice(people)
    namesakes = [p for p in by_surname[guest.split()[1]] if p != guest and split_of(p) == split]
    guests = list(dict.fromkeys([guest, rng.choice(namesakes or people), rng.choice(people)]))
    title = f"{words.new()} {rng.choice(EVENT_KINDS)} {rng.randint(1990, 2023)}"
    text = (f"The {title} took place in {rng.choice(by_split['country', split])}. "
            f"Speakers included {', '.join(guests[:-1])} and {guests[-1]}. "
            f"The event was sponsored by {rng.choice(by_split['company', split])}.")
    return title, text
