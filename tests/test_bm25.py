"""The embedded BM25 index: scores worked out by hand, bm25s parity, save/load, and the edge cases.

Hand-checked scores use Lucene's BM25, bm25s's default "lucene" method (what pyserini computes):
    score = idf * tf / (tf + k1 * (1 - b + b * doc_len / avg_doc_len)),   idf = ln(1 + (N - df + 0.5) / (df + 0.5))
summed over query tokens, with k1 = 0.9, b = 0.4 (Search-R1's defaults). Doc lengths count tokens after
stopwords are dropped; the title line is part of the contents, so its words count too.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import bm25s
import numpy as np
import pytest
import Stemmer
from agentrl.envs.search import bm25 as bm25_module
from agentrl.envs.search.bm25 import BM25Index, SearchHit

DOCS = [
    {"id": "d0", "contents": '"Apple"\napple pie'},  # apple x2, pie: 3 tokens
    {"id": "d1", "contents": '"Banana"\nbanana pie with apple'},  # banana x2, pie, apple ("with" is a stopword): 4
    {"id": "d2", "contents": '"Cherry"\ncherry tart'},  # cherry x2, tart: 3
]
AVG_LEN = (3 + 4 + 3) / 3


def lucene_bm25(tf: int, doc_len: int, df: int, n_docs: int = 3, avg_len: float = AVG_LEN,
                k1: float = 0.9, b: float = 0.4) -> float:
    idf = math.log(1 + (n_docs - df + 0.5) / (df + 0.5))
    return idf * tf / (tf + k1 * (1 - b + b * doc_len / avg_len))


@pytest.fixture(scope="module")
def index() -> BM25Index:
    return BM25Index.build(DOCS)


def scores(hits: list[SearchHit]) -> dict[str, float]:
    return {hit.id: hit.score for hit in hits}


def test_scores_equal_bm25_worked_out_by_hand(index):
    hits = index.search(["apple", "pie tart"], k=3)
    assert [h.id for h in hits[0]] == ["d0", "d1", "d2"]
    assert scores(hits[0]) == pytest.approx({"d0": lucene_bm25(tf=2, doc_len=3, df=2),  # 0.3282
                                             "d1": lucene_bm25(tf=1, doc_len=4, df=2),  # 0.2383
                                             "d2": 0.0}, rel=1e-6)
    # pie: df 2 (d0, d1); tart: df 1 (d2), so the rarer word wins
    assert [h.id for h in hits[1]] == ["d2", "d0", "d1"]
    assert scores(hits[1]) == pytest.approx({"d0": lucene_bm25(tf=1, doc_len=3, df=2),
                                             "d1": lucene_bm25(tf=1, doc_len=4, df=2),
                                             "d2": lucene_bm25(tf=1, doc_len=3, df=1)}, rel=1e-6)


def test_hit_has_the_search_r1_retrieve_shape(index):
    hit = index.search(["cherry"], k=1)[0][0]
    assert hit.to_dict() == {"document": {"id": "d2", "contents": '"Cherry"\ncherry tart'}, "score": hit.score}


def test_equal_scores_keep_corpus_order_and_unmatched_docs_come_last():
    docs = [{"id": "x", "contents": "nothing here"}, {"id": "b", "contents": "same words"},
            {"id": "a", "contents": "same words"}, {"id": "y", "contents": "other things"}]
    hits = BM25Index.build(docs).search(["same"], k=4)[0]
    assert [h.id for h in hits] == ["b", "a", "x", "y"]
    assert hits[0].score == hits[1].score > 0 and hits[2].score == hits[3].score == 0.0


def test_stemming_matches_word_forms_and_stopwords_are_ignored():
    docs = [{"id": "0", "contents": '"Run"\nrun'}, {"id": "1", "contents": '"Walk"\nwalk'}]
    stemmed = BM25Index.build(docs)
    assert stemmed.search(["running"], k=1)[0][0].id == "0"
    assert stemmed.search(["running"], k=1)[0][0].score > 0
    assert BM25Index.build(docs, stemmer=None).search(["running"], k=1)[0][0].score == 0.0
    assert stemmed.search(["the running of a"], k=2) == stemmed.search(["running"], k=2)


def test_k_beyond_the_corpus_returns_every_document(index):
    assert [h.id for h in index.search(["apple"], k=10)[0]] == ["d0", "d1", "d2"]


@pytest.mark.parametrize("query", ["", "zzz qqq", "the and of", "!!!"])
def test_query_matching_nothing_gives_zero_score_hits_in_corpus_order(index, query):
    hits = index.search([query], k=2)[0]
    assert [(h.id, h.score) for h in hits] == [("d0", 0.0), ("d1", 0.0)]


def test_bad_arguments_say_what_to_do(index):
    with pytest.raises(TypeError, match=r"search\(\[query\]\)"):
        index.search("apple")
    with pytest.raises(ValueError, match="k must be at least 1"):
        index.search(["apple"], k=0)
    with pytest.raises(ValueError, match="empty corpus"):
        BM25Index.build([])
    with pytest.raises(ValueError, match="unique"):
        BM25Index.build([{"id": "1", "contents": "a"}, {"id": "1", "contents": "b"}])


def test_concurrent_searches_from_many_threads_agree(index):
    queries = ["apple", "pie tart", "banana", "nothing"] * 10  # 40: each call also splits across threads
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: index.search(queries, k=2), range(16)))
    assert all(r == index.search(queries, k=2) for r in results)


def test_document_by_id(index):
    assert len(index) == 3
    assert index.document("d1") == DOCS[1]
    with pytest.raises(KeyError, match="No document with id 'd9'"):
        index.document("d9")


def test_unicode_text_is_lowercased_matched_and_stored_intact(tmp_path):
    docs = [{"id": "zü", "contents": '"Zürich"\nZÜRICH liegt am Zürichsee'},
            {"id": "αθ", "contents": '"Αθήνα"\nΗ Αθήνα είναι πρωτεύουσα'},
            {"id": "東", "contents": '"東京"\n東京 日本 首都'}]
    BM25Index.build(docs).save(tmp_path / "index")
    index = BM25Index.load(tmp_path / "index")
    assert [index.search([q], k=1)[0][0].id for q in ("zürich", "ΑΘΉΝΑ", "東京")] == ["zü", "αθ", "東"]
    assert [index.document(d["id"]) for d in docs] == docs


def test_save_load_round_trip_is_memory_mapped_and_identical(index, tmp_path):
    queries = ["apple", "pie tart", "banana apple", ""]
    index.save(tmp_path / "index")
    loaded = BM25Index.load(tmp_path / "index")
    assert loaded.search(queries, k=3) == index.search(queries, k=3)
    assert isinstance(loaded._contents.blob.base, np.memmap)
    assert BM25Index.load(tmp_path / "index", mmap=False).search(queries, k=3) == index.search(queries, k=3)
    assert json.loads((tmp_path / "index" / "params.json").read_text()) == {
        "format_version": bm25_module.FORMAT_VERSION, "k1": 0.9, "b": 0.4, "stemmer": "english",
        "n_docs": 3, "n_vocab": 5}  # appl, pie, banana, cherri, tart


def test_loading_an_index_compiles_its_query_kernel(index, tmp_path):
    """In a fresh process, as a Ray env worker is: the kernel is compiled (or loaded from numba's cache) when the index
    opens, not in the first search, whose tool timeout the compile outlasted on a loaded machine."""
    index.save(tmp_path / "index")
    probe = (f"from agentrl.envs.search import bm25; bm25.BM25Index.load({str(tmp_path / 'index')!r}); "
             "print(len(bm25._top_k_kernel.signatures))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) >= 1


def test_save_replaces_an_old_index_and_a_failed_save_leaves_no_partial_one(index, tmp_path, monkeypatch):
    BM25Index.build(DOCS[:2]).save(tmp_path / "index")
    index.save(tmp_path / "index")
    assert len(BM25Index.load(tmp_path / "index")) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["index"]

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(bm25_module.np, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        index.save(tmp_path / "new")
    with pytest.raises(OSError, match="No space"):
        index.save(tmp_path / "index")
    assert [p.name for p in tmp_path.iterdir()] == ["index"]  # no temp dir, no half-written "new"
    assert len(BM25Index.load(tmp_path / "index")) == 3


def test_missing_damaged_or_old_index_errors_say_to_rebuild(index, tmp_path):
    with pytest.raises(FileNotFoundError, match="No BM25 index at .*Rebuild it with BM25Index.build"):
        BM25Index.load(tmp_path / "nowhere")
    index.save(tmp_path / "index")
    params = tmp_path / "index" / "params.json"
    params.write_text(json.dumps({**json.loads(params.read_text()), "format_version": 0}))
    with pytest.raises(ValueError, match="format 0; this code reads format 1.*Rebuild"):
        BM25Index.load(tmp_path / "index")
    params.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable BM25 index.*Rebuild"):
        BM25Index.load(tmp_path / "index")
    index.save(tmp_path / "index")
    (tmp_path / "index" / "scores.data.npy").unlink()
    with pytest.raises(ValueError, match="damaged BM25 index.*Rebuild"):
        BM25Index.load(tmp_path / "index")


def test_results_equal_bm25s_on_a_random_corpus():
    rng = random.Random(0)
    words = ["the", "of", "and", "river", "rivers", "mountain", "city", "cities", "running", "runs", "king",
             "queen", "war", "peace", "music", "played", "playing", "Paris", "café", "x", "history", "river's",
             "island", "islands", "bridge", "station", "stations", "painter", "painting", "garden", "forest",
             "winter", "summer", "harbor", "harbour", "museum", "museums", "battle", "battles", "poet", "poetry"]
    zipf = [1 / rank for rank in range(1, len(words) + 1)]  # common and rare words: df from ~all docs to a few
    docs = [{"id": f"doc{i}", "contents": f'"{rng.choice(words).title()}"\n'
             + " ".join(rng.choices(words, zipf, k=rng.randint(3, 30)))} for i in range(300)]
    # every word alone (the kernel scores rare ones sparsely, common ones densely), then mixed queries:
    # 80 in all, a batch big enough to be split across threads
    queries = words + [" ".join(rng.choices(words, k=rng.randint(2, 6))) for _ in range(80 - len(words))]
    k = 30  # more than the rarest words match: the sparse path pads with unmatched docs
    hits = BM25Index.build(docs).search(queries, k=k)

    stemmer = Stemmer.Stemmer("english")
    retriever = bm25s.BM25(k1=0.9, b=0.4, method="lucene")
    retriever.index(bm25s.tokenize([d["contents"] for d in docs], stemmer=stemmer, show_progress=False),
                    show_progress=False)
    query_tokens = bm25s.tokenize(queries, stemmer=stemmer, return_ids=False, show_progress=False)
    _, bm25s_top = retriever.retrieve(query_tokens, k=k, show_progress=False)
    matched = []
    for tokens, our_hits, their_top in zip(query_tokens, hits, bm25s_top):
        all_scores = retriever.get_scores(tokens) if tokens else np.zeros(len(docs), dtype=np.float32)
        matched.append(np.count_nonzero(all_scores))
        expected = np.argsort(-all_scores, kind="stable")[:k]  # bm25s's scores, our tie order
        assert [h.id for h in our_hits] == [docs[i]["id"] for i in expected]
        assert [h.score for h in our_hits] == all_scores[expected].tolist()  # same float32 sums, bit for bit
        np.testing.assert_allclose([h.score for h in our_hits], their_top, rtol=1e-6)
    single_word = np.array(matched[:len(words)])
    assert (single_word < len(docs) / 4).sum() >= 5 and (single_word >= len(docs) / 4).sum() >= 5
