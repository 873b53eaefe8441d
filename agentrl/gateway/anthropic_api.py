"""Anthropic's Messages API wire format (what Claude Code and `anthropic.Anthropic().messages.create` speak), over the
same sessions as Chat Completions: content blocks become chat messages (`tool_use` blocks the assistant's tool
calls, `tool_result` blocks tool messages, `thinking` blocks the reply's reasoning), tools with an `input_schema`
the gateway's function tools, and the reply a `message` object or its stream of events. Errors take Anthropic's
shape, `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import Field, field_validator

from agentrl.gateway.openai_api import WireRequest, text_of
from agentrl.gateway.sessions import GatewayConfig, GatewayError, Reply
from agentrl.policy.protocol import SamplingParams
from agentrl.types import Message, ToolCall

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 408: "timeout_error",
               409: "invalid_request_error", 413: "request_too_large", 502: "api_error"}


class MessagesRequest(WireRequest):
    """The body of `POST .../v1/messages`. Fields the gateway cannot honour are refused (400), not ignored."""

    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=0)  # training needs the untruncated distribution
    stop_sequences: list[str] | None = None
    stream: bool = False
    thinking: dict[str, Any] | None = None  # the policy reasons as it was trained to: the budget is not enforced
    output_config: dict[str, Any] | None = None  # {"effort": ...} (Claude Code): likewise, not enforced
    context_management: dict[str, Any] | None = None  # only edits that keep every block (the client sends its history)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @field_validator("context_management")
    @classmethod
    def _keeps_all(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for i, edit in enumerate((value or {}).get("edits", [])):
            if edit.get("keep") != "all":
                raise ValueError(f"context_management.edits[{i}]: the gateway keeps no history to edit: only edits "
                                 f"with keep = 'all' are accepted (Claude Code's); got {json.dumps(edit)[:200]}")
        return value

    @field_validator("tools")
    @classmethod
    def _custom_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(value or []):
            if tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str) or not tool["name"]:
                raise ValueError(f"tools[{i}]: only client tools ({{'name': ..., 'input_schema': ...}}) can be served "
                                 f"by a policy, not server tools; got {json.dumps(tool)[:200]}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _auto_or_none(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") not in ("auto", "none"):
            raise ValueError("tool_choice must be {'type': 'auto'} or {'type': 'none'}: the gateway samples freely "
                             "and cannot force a tool call")
        return value

    def sampling(self, config: GatewayConfig) -> SamplingParams:
        """The request's sampling parameters, the gateway's for those it leaves out (its max_tokens bounds)."""
        return SamplingParams(max_tokens=min(self.max_tokens, config.max_tokens), stop=tuple(self.stop_sequences or ()),
                              temperature=config.temperature if self.temperature is None else self.temperature,
                              top_p=config.top_p if self.top_p is None else self.top_p)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools in Chat Completions' shape, which the chat template and the parser read."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                  "parameters": t.get("input_schema", {"type": "object"})}}
                for t in self.tools]

    def chat_messages(self) -> list[Message]:
        """The system prompt and the messages as `Message`s: a user message's `tool_result` blocks become tool
        messages (before its text), an assistant message's `thinking` blocks its reasoning."""
        out = [Message("system", _text(self.system, "system"))] if self.system else []
        for i, m in enumerate(self.messages):
            role, content = m.get("role"), m.get("content")
            if role not in ("user", "assistant"):
                raise GatewayError(400, f"messages[{i}].role must be user or assistant (the system prompt is `system`)")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
            text, thinking, calls = [], [], []
            for j, block in enumerate(blocks):
                kind, where = block.get("type"), f"messages[{i}].content[{j}]"
                if kind == "text":
                    text.append(block.get("text", ""))
                elif kind == "tool_result" and role == "user":
                    out.append(Message("tool", _text(block.get("content"), where),
                                       tool_call_id=str(block.get("tool_use_id", ""))))
                elif kind == "tool_use" and role == "assistant":
                    calls.append(ToolCall(str(block.get("name", "")), block.get("input") or {},
                                          str(block.get("id", ""))))
                elif kind == "thinking" and role == "assistant":
                    thinking.append(block.get("thinking", ""))
                else:
                    raise GatewayError(400, f"{where}: blocks of type {kind!r} are not supported in a {role} message; "
                                            "the gateway serves text, tool_use, tool_result and thinking blocks")
            body = "".join(text)
            if thinking:
                body = f"<think>\n{''.join(thinking)}\n</think>\n\n{body}"
            if role == "assistant" or body or not any(b.get("type") == "tool_result" for b in blocks):
                out.append(Message(role, body, tuple(calls)))
        return out

    @property
    def parse_tools(self) -> bool:
        """Whether tool calls in the reply are parsed (not with tool_choice none)."""
        return (self.tool_choice or {}).get("type") != "none"


def _text(content: Any, where: str) -> str:
    """A system prompt's or a tool result's content: a string, or its text blocks joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return text_of(content, {"text"}, where, "blocks")


def _content(reply: Reply) -> list[dict[str, Any]]:
    """The reply's content blocks: its thinking, its text (when it has any), its tool uses."""
    blocks: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    blocks += [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
               for call in reply.tool_calls]
    return blocks


def whole(request: MessagesRequest, reply: Reply, prompt_tokens: int) -> dict[str, Any]:
    """The `message` object of the reply."""
    stop = "stop_sequence" if reply.cut else STOP_REASONS[reply.finish_reason]
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": request.model,
            "content": _content(reply), "stop_reason": stop, "stop_sequence": reply.cut or None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(reply.sample.token_ids)}}


def events(request: MessagesRequest, reply: Reply, prompt_tokens: int) -> list[str]:
    """The server-sent events of a streamed message (the whole reply is sampled before the first): message_start,
    each block's start, one delta and stop, message_delta with the stop reason, message_stop."""
    final = whole(request, reply, prompt_tokens)
    started = {**final, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    out: list[dict[str, Any]] = [{"type": "message_start", "message": started}]
    for index, block in enumerate(final["content"]):
        kind = block["type"]
        empty = {"text": {"type": "text", "text": ""},
                 "thinking": {"type": "thinking", "thinking": "", "signature": ""},
                 "tool_use": {**block, "input": {}}}[kind]
        delta = {"text": {"type": "text_delta", "text": block.get("text")},
                 "thinking": {"type": "thinking_delta", "thinking": block.get("thinking")},
                 "tool_use": {"type": "input_json_delta",
                              "partial_json": json.dumps(block.get("input"), ensure_ascii=False)}}[kind]
        out += [{"type": "content_block_start", "index": index, "content_block": empty},
                {"type": "content_block_delta", "index": index, "delta": delta}]
        if kind == "thinking":
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "signature_delta", "signature": ""}})
        out.append({"type": "content_block_stop", "index": index})
    out += [{"type": "message_delta", "delta": {"stop_reason": final["stop_reason"],
                                                "stop_sequence": final["stop_sequence"]},
             "usage": {"output_tokens": final["usage"]["output_tokens"]}},
            {"type": "message_stop"}]
    return [f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in out]


def error_body(status: int, message_text: str) -> dict[str, Any]:
    """An error in Anthropic's shape, which its SDK raises with the message."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message_text}}
