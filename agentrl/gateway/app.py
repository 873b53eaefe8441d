"""The gateway's HTTP face (FastAPI): OpenAI's Chat Completions API per session, and the session routes.

    POST /sessions                                 {"task_id", "group", "info"} -> {"id", "base_url"}
    POST /sessions/{id}/v1/chat/completions        OpenAI Chat Completions (stream or not)
    POST /sessions/{id}/v1/responses               OpenAI Responses (Codex CLI; `responses_api.py`)
    POST /sessions/{id}/v1/messages                Anthropic Messages (Claude Code; `anthropic_api.py`)
    GET  /sessions/{id}/v1/models                  the one model served
    POST /sessions/{id}/reward                     {"reward", "components"} closes the session
    GET  /sessions/{id}                            its state; its trajectories once closed
    DELETE /sessions/{id}                          a closed session's trajectories, forgetting it (else kept for
                                                   `session_timeout`)
    GET  /health

Errors come back in OpenAI's shape, `{"error": {"message", "type", "code"}}` (Anthropic's on `/v1/messages`), so that
the official clients raise them with the message: malformed or unsupported requests 400, unknown sessions 404, closed
ones 409, bodies over `MAX_BODY_BYTES` 413, bodies not all there within 30 s 408, a failed policy 502. A session's
calls past `max_calls` end it as truncated; `FLOOD_REFUSALS` refused calls in a row end it as an error. A streamed
reply is sampled whole before its first chunk, so a client that disconnects mid-stream loses nothing of the session.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from agentrl.gateway import anthropic_api, responses_api
from agentrl.gateway.anthropic_api import MessagesRequest
from agentrl.gateway.openai_api import ChatRequest, chunks, completion
from agentrl.gateway.responses_api import ResponsesRequest
from agentrl.gateway.sessions import Gateway, GatewayError
from agentrl.system.http_limits import BodyLimit

MAX_BODY_BYTES = 32 << 20  # a long agent conversation is a few MB of JSON


class OpenSession(BaseModel):
    """The body of `POST /sessions`."""

    model_config = ConfigDict(extra="forbid")
    task_id: str = ""
    group: int = 0
    info: dict[str, Any] = Field(default_factory=dict)
    # no `id`: a session's random 128-bit id is its only credential, so a client cannot choose one another could guess


class SessionReward(BaseModel):
    """The body of `POST /sessions/{id}/reward`."""

    model_config = ConfigDict(extra="forbid")
    reward: float = Field(allow_inf_nan=False)
    components: dict[str, float] = Field(default_factory=dict)


def _error(status: int, message: str, code: str = "invalid_request_error", path: str = "") -> JSONResponse:
    if path.endswith("/v1/messages"):
        return JSONResponse(anthropic_api.error_body(status, message), status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)


def _sse(events: list[str]) -> StreamingResponse:
    return StreamingResponse(iter(events), media_type="text/event-stream")


def create_app(gateway: Gateway, model_name: str = "agentrl-policy") -> FastAPI:
    """The FastAPI app that serves `gateway`; `model_name` is what `/v1/models` lists (requests may name any)."""
    app = FastAPI(title="agentrl gateway", description="OpenAI-compatible Chat Completions that record exact tokens.")

    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES, what="send a shorter conversation", respond=_error)

    def counted(request: Request, status: int, message: str, code: str = "invalid_request_error") -> JSONResponse:
        """The error response; a refused model call also counts toward its session's flood limit."""
        session_id = request.path_params.get("session_id")
        if session_id and "/v1/" in request.url.path:
            gateway.refused(session_id, message)
        return _error(status, message, code, request.url.path)

    @app.exception_handler(GatewayError)
    async def refused(request: Request, e: GatewayError) -> JSONResponse:
        return counted(request, e.status, str(e), e.code)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, e: RequestValidationError) -> JSONResponse:
        where = "; ".join(f"{'.'.join(map(str, err['loc'][1:])) or 'body'}: {err['msg']}" for err in e.errors())
        return counted(request, 400, f"malformed request: {where}")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "sessions": sum(s.trajectories is None for s in gateway.sessions.values())}

    @app.post("/sessions")
    def open_session(body: OpenSession, request: Request) -> dict[str, str]:
        session = gateway.open(body.task_id, body.group, body.info)
        root = f"{str(request.base_url).rstrip('/')}/sessions/{session.id}"
        return {"id": session.id, "base_url": f"{root}/v1", "anthropic_base_url": root}  # Anthropic's SDK adds /v1

    @app.get("/sessions/{session_id}")
    def session_state(session_id: str) -> dict[str, Any]:
        s = gateway.get(session_id)
        out: dict[str, Any] = {"id": s.id, "task_id": s.task_id, "group": s.group, "calls": s.calls,
                               "segments": len(s.segments), "closed": s.trajectories is not None}
        if s.trajectories is not None:
            out["trajectories"] = [t.to_dict() for t in s.trajectories]
        return out

    @app.delete("/sessions/{session_id}")
    def take_session(session_id: str) -> dict[str, Any]:
        return {"id": session_id, "trajectories": [t.to_dict() for t in gateway.pop(session_id)]}

    @app.post("/sessions/{session_id}/reward")
    def reward(session_id: str, body: SessionReward) -> dict[str, Any]:
        trajectories = gateway.close(session_id, body.reward, body.components)
        return {"id": session_id, "trajectories": len(trajectories),
                "sampled_tokens": sum(t.num_sampled for t in trajectories)}

    @app.get("/sessions/{session_id}/v1/models")
    def models(session_id: str) -> dict[str, Any]:
        gateway.get(session_id)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "agentrl"}]}

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat(session_id: str, body: ChatRequest):
        replies, prompt_tokens = await gateway.complete(
            session_id, body.chat_messages(), body.tools, body.sampling(gateway.config), body.parse_tools)
        decode = gateway.renderer.decode
        if not body.stream:
            return completion(body, replies, prompt_tokens, decode)
        events = [f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks(body, replies, prompt_tokens,
                                                                                     decode)]
        return _sse([*events, "data: [DONE]\n\n"])

    async def answer(session_id: str, body: ResponsesRequest | MessagesRequest, api: Any):
        """One reply in the wire format of `api` (responses_api or anthropic_api): whole, or as its events."""
        [reply], prompt_tokens = await gateway.complete(
            session_id, body.chat_messages(), body.chat_tools(), body.sampling(gateway.config), body.parse_tools)
        return _sse(api.events(body, reply, prompt_tokens)) if body.stream else api.whole(body, reply, prompt_tokens)

    @app.post("/sessions/{session_id}/v1/responses")
    async def responses(session_id: str, body: ResponsesRequest):
        return await answer(session_id, body, responses_api)

    @app.post("/sessions/{session_id}/v1/messages")
    async def messages(session_id: str, body: MessagesRequest):
        return await answer(session_id, body, anthropic_api)

    return app
