"""The gateway's Responses and Messages APIs with the official `openai` and `anthropic` SDKs: tool calls round-trip
in each protocol's own items and blocks, streamed or not, and the trajectory holds exactly the tokens sampled, in one
segment (the history each client sends back is matched, not re-tokenized)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.test_gateway import CALC, CALL, assert_exact, serve

FLAT_CALC = {"type": "function", **CALC["function"]}  # the Responses API's function tool
CLAUDE_CALC = {"name": "calculator", "description": CALC["function"]["description"],
               "input_schema": CALC["function"]["parameters"]}
ANSWER = "<answer>5</answer>"


def anthropic_client(server, sid: str) -> anthropic.Anthropic:
    opened = httpx.get(f"{server.url}/sessions/{sid}").json()
    assert opened["id"] == sid
    return anthropic.Anthropic(base_url=f"{server.url}/sessions/{sid}", api_key="none", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_round_trip_tool_calls_with_exact_tokens(renderer, stream):
    server, policy = serve(renderer, [f"Let me compute.\n{CALL}", ANSWER])
    try:
        sid, client = server.session(task_id="t1")
        items = [{"role": "user", "content": "2+3?"}]

        def ask():
            if not stream:
                return client.responses.create(model="m", instructions="You add numbers.", input=items,
                                               tools=[FLAT_CALC], store=False)
            with client.responses.stream(model="m", instructions="You add numbers.", input=items,
                                         tools=[FLAT_CALC], store=False) as events:
                kinds = [e.type for e in events]
                assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
                return events.get_final_response()

        first = ask()
        message, call = first.output
        assert message.content[0].text == "Let me compute." and first.status == "completed"
        assert call.type == "function_call" and call.name == "calculator"
        assert json.loads(call.arguments) == {"expression": "2+3"}
        assert first.usage.input_tokens == len(policy.calls[0][0])
        items += [item.model_dump(exclude_none=True) for item in first.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
        second = ask()
        assert second.output_text == ANSWER and second.usage.output_tokens == len(policy.calls[1][1])
        [trajectory] = server.reward(sid, 1.0)
    finally:
        server.stop()
    assert_exact(trajectory, policy.calls)  # one segment: the sent-back items matched what was sampled
    assert trajectory.task_id == "t1" and trajectory.reward == 1.0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_round_trip_tool_use_with_exact_tokens(renderer, stream):
    server, policy = serve(renderer, [f"Let me compute.\n{CALL}", ANSWER])
    try:
        sid, _ = server.session(task_id="t2")
        client = anthropic_client(server, sid)
        messages = [{"role": "user", "content": "2+3?"}]

        def ask():
            kwargs = dict(model="m", max_tokens=64, system="You add numbers.", messages=messages, tools=[CLAUDE_CALC])
            if not stream:
                return client.messages.create(**kwargs)
            with client.messages.stream(**kwargs) as events:
                kinds = [e.type for e in events]
                assert kinds[0] == "message_start" and "content_block_delta" in kinds
                return events.get_final_message()

        first = ask()
        text, use = first.content
        assert text.text == "Let me compute." and first.stop_reason == "tool_use"
        assert use.type == "tool_use" and use.name == "calculator" and use.input == {"expression": "2+3"}
        assert first.usage.input_tokens == len(policy.calls[0][0])
        messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
        second = ask()
        assert second.content[0].text == ANSWER and second.stop_reason == "end_turn"
        assert second.usage.output_tokens == len(policy.calls[1][1])
        [trajectory] = server.reward(sid, 1.0)
    finally:
        server.stop()
    assert_exact(trajectory, policy.calls)
    assert trajectory.task_id == "t2"


def test_what_a_protocol_cannot_honour_is_refused_in_its_own_shape(renderer):
    server, policy = serve(renderer, ["never sampled"])
    try:
        sid, client = server.session()
        claude = anthropic_client(server, sid)
        with pytest.raises(anthropic.BadRequestError, match="top_k") as refused:
            claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"top_k": 5})
        assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.BadRequestError, match="server tools"):
            claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                   tools=[{"type": "web_search_20250305", "name": "web_search"}])
        with pytest.raises(anthropic.BadRequestError, match="image"):
            claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
        with pytest.raises(anthropic.BadRequestError, match=r"edits\[0\]: the gateway keeps no history"):
            claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}], extra_body={
                "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns",
                                                                                            "value": 1}}]}})
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            client.responses.create(model="m", input="hi", previous_response_id="resp_1")
        with pytest.raises(openai.BadRequestError, match="only function tools"):
            client.responses.create(model="m", input="hi", tools=[{"type": "web_search"}])
        with pytest.raises(openai.BadRequestError, match="input_image"):
            client.responses.create(model="m", input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}])
    finally:
        server.stop()
    assert policy.calls == []  # nothing refused reached the policy
