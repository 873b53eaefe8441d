"""Multi-hop questions over a `World`, in a train suite and held-out suites that each shift one thing.

A question follows a relation path from a head entity named in the question, e.g.
("founded_by", "born_in", "capital"): "What is the capital of the country where the founder of Quorbex Systems
was born?". Each hop is one search: the query is an entity name (from the question, then from the document
just read), the document is that entity's, and the value read there is the next query or, at the end, the
answer. Every held-out suite is about held-out entities, so no fact seen in training helps; against
`unseen_entities` as the baseline, the others add one more shift each:

- `unseen_compositions`: 2-hop relation paths never asked in train (each of their relations is);
- `more_hops`: 3 and 4 hops;
- `paraphrase`: train paths, worded only with templates train never uses.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from functools import lru_cache

from agentrl.envs.search.world import (
    ENTITY_RELATIONS,
    SCHEMA,
    Entity,
    World,
    fold_accents,
)

from agentrl.types import Task

ALL_SUITES = ("train", "unseen_entities", "unseen_compositions", "more_hops", "paraphrase")
SUITES = ALL_SUITES[1:]  # the held-out ones

# relation -> (train wordings, paraphrase-only wordings) of the final question; {s} is the subject, a name or a
# nested description, so wordings keep it last or before a short verb.
ASK: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "born_in": (("Where was {s} born?", "In which country was {s} born?"), ("What is the native country of {s}?",)),
    "works_for": (("Which company does {s} work for?", "Who employs {s}?"), ("Which firm employs {s}?",)),
    "studied_at": (("Where did {s} study?", "Which university did {s} attend?"),
                   ("From which school did {s} graduate?",)),
    "mentor": (("Who mentored {s}?", "Who was the mentor of {s}?"), ("Under whom did {s} train?",)),
    "occupation": (("What is the occupation of {s}?", "What does {s} do for a living?"),
                   ("What is the profession of {s}?",)),
    "headquartered_in": (("Where is {s} headquartered?", "In which country is {s} based?"),
                         ("Which country hosts the head office of {s}?",)),
    "founded_by": (("Who founded {s}?", "Who is the founder of {s}?"), ("Who started {s}?",)),
    "founded_in": (("When was {s} founded?", "When was {s} established?"), ("What is the founding date of {s}?",)),
    "industry": (("What is the industry of {s}?", "In which industry does {s} operate?"),
                 ("What line of business is {s} in?",)),
    "located_in": (("Where is {s} located?", "In which country is {s}?"), ("Which country is home to {s}?",)),
    "capital": (("What is the capital of {s}?", "Which city is the capital of {s}?"),
                ("Name the capital city of {s}.",)),
    "region": (("In which region is {s}?", "What is the region of {s}?"), ("To which world region does {s} belong?",)),
    "currency": (("What is the currency of {s}?", "Which currency is used in {s}?"),
                 ("What money do people pay with in {s}?",)),
    "language": (("What is the main language of {s}?", "Which language is most widely spoken in {s}?"),
                 ("What tongue do most people use in {s}?",)),
}
# entity relation -> (train wordings, paraphrase-only wordings) of a noun phrase naming the object.
DESCRIBE: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "born_in": (("the country where {s} was born", "the birth country of {s}"), ("the homeland of {s}",)),
    "works_for": (("the employer of {s}", "the company that employs {s}"), ("the firm where {s} has a job",)),
    "studied_at": (("the university where {s} studied", "the alma mater of {s}"),
                   ("the school from which {s} graduated",)),
    "mentor": (("the mentor of {s}", "the person who mentored {s}"), ("the teacher who trained {s}",)),
    "headquartered_in": (("the country where {s} is headquartered", "the home country of {s}"),
                         ("the country hosting the head office of {s}",)),
    "founded_by": (("the founder of {s}", "the person who founded {s}"), ("the entrepreneur who started {s}",)),
    "located_in": (("the country where {s} is located", "the host country of {s}"),
                   ("the nation that is home to {s}",)),
}
TEMPLATES = {"ask": ASK, "describe": DESCRIBE}

Path = tuple[str, ...]  # relation names, head first


def _paths(hops: int) -> list[Path]:
    """Every relation path of `hops` relations that the schema allows, in a stable order; no relation twice
    in a row ("the mentor of the mentor of ..." reads badly and adds nothing a different relation would not)."""
    steps = list(SCHEMA)  # (subject kind, relation)
    paths = [[step] for step in steps]
    for _ in range(hops - 1):
        paths = [p + [s] for p in paths for s in steps if SCHEMA[p[-1]] == s[0] and s != p[-1]]
    return list(dict.fromkeys(tuple(rel for _, rel in p) for p in paths))


# 2-hop paths kept out of train; each relation in them is still asked in train, alone and composed.
UNSEEN_COMPOSITIONS: tuple[Path, ...] = (
    ("born_in", "currency"), ("headquartered_in", "language"), ("located_in", "region"), ("mentor", "occupation"),
    ("studied_at", "founded_in"), ("mentor", "works_for"), ("founded_by", "born_in"), ("founded_by", "studied_at"),
)
TRAIN_PATHS: tuple[Path, ...] = tuple(_paths(1) + [p for p in _paths(2) if p not in UNSEEN_COMPOSITIONS])


@dataclass(frozen=True)
class Suite:
    entities: str  # the entity split its questions are about: train | heldout
    paths: tuple[Path, ...]
    wording: str  # which templates phrase its questions: train | paraphrase


SUITE_SPECS = {
    "train": Suite("train", TRAIN_PATHS, "train"),
    "unseen_entities": Suite("heldout", TRAIN_PATHS, "train"),
    "unseen_compositions": Suite("heldout", UNSEEN_COMPOSITIONS, "train"),
    "more_hops": Suite("heldout", tuple(_paths(3) + _paths(4)), "train"),
    "paraphrase": Suite("heldout", TRAIN_PATHS, "paraphrase"),
}


def _follow(world: World, head: Entity, path: Path) -> list[tuple[Entity, str]] | None:
    """[(entity read, value read there)] along `path`, or None where a fact is missing or the chain would
    revisit an entity (the answer would be named in the question)."""
    chain, entity, seen = [], head, {head.name}
    for i, rel in enumerate(path):
        value = entity.facts.get(rel)
        if value is None:
            return None
        chain.append((entity, value))
        if rel in ENTITY_RELATIONS:
            if value in seen:
                return None
            seen.add(value)
            if i < len(path) - 1:
                entity = world.entities[value]
    return chain


@lru_cache(maxsize=32)
def _pools(world: World, suite: str) -> tuple[tuple[Path, tuple[str, ...]], ...]:
    """(path, head names it can start from), for every path of the suite: the distinct questions it can ask."""
    spec = SUITE_SPECS[suite]
    heads = [e for e in world.entities.values() if e.split == spec.entities]
    return tuple((path, tuple(h.name for h in heads if _follow(world, h, path) is not None)) for path in spec.paths)


def count_questions(world: World, suite: str) -> int:
    """How many distinct questions (head entity, relation path) `suite` can make over `world`."""
    _check_suite(suite)
    return sum(len(heads) for _, heads in _pools(world, suite))


def _check_suite(suite: str) -> None:
    if suite not in SUITE_SPECS:
        raise ValueError(f"Unknown suite {suite!r}; choose one of {ALL_SUITES}")


def make_questions(world: World, suite: str, n: int, seed: int = 0) -> list[Task]:
    """`n` distinct questions of `suite`, balanced over hop counts and, within a hop count, over relation
    paths. The first n are the same for any larger n (same world and seed)."""
    _check_suite(suite)
    available = count_questions(world, suite)
    if n > available:
        raise ValueError(f"Suite {suite!r} can make only {available} distinct questions over this world; "
                         f"ask for at most {available}, or build a bigger world.")
    rng = random.Random(f"{seed}/{suite}")
    queues: dict[int, dict[Path, list[str]]] = {}  # hops -> path -> heads still to ask, in a seeded order
    for path, heads in _pools(world, suite):
        if heads:
            queues.setdefault(len(path), {})[path] = rng.sample(heads, len(heads))
    tasks = []
    while len(tasks) < n:
        by_path = queues[rng.choice(sorted(queues))]
        path = rng.choice(list(by_path))
        head = by_path[path].pop()
        if not by_path[path]:
            del by_path[path]
            if not by_path:
                del queues[len(path)]
        tasks.append(_question(world, suite, world.entities[head], path, rng))
    return tasks


def _question(world: World, suite: str, head: Entity, path: Path, rng: random.Random) -> Task:
    wording = SUITE_SPECS[suite].wording
    subject, templates = head.name, []
    for i, rel in enumerate(path):  # innermost first: the head's relation is the deepest noun phrase
        part = "ask" if i == len(path) - 1 else "describe"
        train_forms, paraphrase_forms = TEMPLATES[part][rel]
        first, count = (0, len(train_forms)) if wording == "train" else (len(train_forms), len(paraphrase_forms))
        j = first + rng.randrange(count)  # an index into train_forms + paraphrase_forms
        subject = (train_forms + paraphrase_forms)[j].format(s=subject)
        templates.append(f"{part}/{rel}/{j}")
    question = subject  # an ask wording, so a capitalized sentence
    chain = _follow(world, head, path)
    gold = chain[-1][1]
    return Task(id=f"search-{suite}-{hashlib.sha1(question.encode()).hexdigest()[:10]}", split=suite, data={
        "question": question,
        "answers": _answers(world, chain[-1][0], path[-1], gold),
        "supporting_docs": [e.doc_id for e, _ in chain],
        "hops": len(path),
        "relations": list(path),
        "chain": [{"query": e.name, "doc_id": e.doc_id, "answer": value} for e, value in chain],
        "suite": suite,
        "templates": templates,  # one per hop, "describe/<relation>/<i>" ... "ask/<relation>/<i>"
    })


def _answers(world: World, subject: Entity, relation: str, gold: str) -> list[str]:
    """[gold, *aliases]: the other names of an entity answer, other forms of a literal (a currency's code,
    a founding date's year), and accent-free spellings."""
    if relation in ENTITY_RELATIONS:
        others = world.entities[gold].aliases
    else:
        others = subject.value_aliases.get(relation, ())
    names = [gold, *others]
    return [a for a in dict.fromkeys(itertools.chain(names, map(fold_accents, names))) if a.strip()]
