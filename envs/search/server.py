"""The retrieval server: Search-R1's `/retrieve` API over any `Retriever` (FastAPI).

    POST /retrieve  {"queries": [...], "topk": k, "return_scores": bool}
                 -> {"result": [[{"document": {"id", "contents"}, "score": s}, ...] per query]}
                    (without return_scores each item is the bare document, as in Search-R1)
    GET  /documents/{id} -> {"id", "contents"}      (ours; backs the `open` tool)
    GET  /health         -> {"status": "ok", "documents": N}

Malformed requests get 422 with the reason, never a crash. One request costs bounded memory: its body is at
most `MAX_BODY_BYTES` (413 past it; a body of unknown length is refused with 411) and it asks for at most
`MAX_RESULTS` results, queries × topk (422 past it, naming how to split it). Search runs in FastAPI's thread
pool, so concurrent requests are served in parallel (the index is read-only).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from agentrl.envs.search.retriever import MAX_RESULTS, Retriever
from agentrl.system.http_limits import BodyLimit

MAX_TOPK = 1000
MAX_QUERIES = 4096
MAX_BODY_BYTES = 16 << 20  # 4096 queries of 4 KB; the body is read whole before it is validated


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
    if not 1 <= default_topk <= MAX_TOPK:
        raise ValueError(f"default_topk must be between 1 and {MAX_TOPK}, got {default_topk}")
    app = FastAPI(title="agentrl retriever", description="Search-R1-compatible retrieval API.")

    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES, what="send fewer or shorter queries per request",
                       respond=lambda status, reason: JSONResponse({"detail": reason}, status))

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> dict[str, Any]:
        n, topk = len(request.queries), request.topk or default_topk
        if n * topk > MAX_RESULTS:  # the response grows with the product (1M results: ~300 MB, 1.7 GB peak)
            raise HTTPException(422, f"{n} queries × topk {topk} = {n * topk:,} results; at most {MAX_RESULTS:,} "
                                     f"per request: send at most {MAX_RESULTS // topk} queries per request at "
                                     f"topk {topk}")
        results = retriever.search(request.queries, topk)
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
