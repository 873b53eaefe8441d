"""The search world: a deterministic corpus, and multi-hop questions whose every hop BM25 can find."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from agentrl.envs.search.questions import (
    ALL_SUITES,
    SUITES,
    TRAIN_PATHS,
    UNSEEN_COMPOSITIONS,
    count_questions,
    make_questions,
)
from agentrl.envs.search.world import build_world
from rank_bm25 import BM25Okapi


def tokenize(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


@pytest.fixture(scope="module")
def world():
    return build_world(seed=0)


@pytest.fixture(scope="module")
def questions(world):
    return {suite: make_questions(world, suite, 300) for suite in ALL_SUITES}


def test_suite_constants():
    assert ALL_SUITES[0] == "train" and set(SUITES) == set(ALL_SUITES) - {"train"}


def test_same_seed_gives_identical_corpus_and_questions(world, questions):
    again = build_world(seed=0)
    assert again.documents() == world.documents()
    for suite in ALL_SUITES:
        assert make_questions(again, suite, 300) == questions[suite]


def test_different_seeds_give_different_worlds_and_questions(world, questions):
    other = build_world(seed=1)
    assert other.documents() != world.documents()
    assert [q.data["question"] for q in make_questions(other, "train", 50)] != \
        [q.data["question"] for q in questions["train"][:50]]
    assert make_questions(world, "train", 50, seed=1) != questions["train"][:50]


def test_fewer_questions_are_a_prefix_of_more(world, questions):
    assert make_questions(world, "more_hops", 40) == questions["more_hops"][:40]


def test_documents_have_search_r1_shape_and_unique_ids(world):
    docs = world.documents()
    assert 2000 <= len(docs) <= 5000
    assert len({d["id"] for d in docs}) == len(docs)
    titles = []
    for d in docs:
        assert set(d) == {"id", "contents"} and re.fullmatch(r"d\d{6}", d["id"])
        match = re.fullmatch(r'"([^"\n]+)"\n([^\n]+)', d["contents"])
        assert match, d["contents"]
        titles.append(match[1])
    assert len(set(titles)) == len(titles)
    for e in world.entities.values():
        assert docs[int(e.doc_id[1:])]["contents"].startswith(f'"{e.name}"\n')


def test_train_documents_are_those_that_name_no_held_out_entity(world):
    heldout = [e.name for e in world.entities.values() if e.split == "heldout"]
    names_heldout = lambda d: any(re.search(rf"\b{re.escape(n)}\b", d["contents"]) for n in heldout)  # noqa: E731
    train = world.train_documents()
    assert train == [d for d in world.documents() if not names_heldout(d)]
    assert 0.5 * len(world.documents()) < len(train) < len(world.documents())


def test_every_hop_reads_its_query_and_answer_off_its_document(world, questions):
    text = {d["id"]: d["contents"] for d in world.documents()}
    for suite, tasks in questions.items():
        for task in tasks:
            data, chain = task.data, task.data["chain"]
            assert task.split == data["suite"] == suite
            assert data["hops"] == len(chain) == len(data["relations"]) == len(data["templates"])
            assert chain[0]["query"] in data["question"]
            for hop, next_hop in itertools.pairwise(chain):
                assert next_hop["query"] == hop["answer"]
            for hop in chain:
                assert hop["query"] in text[hop["doc_id"]] and hop["answer"] in text[hop["doc_id"]]
            assert data["answers"][0] == chain[-1]["answer"]
            assert len(set(data["answers"])) == len(data["answers"])
            assert data["supporting_docs"] == [hop["doc_id"] for hop in chain]


def test_ids_and_questions_are_unique_within_a_suite(questions):
    for tasks in questions.values():
        assert len({t.id for t in tasks}) == len(tasks)
        assert len({t.data["question"] for t in tasks}) == len(tasks)


def test_train_and_held_out_suites_share_no_entity(world, questions):
    def entities(tasks):
        return {name for t in tasks for hop in t.data["chain"] for name in (hop["query"], hop["answer"])
                if name in world.entities}

    train = entities(questions["train"])
    assert train and all(world.entities[name].split == "train" for name in train)
    for suite in SUITES:
        held_out = entities(questions[suite])
        assert held_out and not held_out & train


def test_held_out_suites_shift_what_they_promise(questions):
    def paths(suite):
        return {tuple(t.data["relations"]) for t in questions[suite]}

    def templates(suite):
        return {name for t in questions[suite] for name in t.data["templates"]}

    assert {t.data["hops"] for t in questions["train"]} == {1, 2}
    assert paths("train") <= set(TRAIN_PATHS) and paths("unseen_entities") <= set(TRAIN_PATHS)
    assert not set(UNSEEN_COMPOSITIONS) & set(TRAIN_PATHS)
    assert paths("unseen_compositions") == set(UNSEEN_COMPOSITIONS)
    for first, second in UNSEEN_COMPOSITIONS:  # each relation is composed in train, in the same position
        assert any(p[0] == first for p in TRAIN_PATHS if len(p) == 2)
        assert any(p[1] == second for p in TRAIN_PATHS if len(p) == 2)
    assert {t.data["hops"] for t in questions["more_hops"]} == {3, 4}
    assert paths("paraphrase") <= set(TRAIN_PATHS)
    assert templates("paraphrase") and not templates("paraphrase") & templates("train")
    for suite in ("unseen_entities", "unseen_compositions", "more_hops"):
        assert not templates(suite) & templates("paraphrase")


def test_answers_carry_aliases(world):
    tasks = make_questions(world, "train", 2000)
    by_relation = {}
    for t in tasks:
        by_relation.setdefault(t.data["relations"][-1], []).append(t.data["answers"])
    assert any(a[1:] == ["EUR"] for a in by_relation["currency"] if a[0] == "euro")
    assert all(len(a) == 2 and a[0].endswith(" " + a[1]) for a in by_relation["founded_in"] if not a[0].isdigit())
    assert any("Republic" in alias for a in by_relation["born_in"] for alias in a[1:])


def test_asking_for_more_questions_than_exist_says_how_many(world):
    n = count_questions(world, "unseen_compositions")
    everything = make_questions(world, "unseen_compositions", n)
    assert len({t.data["question"] for t in everything}) == n
    with pytest.raises(ValueError, match=rf"only {n} distinct questions"):
        make_questions(world, "unseen_compositions", n + 1)
    with pytest.raises(ValueError, match="Unknown suite"):
        make_questions(world, "test", 1)


def test_bm25_ranks_each_hops_document_in_the_top_3(world, questions):
    """What makes the tasks solvable by search: querying the entity name finds the entity's document."""
    docs = world.documents()
    bm25 = BM25Okapi([tokenize(d["contents"]) for d in docs])
    index = {d["id"]: i for i, d in enumerate(docs)}
    sample = [t for suite in ALL_SUITES for t in questions[suite][:40]]
    hops = [hop for t in sample for hop in t.data["chain"]]
    hits = [index[hop["doc_id"]] in np.argsort(-bm25.get_scores(tokenize(hop["query"])))[:3] for hop in hops]
    assert len(sample) == 200 and sum(hits) / len(hits) >= 0.95
