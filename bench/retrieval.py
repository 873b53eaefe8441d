"""Queries/s and latency of the embedded BM25 index (agentrl.envs.search.bm25) against rank-bm25's
BM25Okapi and plain bm25s, all on one generated corpus and measured in this run.

    python bench/retrieval.py [--quick]

The corpus is seeded: pseudo-words with Zipf (1/rank) frequencies, documents of 50-150 words with a
Search-R1 title line, and queries of 2-8 words taken from random documents, so every query has matches.
Target (issue #5): on 100k documents, >= 100x rank-bm25's queries/s and a batch-mode p50 under 2 ms
per query. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import bm25s
import numpy as np
import Stemmer
from agentrl.envs.search.bm25 import BM25Index, Tokenizer
from rank_bm25 import BM25Okapi
from results import record  # bench/results.py: the last line, kept in bench/results/

K = 3  # passages per query, as in Search-R1
BATCH = 64  # queries per search call in batch mode
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def pseudo_words(rng: np.random.Generator, n: int) -> np.ndarray:
    words: dict[str, None] = {}  # insertion-ordered set, so the result depends only on the seed
    while len(words) < n:
        words.setdefault("".join(rng.choice(SYLLABLES, size=rng.integers(2, 5))))
    return np.array(list(words))


def make_corpus(n_docs: int, n_queries: int, n_words: int = 50_000, seed: int = 0) -> tuple[list[dict], list[str]]:
    rng = np.random.default_rng(seed)
    words = pseudo_words(rng, n_words)
    zipf = 1.0 / np.arange(1, n_words + 1)
    body_lens, title_lens = rng.integers(50, 151, n_docs), rng.integers(1, 4, n_docs)
    draws = words[rng.choice(n_words, size=int(body_lens.sum() + title_lens.sum()), p=zipf / zipf.sum())]
    docs, bodies, start = [], [], 0
    for i, (n_title, n_body) in enumerate(zip(title_lens, body_lens)):
        title, body = draws[start:start + n_title], draws[start + n_title:start + n_title + n_body]
        start += n_title + n_body
        docs.append({"id": str(i), "contents": f'"{" ".join(title).title()}"\n{" ".join(body)}'})
        bodies.append(body)
    queries = []
    for d in rng.integers(0, n_docs, n_queries):
        body = bodies[d]
        queries.append(" ".join(body[rng.choice(len(body), size=rng.integers(2, 9), replace=False)]))
    return docs, queries


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def ours(docs: list[dict], queries: list[str], index_dir: Path) -> dict:
    built, build_s = timed(lambda: BM25Index.build(docs))
    built.save(index_dir)
    index = BM25Index.load(index_dir)  # memory-mapped, as an env would open it
    index.search(queries[:BATCH], k=K)  # warm-up: loads the compiled kernel, touches the pages
    batches = [queries[i:i + BATCH] for i in range(0, len(queries), BATCH)]
    batch_s = np.array([timed(lambda b=batch: index.search(b, k=K))[1] for batch in batches])
    per_query_s = batch_s / [len(batch) for batch in batches]
    single_s = [timed(lambda q=q: index.search([q], k=K))[1] for q in queries[:200]]
    return {"build_s": build_s, "index_mb": sum(f.stat().st_size for f in index_dir.iterdir()) / 2**20,
            "qps": len(queries) / batch_s.sum(),
            "p50_ms": 1e3 * float(np.percentile(per_query_s, 50)), "p99_ms": 1e3 * float(np.percentile(per_query_s, 99)),
            "single_p50_ms": 1e3 * float(np.median(single_s))}


def rank_bm25_qps(docs: list[dict], queries: list[str]) -> tuple[float, float]:
    tokenize = Tokenizer("english")  # the same tokens as ours
    okapi, build_s = timed(lambda: BM25Okapi([tokenize(d["contents"]) for d in docs]))
    query_tokens = [tokenize(q) for q in queries]
    _, seconds = timed(lambda: [np.argpartition(okapi.get_scores(q), -K)[-K:] for q in query_tokens])
    return len(queries) / seconds, build_s


def bm25s_default_qps(docs: list[dict], queries: list[str]) -> float:
    stemmer = Stemmer.Stemmer("english")
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([d["contents"] for d in docs], stemmer=stemmer, show_progress=False),
                    show_progress=False)

    def search_all() -> None:
        for i in range(0, len(queries), BATCH):
            tokens = bm25s.tokenize(queries[i:i + BATCH], stemmer=stemmer, show_progress=False)
            retriever.retrieve(tokens, k=K, show_progress=False)

    return len(queries) / timed(search_all)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20k documents, fewer queries (under a minute)")
    args = parser.parse_args()
    n_docs, n_queries, n_rank_bm25 = (20_000, 640, 20) if args.quick else (100_000, 2_048, 50)

    (docs, queries), corpus_s = timed(lambda: make_corpus(n_docs, n_queries))
    with tempfile.TemporaryDirectory() as tmp:
        our = ours(docs, queries, Path(tmp) / "index")
    rank_qps, rank_build_s = rank_bm25_qps(docs, queries[:n_rank_bm25])
    default_qps = bm25s_default_qps(docs, queries)

    print(f"{n_docs} docs generated in {corpus_s:.1f} s; {n_queries} queries, k={K}, batches of {BATCH}")
    print(f"{'retriever':<26}{'queries/s':>12}{'vs rank-bm25':>14}")
    for name, qps in (("agentrl BM25Index", our["qps"]), ("bm25s defaults", default_qps),
                      (f"rank-bm25 ({n_rank_bm25} queries)", rank_qps)):
        print(f"{name:<26}{qps:>12.1f}{qps / rank_qps:>13.1f}x")
    print(f"ours: batch p50 {our['p50_ms']:.3f} ms, p99 {our['p99_ms']:.3f} ms per query; "
          f"single-query p50 {our['single_p50_ms']:.3f} ms; build {our['build_s']:.1f} s "
          f"(rank-bm25 {rank_build_s:.1f} s); index {our['index_mb']:.1f} MB on disk")
    record(__file__, {
        "ratio_vs_rank_bm25": round(our["qps"] / rank_qps, 1), "goal": ">= 100 and p50 < 2 ms",
        "p50_ms": round(our["p50_ms"], 3), "p99_ms": round(our["p99_ms"], 3),
        "single_query_p50_ms": round(our["single_p50_ms"], 3), "qps": round(our["qps"], 1),
        "rank_bm25_qps": round(rank_qps, 2), "bm25s_default_ratio": round(default_qps / rank_qps, 1),
        "build_s": round(our["build_s"], 2), "index_mb": round(our["index_mb"], 1), "n_docs": n_docs,
    })


if __name__ == "__main__":
    main()
