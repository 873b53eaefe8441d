"""An embedded BM25 retriever over a Search-R1/DPR corpus: bm25s builds the score matrix, a numba
kernel answers queries from it.

A document is `{"id": str, "contents": '"Title"\\ntext'}` (one line of Search-R1's wiki-18.jsonl).
Scoring is Lucene's BM25, as pyserini and bm25s's default "lucene" method compute it:

    score(q, d) = sum over query tokens t of  idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

bm25s stores that summand for every (token, document) pair as a CSC matrix (one column of postings per
token), so a query is a sum of a few columns. The kernel adds them in the same order and precision
(float32) as bm25s's numpy backend, so the scores are the same bits.

Index directory (FORMAT_VERSION 1), every array memory-mapped on load:
    params.json                     format version, build parameters, counts
    vocab.json                      token -> column of the score matrix
    scores.{data,indices,indptr}.npy  the CSC matrix: float32 weights, int32 doc rows, int64 column starts
    contents.npy, contents.offsets.npy  all contents as one UTF-8 blob, and n_docs + 1 offsets into it
    ids.npy, ids.offsets.npy        the ids, stored the same way
    ids.sorted.npy                  int32 rows ordered by id, for `document(id)` by binary search
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import re
from array import array
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain, pairwise
from pathlib import Path

import bm25s
import numba
import numpy as np
import Stemmer
from bm25s.stopwords import STOPWORDS_EN
from tqdm.auto import tqdm

from agentrl.system.files import write_folder

FORMAT_VERSION = 1
_WORD = re.compile(r"(?u)\b\w\w+\b")  # bm25s's token pattern: runs of 2+ unicode word characters
_STOPWORDS = frozenset(STOPWORDS_EN)
_MIN_QUERIES_PER_THREAD = 8  # below this, handing work to a thread costs more than it saves


@dataclass(frozen=True)
class SearchHit:
    id: str
    contents: str
    score: float

    def to_dict(self) -> dict:
        """The shape of one result of Search-R1's /retrieve endpoint."""
        return {"document": {"id": self.id, "contents": self.contents}, "score": self.score}


class Tokenizer:
    """Lowercase, split into unicode words, drop English stopwords, stem: bm25s.tokenize's rules."""

    def __init__(self, stemmer: str | None):
        self.stem = Stemmer.Stemmer(stemmer).stemWords if stemmer else list

    def __call__(self, text: str) -> list[str]:
        return self.stem([w for w in _WORD.findall(text.lower()) if w not in _STOPWORDS])


@dataclass(frozen=True)
class Strings:
    """Many strings as one UTF-8 blob plus offsets, so a loaded index holds no Python string per document."""

    blob: np.ndarray  # uint8 [total bytes]
    offsets: np.ndarray  # int64 [n + 1]

    @classmethod
    def from_list(cls, strings: list[str]) -> Strings:
        """The strings packed: their UTF-8 bytes back to back, and where each starts."""
        encoded = [s.encode() for s in strings]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets)

    def bytes_at(self, i: int) -> bytes:
        """String `i`, UTF-8 encoded."""
        return self.blob[self.offsets[i]:self.offsets[i + 1]].tobytes()

    def __getitem__(self, i: int) -> str:
        return self.bytes_at(i).decode()

    def save(self, directory: Path, name: str) -> None:
        """Into an index directory, as NAME.npy (the bytes) and NAME.offsets.npy."""
        np.save(directory / f"{name}.npy", self.blob)
        np.save(directory / f"{name}.offsets.npy", self.offsets)

    @classmethod
    def load(cls, directory: Path, name: str, mmap_mode: str | None) -> Strings:
        """What `save` wrote, memory-mapped with `mmap_mode` (None: read into memory)."""
        return cls(load_array(directory, f"{name}.npy", mmap_mode),
                   load_array(directory, f"{name}.offsets.npy", mmap_mode))


class Documents:
    """The stored corpus of an index: `_ids`, `_contents` (`Strings`) and `_ids_sorted` (rows ordered by id)."""

    params: dict
    _ids: Strings
    _contents: Strings
    _ids_sorted: np.ndarray

    def __len__(self) -> int:
        return self.params["n_docs"]

    def document(self, doc_id: str) -> dict:
        """The document with this id, as `{"id", "contents"}`."""
        key = doc_id.encode()
        # ids.sorted orders rows by id; UTF-8 byte order equals the str order it was sorted in
        i = bisect.bisect_left(range(len(self)), key, key=lambda j: self._ids.bytes_at(self._ids_sorted[j]))
        if i == len(self) or self._ids.bytes_at(self._ids_sorted[i]) != key:
            raise KeyError(f"No document with id {doc_id!r} in this index of {len(self)} documents.")
        return self._document(int(self._ids_sorted[i]))

    def _document(self, row: int) -> dict:
        return {"id": self._ids[row], "contents": self._contents[row]}


class BM25Index(Documents):
    """BM25 over a fixed corpus. Build it once (`build(...).save(dir)`), then `load(dir)` and `search`."""

    def __init__(self, params: dict, vocab: dict[str, int], data: np.ndarray, indices: np.ndarray,
                 indptr: np.ndarray, ids: Strings, contents: Strings, ids_sorted: np.ndarray):
        self.params = params  # FORMAT_VERSION, k1, b, stemmer, n_docs, n_vocab
        self._vocab = vocab
        self._data, self._indices, self._indptr = data, indices, indptr  # CSC: see the module docstring
        self._ids, self._contents, self._ids_sorted = ids, contents, ids_sorted
        self._tokenize = Tokenizer(params["stemmer"])

    @classmethod
    def build(cls, docs: Iterable[dict], k1: float = 0.9, b: float = 0.4, stemmer: str | None = "english",
              show_progress: bool = False) -> BM25Index:
        """Index `{"id", "contents"}` dicts. k1=0.9, b=0.4 are Search-R1's (and pyserini's) defaults."""
        stem = Tokenizer(stemmer).stem
        vocab: dict[str, int] = {}  # stemmed token -> column of the score matrix
        # Stemming every occurrence was half the build time; instead each distinct word is stemmed once.
        word_columns: dict[str, int] = {}  # lowercased word -> its token's column, or -1 for a stopword
        ids, contents, doc_token_ids = [], [], []
        for doc in tqdm(docs, desc="BM25 tokenize", disable=not show_progress):
            ids.append(str(doc["id"]))
            contents.append(doc["contents"])
            words = _WORD.findall(doc["contents"].lower())
            new = sorted(set(words).difference(word_columns))  # sorted: columns must not depend on hashing
            for word, token in zip(new, stem(new)):
                word_columns[word] = -1 if word in _STOPWORDS else vocab.setdefault(token, len(vocab))
            # array("i") keeps a document's tokens in 4 bytes each instead of a Python int each
            doc_token_ids.append(array("i", filter((-1).__ne__, map(word_columns.__getitem__, words))))
        if not ids:
            raise ValueError("Cannot build a BM25 index over an empty corpus.")
        ids_sorted = np.array(sorted(range(len(ids)), key=ids.__getitem__), dtype=np.int32)
        duplicates = [ids[r] for r, s in pairwise(ids_sorted) if ids[r] == ids[s]]
        if duplicates:
            raise ValueError(f"Document ids must be unique; repeated: {duplicates[:5]}")

        scores = bm25s.BM25(k1=k1, b=b, method="lucene").build_index_from_ids(
            list(range(len(vocab))), doc_token_ids, show_progress=show_progress)
        params = {"format_version": FORMAT_VERSION, "k1": k1, "b": b, "stemmer": stemmer,
                  "n_docs": len(ids), "n_vocab": len(vocab)}
        return cls(params, vocab, scores["data"].astype(np.float32), scores["indices"].astype(np.int32),
                   scores["indptr"].astype(np.int64), Strings.from_list(ids), Strings.from_list(contents),
                   ids_sorted)

    def save(self, path: str | Path) -> None:
        """Write the index directory at `path`, replacing any old one; a crash leaves the old one or none."""
        def write(tmp: Path) -> None:
            (tmp / "params.json").write_text(json.dumps(self.params, indent=1))
            (tmp / "vocab.json").write_text(json.dumps(self._vocab, ensure_ascii=False), encoding="utf-8")
            for name, arr in (("data", self._data), ("indices", self._indices), ("indptr", self._indptr)):
                np.save(tmp / f"scores.{name}.npy", arr)
            self._ids.save(tmp, "ids")
            self._contents.save(tmp, "contents")
            np.save(tmp / "ids.sorted.npy", self._ids_sorted)

        write_folder(path, write)

    @classmethod
    def load(cls, path: str | Path, mmap: bool = True) -> BM25Index:
        """Open an index written by `save`; with mmap, arrays stay on disk and pages load on use."""
        path = Path(path)
        rebuild = f"Rebuild it with BM25Index.build(docs).save({str(path)!r})."
        if not path.is_dir():
            raise FileNotFoundError(f"No BM25 index at {path}. {rebuild}")
        try:
            params = json.loads((path / "params.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable BM25 index ({e}). {rebuild}") from e
        if params.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path} holds BM25 index format {params.get('format_version')!r}; this code "
                             f"reads format {FORMAT_VERSION}. {rebuild}")
        mmap_mode = "r" if mmap else None
        try:
            vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
            index = cls(params, vocab, *(load_array(path, f"scores.{n}.npy", mmap_mode)
                                         for n in ("data", "indices", "indptr")),
                        Strings.load(path, "ids", mmap_mode), Strings.load(path, "contents", mmap_mode),
                        load_array(path, "ids.sorted.npy", mmap_mode))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} is a damaged BM25 index ({e}). {rebuild}") from e
        index._check_shapes(path, rebuild)
        # The query kernel compiles (or loads from numba's cache) at its first call: seconds, and with no cache (a
        # fresh checkout) on a loaded machine more than a search tool's 10 s, which then failed every episode of a
        # Ray env worker's first batch. Here it is paid when the index opens, under the env's reset budget.
        index._top_k([[]], 1)
        return index

    def _check_shapes(self, path: Path, rebuild: str) -> None:
        n_docs, n_vocab = self.params["n_docs"], self.params["n_vocab"]
        expected = {"ids.offsets": (self._ids.offsets, n_docs + 1),
                    "contents.offsets": (self._contents.offsets, n_docs + 1),
                    "ids.sorted": (self._ids_sorted, n_docs), "scores.indptr": (self._indptr, n_vocab + 1),
                    "scores.indices": (self._indices, len(self._data)), "vocab": (self._vocab, n_vocab)}
        for name, (arr, length) in expected.items():
            if len(arr) != length:
                raise ValueError(f"{path} is a damaged BM25 index ({name} has {len(arr)} entries, "
                                 f"expected {length}). {rebuild}")

    def search(self, queries: Sequence[str], k: int = 3) -> list[list[SearchHit]]:
        """The top min(k, len(self)) documents for each query, best first. Equal scores go in corpus order,
        so documents matching no query token come last, with score 0."""
        if isinstance(queries, str):
            raise TypeError("search takes a batch of queries: search([query]), not search(query).")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}.")
        k = min(k, len(self))
        rows_QK, scores_QK = self._top_k([self._query_token_ids(q) for q in queries], k)
        return [[SearchHit(**self._document(row), score=score) for row, score in zip(rows, scores)]
                for rows, scores in zip(rows_QK.tolist(), scores_QK.tolist())]

    def _query_token_ids(self, query: str) -> list[int]:
        return [self._vocab[t] for t in self._tokenize(query) if t in self._vocab]

    def _top_k(self, token_ids: list[list[int]], k: int) -> tuple[np.ndarray, np.ndarray]:
        query_ptr = np.zeros(len(token_ids) + 1, dtype=np.int64)
        np.cumsum([len(ids) for ids in token_ids], out=query_ptr[1:])
        flat_ids = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=query_ptr[-1])
        rows_QK = np.empty((len(token_ids), k), dtype=np.int64)
        scores_QK = np.empty((len(token_ids), k), dtype=np.float32)
        n_threads = min(_cpu_count(), len(token_ids) // _MIN_QUERIES_PER_THREAD) or 1

        def run(first: int) -> None:  # queries first, first + n_threads, ...: interleaved to even out the load
            _top_k_kernel(self._data, self._indices, self._indptr, len(self), query_ptr, flat_ids,
                          first, n_threads, k, rows_QK, scores_QK)

        if n_threads == 1:
            run(0)
        else:  # the kernel releases the GIL, so threads give real parallelism
            list(_thread_pool(os.getpid()).map(run, range(n_threads)))
        return rows_QK, scores_QK


@numba.njit(nogil=True, cache=True)
def _top_k_kernel(data, indices, indptr, n_docs, query_ptr, query_tokens, first, step, k, rows_QK, scores_QK):
    scores = np.zeros(n_docs, dtype=np.float32)  # all zero between queries
    touched = np.empty(n_docs, dtype=np.int64)  # docs with a nonzero score in the current query
    for q in range(first, len(query_ptr) - 1, step):
        tokens = query_tokens[query_ptr[q]:query_ptr[q + 1]]
        n_postings = 0
        for t in tokens:
            n_postings += indptr[t + 1] - indptr[t]
        # Once postings pass ~1/4 of the corpus (measured), adding them blindly and then scanning every
        # doc beats tracking which docs were touched; rare-word queries only visit their touched docs.
        dense = 4 * n_postings >= n_docs
        n_touched = 0
        for t in tokens:
            for j in range(indptr[t], indptr[t + 1]):
                d = indices[j]
                if not dense and scores[d] == 0.0:  # every weight is > 0 (idf > 0, tf >= 1): 0 = untouched
                    touched[n_touched] = d
                    n_touched += 1
                scores[d] += data[j]

        rows, best = rows_QK[q], scores_QK[q]
        n_best = 0
        if dense:
            for d in range(n_docs):
                n_best = _push(rows, best, n_best, d, scores[d])
            scores[:] = 0.0
        else:
            for d in touched[:n_touched]:
                n_best = _push(rows, best, n_best, d, scores[d])
            d = 0
            while n_best < k:  # fewer than k matches: pad with unmatched docs in corpus order
                if scores[d] == 0.0:
                    rows[n_best], best[n_best] = d, 0.0
                    n_best += 1
                d += 1
            scores[touched[:n_touched]] = 0.0


@numba.njit(nogil=True, cache=True)
def _push(rows, best, n_best, d, s):
    """Insert doc d with score s into the sorted top-k lists (best first, equal scores by doc order) if
    it belongs there; return how many entries are filled. Insertion is cheap for the small k agents use."""
    k = len(rows)
    if n_best == k and not (s > best[k - 1] or (s == best[k - 1] and d < rows[k - 1])):
        return n_best
    if n_best < k:
        n_best += 1
    slot = n_best - 1
    while slot > 0 and (s > best[slot - 1] or (s == best[slot - 1] and d < rows[slot - 1])):
        best[slot], rows[slot] = best[slot - 1], rows[slot - 1]
        slot -= 1
    best[slot], rows[slot] = s, d
    return n_best


def load_array(directory: Path, name: str, mmap_mode: str | None) -> np.ndarray:
    """The array saved as `name` in an index directory, memory-mapped with `mmap_mode` (None: read into memory)."""
    # np.asarray drops the np.memmap subclass (numba takes plain arrays) but keeps the mapping
    return np.asarray(np.load(directory / name, mmap_mode=mmap_mode, allow_pickle=False))


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.cache
def _thread_pool(pid: int) -> ThreadPoolExecutor:
    """One pool per process: a forked child inherits the parent's pool object but none of its threads."""
    return ThreadPoolExecutor(max_workers=_cpu_count(), thread_name_prefix="bm25")
