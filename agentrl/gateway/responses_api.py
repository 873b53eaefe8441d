"""OpenAI's Responses API wire format (what Codex CLI and `client.responses.create` speak), over the same sessions as
Chat Completions: the request's `input` items become chat messages (message items, `function_call` and
`function_call_output` items, reasoning items as the reply's thinking), its flat function tools the gateway's, and
the reply a `response` object or its stream of `response.*` events.

The gateway keeps no response objects: a client continues a conversation by sending its items back (as Codex does
with `store: false`), not with `previous_response_id`, which is refused with that fix."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import Field, field_validator

from agentrl.gateway.openai_api import WireRequest, text_of
from agentrl.gateway.sessions import GatewayConfig, GatewayError, Reply
from agentrl.policy.protocol import SamplingParams
from agentrl.types import Message, ToolCall


class ResponsesRequest(WireRequest):
    """The body of `POST .../responses`. Fields the gateway cannot honour are refused (400), not ignored."""

    model: str = ""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    reasoning: dict[str, Any] | None = None  # effort / summary: the policy reasons as it was trained to
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    # accepted and without effect on sampling: bookkeeping fields of the OpenAI API
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None  # Codex CLI's ids of its session, thread and turn

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("the gateway keeps no responses: send the whole conversation in `input` (as Codex does "
                             "with store = false) instead of previous_response_id")
        return value

    @field_validator("tools")
    @classmethod
    def _functions(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(value or []):
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str) or not tool["name"]:
                raise ValueError(f"tools[{i}]: only function tools ({{'type': 'function', 'name': ..., 'parameters': "
                                 f"...}}) can be served by a policy; got {json.dumps(tool)[:200]}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _auto_or_none(cls, value: str | dict | None) -> str | dict | None:
        if value not in (None, "auto", "none"):
            raise ValueError("tool_choice must be 'auto' or 'none': the gateway samples freely and cannot force a "
                             "tool call")
        return value

    @field_validator("text")
    @classmethod
    def _plain_text(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and (value.get("format") or {"type": "text"}).get("type") != "text":
            raise ValueError("text.format: the gateway samples freely and cannot enforce a JSON schema: leave it out "
                             "(or {'type': 'text'}) and parse the reply yourself")
        return value

    def sampling(self, config: GatewayConfig) -> SamplingParams:
        """The request's sampling parameters, the gateway's for those it leaves out (its max_tokens bounds)."""
        asked = self.max_output_tokens or config.max_tokens
        return SamplingParams(max_tokens=min(asked, config.max_tokens),
                              temperature=config.temperature if self.temperature is None else self.temperature,
                              top_p=config.top_p if self.top_p is None else self.top_p)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in Chat Completions' shape, which the chat template and the parser read."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {k: v for k, v in tool.items() if k in
                                                  ("name", "description", "parameters", "strict")}}
                for tool in self.tools]

    def chat_messages(self) -> list[Message]:
        """The instructions and the input items as `Message`s: consecutive function calls (and the reasoning before
        them) join the assistant message they belong to."""
        out = [Message("system", self.instructions)] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        thinking = ""  # a reasoning item's text, until the assistant output it preceded
        for i, item in enumerate(items):
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise GatewayError(400, f"input[{i}]: role must be user, system, developer or assistant")
                text = _text(item.get("content"), i)
                if role == "assistant":
                    out.append(Message("assistant", thinking + text))
                    thinking = ""
                else:
                    out.append(Message("system" if role == "developer" else role, text))
            elif kind == "function_call":
                try:
                    arguments = json.loads(item.get("arguments") or "{}")
                except json.JSONDecodeError as e:
                    raise GatewayError(400, f"input[{i}]: the arguments of {item.get('name')!r} are not JSON "
                                            f"({e.msg})") from None
                call = ToolCall(str(item.get("name", "")), arguments, str(item.get("call_id", "")))
                last = out[-1] if out and out[-1].role == "assistant" and not thinking else None
                if last is not None:  # a parallel call of the same reply
                    out[-1] = Message("assistant", last.content, (*last.tool_calls, call))
                else:
                    out.append(Message("assistant", thinking, (call,)))
                    thinking = ""
            elif kind == "function_call_output":
                output = item.get("output")
                out.append(Message("tool", output if isinstance(output, str) else _text(output, i),
                                   tool_call_id=str(item.get("call_id", ""))))
            elif kind == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                thinking = f"<think>\n{''.join(p.get('text', '') for p in parts)}\n</think>\n\n"
            else:
                raise GatewayError(400, f"input[{i}]: items of type {kind!r} are not supported; the gateway serves "
                                        "messages, function calls and their outputs, and reasoning")
        return out

    @property
    def parse_tools(self) -> bool:
        """Whether tool calls in the reply are parsed (not with tool_choice 'none')."""
        return self.tool_choice != "none"


def _text(content: Any, i: int) -> str:
    """A message's content: a string, or its text parts joined (input_text, output_text)."""
    if content is None or isinstance(content, str):
        return content or ""
    return text_of(content, {"input_text", "output_text", "text"}, f"input[{i}]")


def _output(reply: Reply) -> list[dict[str, Any]]:
    """The reply's output items: its reasoning, its message (when it has text), its function calls."""
    items: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": reply.reasoning}]})
    if reply.content:
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": reply.content, "annotations": []}]})
    for call in reply.tool_calls:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id,
                      "name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False),
                      "status": "completed"})
    return items


def whole(request: ResponsesRequest, reply: Reply, prompt_tokens: int) -> dict[str, Any]:
    """The `response` object (status `incomplete` with reason `max_output_tokens` when the reply was cut)."""
    incomplete = reply.finish_reason == "length"
    output_tokens = len(reply.sample.token_ids)
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if incomplete else "completed", "model": request.model, "output": _output(reply),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "instructions": request.instructions, "tools": request.tools or [],
            "tool_choice": request.tool_choice or "auto", "parallel_tool_calls": request.parallel_tool_calls is not
            False, "temperature": request.temperature, "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens, "metadata": request.metadata or {},
            "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": output_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt_tokens + output_tokens}}


def events(request: ResponsesRequest, reply: Reply, prompt_tokens: int) -> list[str]:
    """The server-sent events of a streamed response (the whole reply is sampled before the first): created, each
    output item added, its text or arguments as one delta and done, then completed."""
    final = whole(request, reply, prompt_tokens)
    started = {**final, "status": "in_progress", "output": [], "incomplete_details": None, "usage": None}
    out: list[dict[str, Any]] = [{"type": "response.created", "response": started},
                                 {"type": "response.in_progress", "response": started}]
    for index, item in enumerate(final["output"]):
        opened = {**item, "status": "in_progress"} if "status" in item else item
        if item["type"] == "message":
            opened = {**opened, "content": []}
        elif item["type"] == "function_call":
            opened = {**opened, "arguments": ""}
        out.append({"type": "response.output_item.added", "output_index": index, "item": opened})
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            out += [{"type": "response.content_part.added", **where, "content_index": 0,
                     "part": {**part, "text": ""}},
                    {"type": "response.output_text.delta", **where, "content_index": 0, "delta": part["text"],
                     "logprobs": []},
                    {"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                     "logprobs": []},
                    {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        elif item["type"] == "function_call":
            out += [{"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                    {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]}]
        out.append({"type": "response.output_item.done", "output_index": index, "item": item})
    out.append({"type": "response.incomplete" if final["status"] == "incomplete" else "response.completed",
                "response": final})
    return [f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': n}, ensure_ascii=False)}\n\n"
            for n, e in enumerate(out)]
