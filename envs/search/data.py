"""The files users bring, read into our shapes, and the on-disk index cache.

- Corpora: JSONL (optionally gzipped) in the Search-R1 / DPR shape `{"id", "contents": "\\"Title\\"\\ntext"}`, or
  wiki-style `{"id", "title", "text"}` rows (FlashRAG, DPR's psgs_w100 converted to JSONL).
- QA sets: Search-R1's parquet files (`question`, `golden_answers` or `reward_model.ground_truth.target`,
  `data_source`) and FlashRAG's JSONL (`id`, `question`, `golden_answers`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from agentrl.envs.search.bm25 import BM25Index
from agentrl.types import Task

DEFAULT_CACHE = Path.home() / ".cache" / "agentrl" / "search"


def read_corpus(path: str | Path) -> Iterator[dict[str, str]]:
    """Documents `{"id", "contents"}` from a JSONL corpus; ValueError names the file and line of a bad row."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _document(json.loads(line), line_no)
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a corpus row ({type(e).__name__}: {e}). Each line must "
                                 'be {"id", "contents": "\\"Title\\"\\ntext"} or {"id", "title", "text"}.') from e


def _document(row: dict[str, Any], line_no: int) -> dict[str, str]:
    doc_id = str(row.get("id", line_no - 1))
    if "contents" in row:
        return {"id": doc_id, "contents": str(row["contents"])}
    return {"id": doc_id, "contents": f'"{row["title"]}"\n{row["text"]}'}


def load_qa(path: str | Path, split: str | None = None) -> list[Task]:
    """QA pairs as tasks with `data = {"question", "answers", "supporting_docs": [], "suite"}`."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pandas as pd  # only for parquet, which users of Search-R1's data have

        rows: Iterable[dict[str, Any]] = pd.read_parquet(path).to_dict("records")
    elif path.suffix in (".jsonl", ".json") or path.name.endswith(".jsonl.gz"):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        raise ValueError(f"{path}: QA files must be .parquet (Search-R1) or .jsonl (FlashRAG)")
    suite = split or path.name.split(".")[0]
    tasks = []
    for i, row in enumerate(rows):
        answers = _answers(row)
        if not row.get("question") or not answers:
            raise ValueError(f"{path}: row {i} needs a 'question' and gold answers ('golden_answers' or "
                             f"'reward_model.ground_truth.target'); it has keys {sorted(row)}")
        task_id = str(row.get("id") or (row.get("extra_info") or {}).get("index", i))
        tasks.append(Task(f"{suite}-{task_id}", {"question": str(row["question"]).strip(), "answers": answers,
                                                 "supporting_docs": [], "suite": suite}, split=suite))
    return tasks


def _answers(row: dict[str, Any]) -> list[str]:
    answers = row.get("golden_answers")
    if answers is None:
        answers = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
    if isinstance(answers, str):
        return [answers]
    return [str(a) for a in answers] if answers is not None else []


def load_index(path: str | Path) -> BM25Index:
    """A saved index directory: BM25, or dense (faiss) when its params.json says so."""
    params = Path(path) / "params.json"
    if params.exists() and json.loads(params.read_text()).get("index_type") == "dense":
        from agentrl.envs.search.dense import DenseIndex  # optional extra: faiss + sentence-transformers

        return DenseIndex.load(path)
    return BM25Index.load(path)


def cached_index(docs: list[dict[str, str]], cache_dir: str | Path = DEFAULT_CACHE, **build_kwargs: Any) -> BM25Index:
    """The BM25 index of `docs`, built once and then loaded (memory-mapped) from a directory named by a hash
    of the documents and the build settings, so a changed corpus never meets a stale index."""
    digest = hashlib.sha256(json.dumps([docs, build_kwargs], sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"bm25-{digest}"
    if not path.exists():
        BM25Index.build(docs, **build_kwargs).save(path)
    return BM25Index.load(path)
