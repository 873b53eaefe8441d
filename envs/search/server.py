"""The retrieval server: Search-R1's `/retrieve` API over any `Retriever` (FastAPI).

    POST /retrieve  {"queries": [...], "topk": k, "return_scores": bool}
                 -> {"result": [[{"document": {"id", "contents"}, "score": s}, ...] per query]}
                    (without return_scores each item is the bare document, as in Search-R1)
    GET  /documents/{id} -> {"id", "contents"}      (ours; backs the `open` tool)
    GET  /health         -> {"status": "ok", "documents": N}

Malformed requests get 422 with the reason, never a crash. Search runs in FastAPI's thread pool, so
concurrent requests are served in parallel (the index is read-only).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from agentrl.envs.search.retriever import Retriever

MAX_TOPK = 1000
MAX_QUERIES = 4096


class RetrieveRequest(BaseModel):
    """The body of `POST /retrieve`, Search-R1's fields; `topk` None means the server's default. Unknown fields
    are a 422."""

    model_config = ConfigDict(extra="forbid")

    queries: list[str] = Field(max_length=MAX_QUERIES)
    topk: int | None = Field(default=None, ge=1, le=MAX_TOPK)
    return_scores: bool = False


def create_app(retriever: Retriever, default_topk: int = 3) -> FastAPI:
    """The FastAPI app that serves `retriever` (`/retrieve`, `/documents/{id}`, `/health`); `default_topk` is
    the `topk` of a request that gives none."""
    app = FastAPI(title="agentrl retriever", description="Search-R1-compatible retrieval API.")

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> dict[str, Any]:
        results = retriever.search(request.queries, request.topk or default_topk)
        if request.return_scores:
            return {"result": [[hit.to_dict() for hit in hits] for hits in results]}
        return {"result": [[hit.to_dict()["document"] for hit in hits] for hits in results]}

    @app.get("/documents/{doc_id}")
    def document(doc_id: str) -> dict[str, str]:
        try:
            return retriever.document(doc_id)
        except KeyError:
            raise HTTPException(404, f"no document with id {doc_id!r}") from None

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "documents": len(retriever)}

    return app
