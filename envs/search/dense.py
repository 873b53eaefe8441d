"""Dense retrieval: a sentence-transformers encoder and an exact faiss inner-product index.

An optional extra (`pip install 'agentrl[dense]'`), for users who have an embedding model: faiss and
sentence_transformers are imported only when an index is built or loaded, never by `import agentrl`.

Documents and queries are embedded by the same model, L2-normalized, and scored by inner product, so a
score is the cosine similarity. That is Search-R1's e5 retriever: `intfloat/e5-base-v2` with
`query_prefix="query: "`, `doc_prefix="passage: "`, mean pooling, and a flat (exact) inner-product index.
The prefixes go through sentence-transformers' `prompt` argument, so a model whose pooling excludes the
prompt tokens (`include_prompt=False`) pools as it was trained to.

Index directory (FORMAT_VERSION 1; "index_type": "dense" tells it apart from a BM25 index):
    params.json                      format version, model (an absolute path, or a hub name), prefixes, dim, n_docs
    index.faiss                      faiss IndexFlatIP of the normalized document embeddings; row i = document i
    contents.npy, contents.offsets.npy  all contents as one UTF-8 blob, and n_docs + 1 offsets into it (memory-mapped)
    ids.npy, ids.offsets.npy         the ids, stored the same way
    ids.sorted.npy                   int32 rows ordered by id, for `document(id)` by binary search
"""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from agentrl.envs.search.bm25 import Documents, SearchHit, Strings, load_array
from agentrl.system.files import write_folder
from tqdm.auto import tqdm

FORMAT_VERSION = 1
INDEX_TYPE = "dense"
_ENCODE_CHUNK = 16384  # documents embedded per faiss.add: bounds the embeddings held outside the index
_QUERY_BATCH_SIZE = 64


class DenseIndex(Documents):
    """Cosine top-k over a fixed corpus. Build it once (`build(docs, model).save(dir)`), then `load(dir)`."""

    def __init__(self, params: dict, encoder: Any, vectors: Any, ids: Strings, contents: Strings,
                 ids_sorted: np.ndarray):
        self.params = params  # format_version, index_type, model, query_prefix, doc_prefix, dim, n_docs
        self._encoder = encoder  # a sentence_transformers.SentenceTransformer
        self._vectors = vectors  # a faiss.IndexFlatIP of n_docs normalized embeddings
        self._ids, self._contents, self._ids_sorted = ids, contents, ids_sorted
        # The server searches from a thread pool, but a Hugging Face fast tokenizer is not safe to call
        # from two threads at once (it sets padding and truncation on the shared Rust tokenizer: "Already
        # borrowed"), and parallel forward passes would only compete with torch's own threads.
        self._encode_lock = threading.Lock()

    @classmethod
    def build(cls, docs: Iterable[dict], model: str | Path, batch_size: int = 64, show_progress: bool = False,
              query_prefix: str = "", doc_prefix: str = "") -> DenseIndex:
        """Embed `{"id", "contents"}` dicts with `model` (a sentence-transformers directory or hub name).

        `query_prefix` / `doc_prefix` are put before every query / document, as the model was trained:
        "query: " and "passage: " for e5. The model is recorded (a directory by its absolute path) for `load`.
        """
        faiss = _require("faiss", "faiss-cpu")
        ids, contents = [], []
        for doc in docs:
            ids.append(str(doc["id"]))
            contents.append(doc["contents"])
        if not ids:
            raise ValueError("Cannot build a dense index over an empty corpus.")
        ids_sorted = np.array(sorted(range(len(ids)), key=ids.__getitem__), dtype=np.int32)
        duplicates = [ids[r] for r, s in pairwise(ids_sorted) if ids[r] == ids[s]]
        if duplicates:  # checked before embedding, which can take hours
            raise ValueError(f"Document ids must be unique; repeated: {duplicates[:5]}")

        model_name = _model_name(model)
        encoder = _load_encoder(model_name, "Check the `model` argument.")
        vectors = None
        with tqdm(total=len(contents), desc="Dense encode", disable=not show_progress) as progress:
            for start in range(0, len(contents), _ENCODE_CHUNK):
                emb_ND = _encode(encoder, contents[start:start + _ENCODE_CHUNK], doc_prefix, batch_size)
                if vectors is None:
                    vectors = faiss.IndexFlatIP(emb_ND.shape[1])
                vectors.add(emb_ND)
                progress.update(len(emb_ND))
        params = {"format_version": FORMAT_VERSION, "index_type": INDEX_TYPE, "model": model_name,
                  "query_prefix": query_prefix, "doc_prefix": doc_prefix, "dim": vectors.d, "n_docs": len(ids)}
        return cls(params, encoder, vectors, Strings.from_list(ids), Strings.from_list(contents), ids_sorted)

    def save(self, path: str | Path) -> None:
        """Write the index directory at `path`, replacing any old one; a crash leaves the old one or none."""
        faiss = _require("faiss", "faiss-cpu")

        def write(tmp: Path) -> None:
            (tmp / "params.json").write_text(json.dumps(self.params, indent=1, ensure_ascii=False),
                                             encoding="utf-8")
            faiss.write_index(self._vectors, str(tmp / "index.faiss"))
            self._ids.save(tmp, "ids")
            self._contents.save(tmp, "contents")
            np.save(tmp / "ids.sorted.npy", self._ids_sorted)

        write_folder(path, write)

    @classmethod
    def load(cls, path: str | Path, model: str | Path | None = None) -> DenseIndex:
        """Open an index written by `save`, with the model recorded at build time unless `model` is given
        (the same model moved, say); its embedding size must match the index's."""
        faiss = _require("faiss", "faiss-cpu")
        path = Path(path)
        rebuild = f"Rebuild it with DenseIndex.build(docs, model).save({str(path)!r})."
        if not path.is_dir():
            raise FileNotFoundError(f"No dense index at {path}. {rebuild}")
        try:
            params = json.loads((path / "params.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable dense index ({e}). {rebuild}") from e
        if params.get("index_type") != INDEX_TYPE:
            raise ValueError(f"{path} is not a dense index (index_type {params.get('index_type')!r}); "
                             f"a BM25 index loads with BM25Index.load. {rebuild}")
        if params.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path} holds dense index format {params.get('format_version')!r}; this code "
                             f"reads format {FORMAT_VERSION}. {rebuild}")
        try:
            vectors = faiss.read_index(str(path / "index.faiss"))
            ids, contents = Strings.load(path, "ids", "r"), Strings.load(path, "contents", "r")
            ids_sorted = load_array(path, "ids.sorted.npy", "r")
        except (OSError, ValueError, RuntimeError) as e:  # faiss reports unreadable files as RuntimeError
            raise ValueError(f"{path} is a damaged dense index ({e}). {rebuild}") from e
        n_docs, dim = params["n_docs"], params["dim"]
        expected = {"index.faiss rows": (vectors.ntotal, n_docs), "index.faiss dim": (vectors.d, dim),
                    "ids.offsets": (len(ids.offsets), n_docs + 1),
                    "contents.offsets": (len(contents.offsets), n_docs + 1), "ids.sorted": (len(ids_sorted), n_docs)}
        for name, (got, want) in expected.items():
            if got != want:
                raise ValueError(f"{path} is a damaged dense index ({name} is {got}, expected {want}). {rebuild}")
        if vectors.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise ValueError(f"{path}/index.faiss does not score by inner product. {rebuild}")

        model_name = params["model"] if model is None else _model_name(model)
        encoder = _load_encoder(model_name, f"Pass the model's current place: DenseIndex.load({str(path)!r}, "
                                            f"model=...).")
        got_dim = _encode(encoder, [""], "", 1).shape[1]
        if got_dim != dim:
            raise ValueError(f"Model {model_name} embeds into {got_dim} dimensions but the index at {path} holds "
                             f"{dim}-dimensional vectors of {params['model']}: load it with the model it was "
                             f"built with.")
        return cls(params, encoder, vectors, ids, contents, ids_sorted)

    def search(self, queries: Sequence[str], k: int = 3) -> list[list[SearchHit]]:
        """The top min(k, len(self)) documents for each query by cosine similarity, best first; equal scores
        go in corpus order (when documents tie for the last place, faiss picks which of them make the cut).

        A query's embedding can differ in the last float bits with the batch it is encoded in (padding
        changes the shapes the model computes with), so scores are reproducible for the same batch, and
        equal across batchings only to ~1e-6."""
        if isinstance(queries, str):
            raise TypeError("search takes a batch of queries: search([query]), not search(query).")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}.")
        if not queries:
            return []
        k = min(k, len(self))
        with self._encode_lock:
            q_QD = _encode(self._encoder, list(queries), self.params["query_prefix"], _QUERY_BATCH_SIZE)
        scores_QK, rows_QK = self._vectors.search(q_QD, k)  # releases the GIL; read-only, so thread-safe
        # faiss returns tied scores in no set order; lexsort's last key is the primary one
        order_QK = np.lexsort((rows_QK, -scores_QK), axis=-1)
        rows_QK = np.take_along_axis(rows_QK, order_QK, axis=-1)
        scores_QK = np.take_along_axis(scores_QK, order_QK, axis=-1)
        return [[SearchHit(**self._document(row), score=score) for row, score in zip(rows, scores)]
                for rows, scores in zip(rows_QK.tolist(), scores_QK.tolist())]


def _encode(encoder: Any, texts: list[str], prefix: str, batch_size: int) -> np.ndarray:
    # prompt="" rather than None: None would apply a default prompt the model's config may name
    emb = encoder.encode(texts, prompt=prefix, batch_size=batch_size, normalize_embeddings=True,
                         convert_to_numpy=True, show_progress_bar=False)
    return np.ascontiguousarray(emb, dtype=np.float32)  # what faiss takes: float32 [n, dim], C order


def _model_name(model: str | Path) -> str:
    """A local model directory by its absolute path, so `load` finds it from any working directory;
    anything else is a hub name."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def _load_encoder(model: str, hint: str) -> Any:
    sentence_transformers = _require("sentence_transformers", "sentence-transformers")
    if Path(model).is_absolute() and not Path(model).is_dir():
        raise FileNotFoundError(f"No sentence-transformers model at {model}. {hint}")
    return sentence_transformers.SentenceTransformer(model)


def _require(module: str, package: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"Dense retrieval needs {package}, which is not installed: "
                          f"pip install 'agentrl[dense]'") from e
