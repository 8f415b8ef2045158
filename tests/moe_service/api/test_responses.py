"""The Responses API (moe_service.api.responses) over the real engine loop and the fake model:
the prompt each input shape becomes (checked through the fake model's greedy chain, which
depends on every prompt token), previous_response_id and the store's bound, store=false,
probes, the typed event order, errors naming the field with nothing reaching the engine; and
the output builder's items and events for reasoning, text and calls (parser deltas made here,
since the fake vocabulary writes neither reasoning nor calls). The demo model's tool calls,
custom grammars and JSON answers are in tests/e2e/test_responses_e2e.py."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from moe_service.api import tools as tl
from moe_service.api.response_store import ResponseStore
from moe_service.api.responses import ENCRYPTED_PREFIX, OutputBuilder, encode_reasoning
from tests.support.serving_stack import MODEL, TOK, Stack, greedy_text
from tests.support.smollm2 import needs_smollm2

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def expected(prompt_text: str, n: int) -> str:
    """The fake model's greedy answer to the rendered prompt (its template: ``role: content``
    lines after ``<s>``, then ``assistant: ``)."""
    return greedy_text(TOK.encode(prompt_text, parse_special=True), n)


def create(client, **body):
    r = client.post("/v1/responses", json={"model": MODEL, "temperature": 0, **body})
    return r


def output_text(resp: dict) -> str:
    return "".join(p["text"] for it in resp["output"] if it["type"] == "message" for p in it["content"])


def sse(lines) -> list[dict]:
    """(event name, data) pairs of a Responses stream, the event line checked against the data's type."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
            assert data["type"] == name
            out.append(data)
    return out


# -- the prompt each input becomes ----------------------------------------------------------------


def test_string_input_instructions_and_developer_messages_become_one_system_message(client):
    r = create(
        client,
        instructions="Be brief.",
        max_output_tokens=6,
        input=[
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Dev rules."}],
            },
            {"role": "user", "content": "hi"},
        ],
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert output_text(body) == expected("<s>system: Be brief.\n\nDev rules.\nuser: hi\nassistant: ", 6)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 6
    assert body["usage"]["input_tokens"] == len(
        TOK.encode("<s>system: Be brief.\n\nDev rules.\nuser: hi\nassistant: ", parse_special=True)
    )
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    assert body["output"][0]["type"] == "message" and body["output"][0]["status"] == "incomplete"

    r = create(client, input="hi", max_output_tokens=4)
    assert output_text(r.json()) == expected("<s>user: hi\nassistant: ", 4)


def test_function_call_items_and_outputs_reach_the_template_as_tool_turns(client):
    items = [
        {"role": "user", "content": "weather?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
        {"type": "web_search"},
        {"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "x"}]},
    ]
    r = create(
        client,
        input=items,
        tools=tools,
        tool_choice="none",
        max_output_tokens=5,
        prompt_cache_key="k",
        client_metadata={"a": "b"},
        include=["reasoning.encrypted_content"],
        store=False,
    )
    assert r.status_code == 200, r.text
    # the fake template renders no tools or calls natively: the hermes fallback writes them as text
    # (tools in the system message, the call as <tool_call>, the result as a <tool_response> user turn)
    rendered = tl.prepare_messages(
        tl.ChatFormat(),
        [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        None,
    )[0]
    prompt = "<s>" + "".join(f"{m['role']}: {m['content']}\n" for m in rendered) + "assistant: "
    assert output_text(r.json()) == expected(prompt, 5)
    assert r.json()["store"] is False


def test_previous_response_id_continues_the_stored_conversation(client):
    first = create(client, input="hi", max_output_tokens=3, instructions="Sys.").json()
    answer = output_text(first)
    second = create(client, input="more", previous_response_id=first["id"], max_output_tokens=4)
    assert second.status_code == 200, second.text
    # instructions are not carried over (OpenAI's rule); the first answer is an assistant turn
    assert output_text(second.json()) == expected(
        f"<s>user: hi\nassistant: {answer}\nuser: more\nassistant: ", 4
    )
    assert second.json()["previous_response_id"] == first["id"]
    # a chain: the third turn sees both before it
    third = create(client, input="end", previous_response_id=second.json()["id"], max_output_tokens=2)
    answer2 = output_text(second.json())
    assert output_text(third.json()) == expected(
        f"<s>user: hi\nassistant: {answer}\nuser: more\nassistant: {answer2}\nuser: end\nassistant: ", 2
    )
    got = client.get(f"/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json()["id"] == first["id"] and output_text(got.json()) == answer
    assert client.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
    gone = create(client, input="x", previous_response_id=first["id"])
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "previous_response_id"
    assert client.get(f"/v1/responses/{first['id']}").status_code == 404


def test_store_false_keeps_nothing(client, stack):
    r = create(client, input="hi", max_output_tokens=2, store=False).json()
    follow = create(client, input="more", previous_response_id=r["id"])
    assert follow.status_code == 400 and follow.json()["error"]["code"] == "previous_response_not_found"
    assert len(stack.service.responses_store) == 0


def test_store_evicts_least_recently_used_within_its_bound():
    store = ResponseStore(max_bytes=600)
    item = [{"type": "message", "role": "user", "content": "x" * 100}]
    for i in range(5):
        assert store.put(f"resp_{i}", item, {"id": f"resp_{i}"})
        store.get("resp_0")  # kept warm
    assert store.size_bytes <= 600 and store.evicted > 0
    assert store.get("resp_0") is not None and store.get("resp_1") is None
    assert not store.put("big", [{"content": "y" * 1000}], {})  # larger than the whole store: not kept
    got = store.get("resp_0")
    got.items.append("changed")  # a copy: the store is unchanged
    assert len(store.get("resp_0").items) == 1


def test_no_output_limit_gets_the_rest_of_the_context_not_max_tokens_default(client, stack):
    r = create(client, input="hi")  # the fake engine's max_tokens_default is 16
    body = r.json()
    assert body["usage"]["output_tokens"] > 16 or body["status"] == "completed"
    assert body["usage"]["input_tokens"] + body["usage"]["output_tokens"] <= stack.engine.n_ctx


def prompt_tokens_counted(stack) -> float:
    return stack.metrics.registry.get_sample_value("moe_service_prompt_tokens_total") or 0.0


def test_empty_probe_gets_an_empty_completed_response_without_generation(client, stack):
    before = prompt_tokens_counted(stack)
    for body in ({}, {"input": []}, {"input": ""}, {"input": "hi", "generate": False}):
        r = client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "completed" and r.json()["output"] == []
        assert r.json()["usage"]["input_tokens"] == 0
    with client.stream("POST", "/v1/responses", json={"input": [], "stream": True}) as r:
        kinds = [e["type"] for e in sse(r.iter_lines())]
    assert kinds == ["response.created", "response.in_progress", "response.completed"]
    assert prompt_tokens_counted(stack) == before  # the engine ran nothing


# -- the stream -----------------------------------------------------------------------------------


def test_stream_events_in_order_with_sequence_numbers(client):
    with client.stream(
        "POST",
        "/v1/responses",
        json={"input": "hi", "max_output_tokens": 5, "temperature": 0, "stream": True},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        evs = sse(r.iter_lines())
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert text == expected("<s>user: hi\nassistant: ", 5)
    assert evs[-4]["text"] == text and evs[-2]["item"]["content"][0]["text"] == text
    assert evs[0]["response"]["status"] == "in_progress" and evs[-1]["response"]["status"] == "incomplete"
    assert evs[-1]["response"]["output"] == [evs[-2]["item"]]


# -- errors ---------------------------------------------------------------------------------------

BAD = [
    ({"input": [{"type": "bogus_item"}]}, "input.0.type", "invalid_value"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input.0.content.0.type",
        "unsupported_parameter",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "weird"}]}]},
        "input.0.content.0.type",
        "invalid_value",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]},
        "input.0.arguments",
        "invalid_value",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
        "input.0.arguments",
        "invalid_value",
    ),
    (
        {
            "input": [
                {"role": "user", "content": "q"},
                {"type": "function_call_output", "call_id": "nope", "output": "x"},
            ]
        },
        "input.1.call_id",
        "invalid_value",
    ),
    (
        {"input": "hi", "previous_response_id": "resp_missing"},
        "previous_response_id",
        "previous_response_not_found",
    ),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name", None),
    ({"input": "hi", "tools": [{"type": "teleport"}]}, "tools.0.type", "invalid_value"),
    (
        {
            "input": "hi",
            "tools": [
                {
                    "type": "custom",
                    "name": "c",
                    "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"},
                }
            ],
        },
        "tools.0.format.syntax",
        None,
    ),
    (
        {
            "input": "hi",
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "function", "name": "g"},
        },
        "tool_choice.name",
        None,
    ),
    (
        {"input": "hi", "tool_choice": {"type": "web_search_preview"}},
        "tool_choice.type",
        "unsupported_parameter",
    ),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type", None),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "hi", "model": "gpt-5"}, "model", "model_not_found"),
    ({"input": "hi", "background": True}, "background", "unsupported_parameter"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "unsupported_parameter"),
    ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input.0.role", "invalid_value"),
]


@pytest.mark.parametrize("body,param,code", BAD, ids=[b[1] for b in BAD])
def test_bad_input_names_the_field_and_nothing_reaches_the_engine(client, stack, body, param, code):
    before = prompt_tokens_counted(stack)
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code
    if code not in ("model_not_found", "context_length_exceeded"):  # those use OpenAI's own wording
        assert err["message"].startswith(param)
    assert prompt_tokens_counted(stack) == before  # nothing reached the engine
    ok = create(client, input="hi", max_output_tokens=2)  # the process carries on
    assert ok.status_code == 200


def test_output_limit_over_the_context_is_clamped_by_default_and_refused_under_refuse(client, stack):
    r = create(client, input="hi", max_output_tokens=100000)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["input_tokens"] + body["usage"]["output_tokens"] == stack.engine.n_ctx
    stack.service.max_tokens_policy = "refuse"
    r = create(client, input="hi", max_output_tokens=100000)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "max_output_tokens"


def test_unknown_fields_are_accepted_on_responses_only(client):
    r = create(
        client,
        input="hi",
        max_output_tokens=2,
        prompt_cache_key="p",
        client_metadata={"x": "y"},
        safety_identifier="s",
        service_tier="auto",
        stream_options={"include_obfuscation": False},
        some_future_field={"a": 1},
    )
    assert r.status_code == 200, r.text
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_cache_key": "p"},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_cache_key"


# -- the output builder (deltas made here) --------------------------------------------------------


def test_builder_reasoning_text_and_calls_items_and_event_order():
    b = OutputBuilder(custom=["apply_patch"], encrypted_reasoning=True)
    evs = b.feed([tl.Delta("reasoning", "let me "), tl.Delta("reasoning", "think")])
    evs += b.feed([tl.Delta("content", "\n\n")])  # whitespace before a call: dropped
    evs += b.feed([tl.Delta("tool_call", call=tl.ToolCall("get_weather", '{"city": "Paris"}', id="call_a"))])
    evs += b.feed(
        [tl.Delta("tool_call", call=tl.ToolCall("apply_patch", '{"input": "*** Begin Patch"}', id="call_b"))]
    )
    evs += b.feed([tl.Delta("content", "Done.")])
    evs += b.finish(incomplete=False)
    kinds = [e["type"] for e in evs]
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    reasoning, call, custom, message = b.items
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "let me think"}
    ]
    assert reasoning["encrypted_content"] == ENCRYPTED_PREFIX + base64.b64encode(b"let me think").decode()
    assert call == {
        "id": call["id"],
        "type": "function_call",
        "status": "completed",
        "call_id": "call_a",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert (
        custom["type"] == "custom_tool_call"
        and custom["input"] == "*** Begin Patch"
        and custom["call_id"] == "call_b"
    )
    assert message["content"][0]["text"] == "Done."
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.done"] == [0, 1, 2, 3]


def test_builder_raw_custom_answer_is_one_call_and_empty_answer_one_empty_message():
    b = OutputBuilder(custom=["calc"], raw_custom="calc")
    evs = b.feed([tl.Delta("content", "ADD 1"), tl.Delta("content", " 2")]) + b.finish(incomplete=True)
    assert [e["type"] for e in evs] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]
    assert (
        b.items[0]["input"] == "ADD 1 2"
        and b.items[0]["name"] == "calc"
        and b.items[0]["status"] == "incomplete"
    )
    e = OutputBuilder()
    e.finish(incomplete=False)
    assert e.items[0]["type"] == "message" and e.items[0]["content"][0]["text"] == ""


def test_reasoning_items_round_trip_into_the_next_assistant_turn(client, stack):
    """A reasoning item (its content, or our encrypted_content) becomes the next assistant turn's
    reasoning_content: the fake template ignores it, so the prompt is unchanged, and foreign
    encrypted content is dropped, not refused."""
    items = [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": encode_reasoning("hmm")},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAAA-openai-opaque"},
        {"role": "user", "content": "again"},
    ]
    r = create(client, input=items, max_output_tokens=3)
    assert r.status_code == 200, r.text
    assert output_text(r.json()) == expected("<s>user: hi\nassistant: yo\nuser: again\nassistant: ", 3)
    from moe_service.api.responses import ResponsesBody, to_chat

    req = to_chat(ResponsesBody(input=items), [], items)
    assert req.messages[1] == {"role": "assistant", "content": "yo", "reasoning_content": "hmm"}


def test_codex_first_request_is_served():
    """Codex 0.171's first request (captured from `codex exec`; texts shortened): developer
    messages, function tools beside a namespace and a web_search tool, store false, include,
    prompt_cache_key, client_metadata, no output limit, stream. Served, not refused."""
    from moe_service.api.responses import ResponsesBody, input_items, to_chat

    body = json.loads((FIXTURES / "codex_0171_first_request.json").read_text())
    req = to_chat(ResponsesBody.model_validate(body), [], input_items(body["input"]))
    assert [m["role"] for m in req.messages] == ["system", "user", "user"]
    assert [t["function"]["name"] for t in req.tools] == [
        "exec_command",
        "write_stdin",
        "request_user_input",
        "view_image",
        "get_goal",
        "create_goal",
        "update_goal",
    ]
    s = Stack(n_ctx=32768)
    try:
        with (
            TestClient(s.app) as c,
            c.stream("POST", "/v1/responses", json={**body, "max_output_tokens": 3}) as r,
        ):
            assert r.status_code == 200
            evs = sse(r.iter_lines())
    finally:
        s.close()
    assert evs[-1]["type"] == "response.incomplete" and evs[-1]["response"]["store"] is False


def test_models_card_gives_the_served_context(client, stack):
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["context_length"] == stack.engine.n_ctx


def test_to_chat_turns_items_and_tools_into_the_chat_request():
    from moe_service.api.responses import ResponsesBody, to_chat

    items = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "*** Begin"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "r1"}]},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "only a summary"}]},
        {"role": "user", "content": "next"},
    ]
    tools = [
        {"type": "function", "name": "f", "parameters": {"type": "object"}},
        {
            "type": "custom",
            "name": "patch",
            "description": "Edit files.",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
        },
        {
            "type": "custom",
            "name": "code",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]+"},
        },
    ]
    body = ResponsesBody(
        input=items,
        instructions="I",
        tools=tools,
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "f"}, {"type": "custom", "name": "patch"}],
        },
    )
    req = to_chat(body, [], items)
    assert req.messages == [
        {"role": "system", "content": "I\n\nS"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "think",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "patch", "arguments": '{"input": "*** Begin"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        {"role": "user", "content": "next"},
    ]
    assert req.tool_choice == "required" and [t["function"]["name"] for t in req.tools] == ["f", "patch"]
    patch = req.tools[1]["function"]
    assert patch["parameters"]["properties"] == {"input": {"type": "string"}}
    assert "start: /.+/" in patch["description"] and patch["description"].startswith("Edit files.")
    assert set(req.custom) == {"patch", "code"} and req.forced_custom is None
    named = to_chat(
        ResponsesBody(input="x", tools=tools, tool_choice={"type": "custom", "name": "code"}),
        [],
        [{"role": "user", "content": "x"}],
    )
    assert named.forced_custom == "code" and named.tool_choice == {
        "type": "function",
        "function": {"name": "code"},
    }
    code = next(t for t in named.tools if t["function"]["name"] == "code")["function"]
    assert code["parameters"]["properties"]["input"] == {"type": "string", "pattern": "[0-9]+"}


def test_engine_failure_is_a_500_or_response_failed_and_nothing_is_stored():
    poison = TOK.encode("z")[-1]
    s = Stack(poison=poison)
    try:
        with TestClient(s.app) as c:
            r = c.post("/v1/responses", json={"input": "zzz", "max_output_tokens": 3})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert "poisoned" in r.json()["error"]["message"]
            with c.stream(
                "POST", "/v1/responses", json={"input": "zz", "max_output_tokens": 3, "stream": True}
            ) as st:
                evs = sse(st.iter_lines())
            assert [e["type"] for e in evs] == ["response.created", "response.in_progress", "response.failed"]
            failed = evs[-1]["response"]
            assert failed["status"] == "failed" and "poisoned" in failed["error"]["message"]
            assert len(s.service.responses_store) == 0
            assert c.post("/v1/responses", json={"input": "ab", "max_output_tokens": 2}).status_code == 200
    finally:
        s.close()


@needs_smollm2
@pytest.mark.parametrize("reasoning", [False, True])
def test_custom_grammar_admits_only_the_tools_language_after_optional_reasoning(reasoning):
    """custom_grammar on SmolLM2's real vocabulary: the Lark grammar (its own rule names,
    `start` included, kept apart as @custom) and a regex with a '/' in it; with a thinking
    model, an optional <think> block first."""
    from moe_service.api.responses import custom_grammar
    from moe_service.demo_model import smollm2_gguf_path
    from moe_service.engine.tokenizer import Tokenizer
    from tests.moe_service.api.test_tools import _accepts

    tok = Tokenizer.from_file(smollm2_gguf_path())
    fmt = tl.ChatFormat(reasoning=reasoning)
    lark = custom_grammar(
        fmt,
        "lark",
        'start: calls\ncalls: "ADD " NUM " " NUM\nNUM: /[0-9]{1,3}/',
        reasoning_open=False,
        reasoning_allowed=True,
    )
    assert _accepts(tok, lark, "ADD 12 30")
    assert not _accepts(tok, lark, "SUB 12 30") and not _accepts(tok, lark, "ADD 1234 1")
    assert _accepts(tok, lark, "<think>sum it</think>\nADD 1 2") == reasoning
    rx = custom_grammar(fmt, "regex", "[a-z]+/[0-9]{2}", reasoning_open=False, reasoning_allowed=False)
    assert _accepts(tok, rx, "src/42") and not _accepts(tok, rx, "src/4")
