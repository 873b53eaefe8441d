"""OpenAI's Chat Completions wire format: requests in (validated, every field either honoured or refused with the
reason), chat messages as `agentrl.types.Message`, replies and stream chunks out."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentrl.gateway.sessions import GatewayConfig, GatewayError, Reply
from agentrl.policy.protocol import MAX_SEED, SamplingParams
from agentrl.types import Message, ToolCall


def utf8_only(value: Any, where: str = "the request") -> Any:
    """`value` (a request body), or a ValueError naming the first text in it that UTF-8 cannot encode (a lone
    surrogate, which JSON's \\u escapes allow): the tokenizer would fail on it. Every wire format's requests check."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where} holds text that is not valid UTF-8 ({e.reason} at {e.start})") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            utf8_only(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            utf8_only(v, f"{where}[{i}]")
    return value


class WireRequest(BaseModel):
    """A request body of any wire format: unknown fields refused, text that UTF-8 cannot encode refused."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, value: Any) -> Any:
        return utf8_only(value)


def text_of(parts: list[dict[str, Any]], kinds: set[str], where: str, noun: str = "content parts") -> str:
    """The text of a message's parts (or blocks) of `kinds`, joined; a GatewayError naming any other kind."""
    other = {part.get("type") for part in parts} - kinds
    if other:
        raise GatewayError(400, f"{where}: {noun} of type {sorted(map(str, other))} are not supported; the gateway "
                                f"serves text models (send text {noun.split()[-1]} only)")
    return "".join(part.get("text", "") for part in parts)


class FunctionCall(BaseModel):
    """A tool call's function: its arguments a JSON string, as OpenAI sends them."""

    name: str
    arguments: str


class ToolCallIn(BaseModel):
    """A tool call of an assistant message in the history."""

    model_config = ConfigDict(extra="ignore")  # e.g. an "index" left over from stream deltas
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of the request's history."""

    model_config = ConfigDict(extra="ignore")  # e.g. "refusal": null, "annotations": [], "audio": null
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # vLLM's field for the reasoning of an earlier reply


class StreamOptions(BaseModel):
    """`stream_options`: whether the last chunk carries the usage."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class ChatRequest(WireRequest):
    """The body of `POST .../chat/completions`. Fields the gateway cannot honour are refused (400), not ignored;
    unknown fields too."""

    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)  # the engine returns the sampled token's logprob only
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=0, le=0)  # training needs the unpenalized distribution
    presence_penalty: float | None = Field(None, ge=0, le=0)
    response_format: dict[str, Any] | None = None
    # accepted and without effect on sampling: bookkeeping fields of the OpenAI API
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None

    @field_validator("tools")
    @classmethod
    def _functions(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(value or []):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(
                    function.get("name"), str) or not function["name"]:
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                                 f"...}}}}, got {json.dumps(tool)[:200]}")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError("the gateway samples freely and cannot enforce a JSON schema or JSON mode: leave "
                             "response_format out (or {'type': 'text'}) and parse the reply yourself")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _auto_or_none(cls, value: str | dict | None) -> str | dict | None:
        if value not in (None, "auto", "none"):
            raise ValueError("tool_choice must be 'auto' or 'none': the gateway samples freely and cannot force "
                             "a tool call")
        return value

    def sampling(self, config: GatewayConfig) -> SamplingParams:
        """The sampling parameters of the request, the gateway's for those it leaves out; the gateway's max_tokens
        bounds the request's."""
        asked = self.max_completion_tokens or self.max_tokens or config.max_tokens
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=min(asked, config.max_tokens), n=self.n, stop=stop, seed=self.seed,
                              temperature=config.temperature if self.temperature is None else self.temperature,
                              top_p=config.top_p if self.top_p is None else self.top_p)

    def chat_messages(self) -> list[Message]:
        """The history as `Message`s (developer messages are system messages; text parts are joined)."""
        return [_message(m, i) for i, m in enumerate(self.messages)]

    @property
    def parse_tools(self) -> bool:
        """Whether tool calls in the reply are parsed (not with tool_choice 'none')."""
        return self.tool_choice != "none"


def _message(m: ChatMessage, i: int) -> Message:
    content = m.content
    if isinstance(content, list):
        content = text_of(content, {"text"}, f"messages[{i}]")
    calls = []
    for c in m.tool_calls or ():
        try:
            arguments = json.loads(c.function.arguments or "{}")
        except json.JSONDecodeError as e:
            raise GatewayError(400, f"messages[{i}].tool_calls: the arguments of {c.function.name!r} are not JSON "
                                    f"({e.msg})") from None
        calls.append(ToolCall(c.function.name, arguments, c.id))
    if m.reasoning_content and m.role == "assistant":
        content = f"<think>\n{m.reasoning_content}\n</think>\n\n{content or ''}"
    role = "system" if m.role == "developer" else m.role
    return Message(role, content or "", tuple(calls), m.tool_call_id, m.name if m.role == "tool" else None)


def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for c in reply.tool_calls]


def _logprobs(reply: Reply, decode: Any) -> dict[str, Any]:
    tokens = [decode([i]) for i in reply.sample.token_ids]
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, reply.sample.logprobs)]}


def _message_out(reply: Reply, streamed: bool = False) -> dict[str, Any]:
    """The reply as a message, or as a stream's one delta (whose tool calls carry their index)."""
    out: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning is not None:
        out["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        out["tool_calls"] = [{"index": k, **call} if streamed else call for k, call in enumerate(_tool_calls(reply))]
    return out


def _usage(prompt_tokens: int, replies: list[Reply]) -> dict[str, int]:
    completion = sum(len(r.sample.token_ids) for r in replies)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def completion(request: ChatRequest, replies: list[Reply], prompt_tokens: int, decode: Any) -> dict[str, Any]:
    """The `chat.completion` object."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": request.model,
            "choices": [{"index": i, "message": _message_out(r), "finish_reason": r.finish_reason,
                         "logprobs": _logprobs(r, decode) if request.logprobs else None}
                        for i, r in enumerate(replies)],
            "usage": _usage(prompt_tokens, replies)}


def chunks(request: ChatRequest, replies: list[Reply], prompt_tokens: int, decode: Any) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a streamed reply (the whole reply is sampled before the first)."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": request.model}
    out = []
    for i, r in enumerate(replies):
        choice = {"index": i, "delta": _message_out(r, streamed=True), "finish_reason": None,
                  "logprobs": _logprobs(r, decode) if request.logprobs else None}
        out += [{**base, "choices": [choice]},
                {**base, "choices": [{"index": i, "delta": {}, "finish_reason": r.finish_reason}]}]
    if request.stream_options is not None and request.stream_options.include_usage:
        out.append({**base, "choices": [], "usage": _usage(prompt_tokens, replies)})
    return out
