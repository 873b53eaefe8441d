"""Where the search tool gets its passages: the in-process BM25 index, or a retrieval server by URL.

Both speak the same `Retriever` protocol, and the server speaks Search-R1's `/retrieve` JSON, so our
client also works against Search-R1's own retrieval server (dense e5 or BM25) and theirs against ours.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import httpx

from agentrl.envs.search.bm25 import SearchHit

MAX_RESULTS = 65536  # results (queries × topk) in one /retrieve request: our server's limit; the client keeps to it


class Retriever(Protocol):
    """What the search tool needs of its passages' source: the in-process index or a server's client."""

    def search(self, queries: Sequence[str], k: int = 3) -> list[list[SearchHit]]:
        """The top `k` documents of each query, best first."""

    def document(self, doc_id: str) -> dict[str, str]:
        """The document `{"id", "contents"}` by id; KeyError if there is none."""

    def __len__(self) -> int:
        """The number of documents."""


class RetrieverError(RuntimeError):
    """The retrieval server could not answer (down, timing out, or answering 5xx after the retries)."""


class RemoteRetriever:
    """A client of a `/retrieve` server (ours: `agentrl serve retriever`, or Search-R1's).

    Queries go in batches of `batch_size` (fewer when `batch_size` × k would pass `MAX_RESULTS`); connection
    errors, timeouts and 5xx are retried `retries` times with exponential backoff, then raise `RetrieverError`
    (the rollout records an `error` trajectory).
    A 4xx is our bug or a bad request and raises at once.
    """

    def __init__(self, url: str, timeout: float = 10.0, retries: int = 3, batch_size: int = 64,
                 backoff: float = 0.5):
        self.url = url.rstrip("/")
        self.retries, self.batch_size, self.backoff = retries, batch_size, backoff
        self._client = httpx.Client(timeout=timeout)

    def search(self, queries: Sequence[str], k: int = 3) -> list[list[SearchHit]]:
        """The top `k` documents of each query, best first, asked for in batches of `batch_size`."""
        hits: list[list[SearchHit]] = []
        batch_size = max(1, min(self.batch_size, MAX_RESULTS // k))
        for start in range(0, len(queries), batch_size):
            batch = list(queries[start : start + batch_size])
            body = self._request("POST", "/retrieve", json={"queries": batch, "topk": k, "return_scores": True})
            hits.extend([_hit(item) for item in result] for result in body["result"])
        return hits

    def document(self, doc_id: str) -> dict[str, str]:
        """The document `{"id", "contents"}` by id; KeyError if the server has none (404)."""
        try:
            return self._request("GET", f"/documents/{doc_id}")
        except httpx.HTTPStatusError as e:
            if e.response.status_code == 404:
                raise KeyError(f"no document with id {doc_id!r}") from None
            raise

    def __len__(self) -> int:
        return int(self._request("GET", "/health")["documents"])

    def close(self) -> None:
        """Close the client's connection pool."""
        self._client.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        for attempt in range(self.retries + 1):
            try:
                response = self._client.request(method, self.url + path, **kwargs)
                if response.status_code < 500:
                    response.raise_for_status()
                    return response.json()
                problem = f"HTTP {response.status_code}: {response.text[:200]}"
            except (httpx.TransportError, httpx.TimeoutException) as e:
                problem = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                time.sleep(self.backoff * 2**attempt)
        raise RetrieverError(f"retrieval server {self.url} failed {self.retries + 1} times; last: {problem}. "
                             f"Is it running? Start one with `agentrl serve retriever`.")


def _hit(item: dict[str, Any]) -> SearchHit:
    """One `/retrieve` result; without `return_scores` Search-R1 servers send the bare document."""
    doc = item.get("document", item)
    return SearchHit(str(doc.get("id", "")), doc["contents"], float(item.get("score", 0.0)))



def format_passages(hits: Sequence[SearchHit], with_ids: bool = False) -> str:
    """Passages exactly as Search-R1 shows them to the model: `Doc 1(Title: "Title") text`, one per line;
    `with_ids` adds each document's id (`Doc 1(id: d0042, Title: ...)`) for envs with an `open` tool."""
    lines = []
    for i, hit in enumerate(hits, 1):
        title, _, text = hit.contents.partition("\n")
        lines.append(f"Doc {i}({f'id: {hit.id}, ' if with_ids else ''}Title: {title}) {text}")
    return "\n".join(lines)
