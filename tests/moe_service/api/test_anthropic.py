"""The Anthropic Messages API over the real engine loop and the fake model: the conversion into
chat messages, answers and named SSE events, stop reasons, the clamp policy, count_tokens, and
Anthropic's error envelope for every refusal on /v1/messages (400s naming the field, the
middleware's 401/413/415, the 429 of a full queue, 404/405), with nothing reaching the engine.
The official SDK against the demo model: tests/e2e/test_anthropic_e2e.py."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from moe_service.api import anthropic as an
from moe_service.api.auth import ApiKeys
from moe_service.engine.engine import RequestError
from moe_service.server import create_app
from tests.support.serving_stack import MODEL, TOK, Stack, greedy_text


def prompt_ids(text):
    return TOK.encode(f"<s>user: {text}\nassistant: ", parse_special=True)


def body(**kw):
    return {
        "model": MODEL,
        "max_tokens": 6,
        "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}],
        **kw,
    }


def named_events(lines):
    """[(event name, data)] of an SSE stream."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[len("data: ") :])))
    return out


def assert_envelope(r, status, etype, *words):
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error"
    assert err["error"]["type"] == etype and set(err["error"]) == {"type", "message"}
    for w in words:
        assert w in err["error"]["message"], (w, err)


# -- conversion ---------------------------------------------------------------------------------


def _chat(**kw):
    return an.to_chat_messages(an.MessagesBody.model_validate(body(**kw)))


def test_system_blocks_tool_results_and_history_become_chat_messages():
    msgs = _chat(
        system=[
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": " Really."},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "no clock"}],
                    },
                    {"type": "text", "text": "and now?"},
                ],
            },
        ],
    )
    assert msgs == [
        {"role": "system", "content": "Be brief. Really."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "use the tool",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                },
                {"id": "toolu_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no clock"},
        {"role": "user", "content": "and now?"},
    ]


def test_claude_codes_billing_header_is_dropped_so_turns_share_their_prefix():
    """Its cch hash changes with every request: kept first in the prompt, no turn would hit the
    prefix cache."""
    for cch in ("3f2a1", "9b0c4"):
        header = f"x-anthropic-billing-header: cc_version=2.1.197.fa0; cc_entrypoint=cli; cch={cch};"
        msgs = _chat(
            system=[
                {"type": "text", "text": header},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            ]
        )
        assert msgs[0] == {"role": "system", "content": "You are Claude Code."}
        assert _chat(system=header + "\nYou are terse.")[0] == {"role": "system", "content": "You are terse."}
    assert _chat(system="Mention x-anthropic-billing-header: here")[0]["content"].startswith("Mention")


BAD = [
    # (messages / fields, param named, words)
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}
            ]
        },
        "messages.0.content.0.type",
        "image blocks are not supported",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "document", "source": {}}],
                }
            ]
        },
        "messages.0.content.1.type",
        "document blocks",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
        "messages.0.content.0.type",
        "'hologram'",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}],
                },
            ]
        },
        "messages.2.content.0.tool_use_id",
        "toolu_1",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}],
                }
            ]
        },
        "messages.0.content.0.tool_use_id",
        "previous assistant message",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "image", "source": {}}],
                        }
                    ],
                }
            ]
        },
        "messages.0.content.0.tool_use_id",
        "does not answer",
    ),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role", "'system'"),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]},
        "messages.1",
        "prefill",
    ),
    ({"messages": []}, "messages", "at least one"),
    ({"system": [{"type": "image"}]}, "system.0.type", "image"),
]


@pytest.mark.parametrize("fields,param,words", BAD, ids=[b[1] for b in BAD])
def test_bad_blocks_are_refused_naming_the_field(fields, param, words):
    with pytest.raises(RequestError) as e:
        _chat(**fields)
    assert e.value.param == param and words in e.value.message and e.value.status == 400


def test_tools_tool_choice_and_thinking_switches():
    tools, index = an.to_chat_tools(
        [
            {"name": "get_weather", "description": "w", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search"},  # a server tool: skipped
            {"type": "custom", "name": "get_time", "input_schema": {"type": "object", "properties": {}}},
        ]
    )
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"] and index == [0, 2]
    assert an.to_chat_tool_choice({"type": "any"}, tools) == ("required", None)
    assert an.to_chat_tool_choice({"type": "any", "disable_parallel_tool_use": True}, tools) == (
        "required",
        False,
    )
    assert an.to_chat_tool_choice({"type": "tool", "name": "get_time"}, tools) == (
        {"type": "function", "function": {"name": "get_time"}},
        None,
    )
    assert an.to_chat_tool_choice({"type": "none"}, tools) == ("none", None)
    assert an.to_chat_tool_choice({"type": "auto"}, []) == (None, None)
    for choice, param in [
        ({"type": "tool", "name": "nope"}, "tool_choice.name"),
        ({"type": "any"}, "tool_choice.type"),
        ({"type": "sometimes"}, "tool_choice.type"),
    ]:
        with pytest.raises(RequestError) as e:
            an.to_chat_tool_choice(choice, tools if choice["type"] != "any" else [])
        assert e.value.param == param
    with pytest.raises(RequestError) as e:
        an.to_chat_tools([{"name": "ok", "input_schema": {}}, {"name": "bad name!", "input_schema": {}}])
    assert e.value.param == "tools.1.name"
    with pytest.raises(RequestError) as e:
        an.to_chat_tools([{"name": "ok"}])
    assert e.value.param == "tools.0.input_schema"

    def switches(**kw):
        return an.template_switches(an.CountTokensBody.model_validate({"model": "m", "messages": [], **kw}))

    assert switches(thinking={"type": "enabled", "budget_tokens": 1024}) == (
        {"enable_thinking": True, "thinking": True},
        None,
    )
    assert switches(thinking={"type": "disabled"}) == ({"enable_thinking": False, "thinking": False}, None)
    assert switches(thinking={"type": "adaptive"}, output_config={"effort": "max"}) == ({}, "high")
    assert switches(output_config={"effort": "extreme"}) == ({}, None)


# -- answers ------------------------------------------------------------------------------------


def test_message_answer_usage_and_unknown_fields_accepted(client):
    r = client.post(
        "/v1/messages?beta=true",
        json=body(
            context_management={"edits": []},
            output_config={"effort": "high"},
            thinking={"type": "adaptive"},
            metadata={"user_id": "u"},
        ),
        headers={"anthropic-version": "2023-06-01", "anthropic-beta": "a,b"},
    )
    assert r.status_code == 200, r.text
    m = r.json()
    assert (
        m["type"] == "message"
        and m["role"] == "assistant"
        and m["model"] == MODEL
        and m["id"].startswith("msg_")
    )
    assert r.headers["request-id"] == m["id"]
    assert m["content"] == [{"type": "text", "text": greedy_text(prompt_ids("hi"), 6)}]
    assert m["stop_reason"] == "max_tokens" and m["stop_sequence"] is None
    assert m["usage"] == {
        "input_tokens": len(prompt_ids("hi")),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 6,
    }


def test_stop_sequence_is_named(client):
    full = greedy_text(prompt_ids("hi"), 12)
    stop = full[5:7]
    r = client.post("/v1/messages", json=body(max_tokens=12, stop_sequences=["zzz", stop]))
    m = r.json()
    assert m["stop_reason"] == "stop_sequence" and m["stop_sequence"] == stop
    assert m["content"][0]["text"] == full[: full.index(stop)]


def test_stream_named_events_in_order(client):
    with client.stream("POST", "/v1/messages", json=body(stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = named_events(r.iter_lines())
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[2] == "content_block_start" and names[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(n == "content_block_delta" for n in names[3:-3])
    assert all(d["type"] == n for n, d in events)
    start = events[0][1]["message"]
    assert (
        start["content"] == []
        and start["stop_reason"] is None
        and start["usage"]["input_tokens"] == len(prompt_ids("hi"))
    )
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == greedy_text(prompt_ids("hi"), 6)
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6


def test_clamp_serves_what_fits_and_ends_with_max_tokens(client, stack):
    r = client.post("/v1/messages", json=body(max_tokens=32000))
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["stop_reason"] == "max_tokens"
    assert m["usage"]["output_tokens"] == stack.engine.n_ctx - len(prompt_ids("hi"))
    stack.service.max_tokens_policy = "refuse"  # the operator's choice wins over the endpoint's
    r = client.post("/v1/messages", json=body(max_tokens=32000))
    assert_envelope(r, 400, "invalid_request_error", "max_tokens", "maximum context length")


def test_count_tokens_is_the_prompt_the_message_would_run(client):
    r = client.post(
        "/v1/messages/count_tokens",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "context_management": {}},
    )
    assert r.status_code == 200 and r.json() == {"input_tokens": len(prompt_ids("hi"))}
    r = client.post(
        "/v1/messages/count_tokens",
        json={"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    )
    assert_envelope(r, 400, "invalid_request_error", "messages.0.content.0")


# -- refusals: Anthropic's envelope, nothing reaches the engine -----------------------------------


@pytest.fixture
def spied(stack):
    """Counts what reaches the engine: BatchLoop.submit and the chat template."""
    calls = []
    submit, render = stack.batch.submit, stack.engine.render_chat

    def spy_submit(*a, **k):
        calls.append("submit")
        return submit(*a, **k)

    def spy_render(*a, **k):
        calls.append("render")
        return render(*a, **k)

    stack.batch.submit, stack.engine.render_chat = spy_submit, spy_render
    return calls


def test_bad_requests_get_the_envelope_and_reach_nothing(client, spied):
    cases = [
        (
            body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            "messages.0.content.0",
        ),
        (body(model="claude-sonnet-4-5"), "does not exist"),
        ({**body(), "max_tokens": 0}, "max_tokens"),
        ({k: v for k, v in body().items() if k != "max_tokens"}, "max_tokens: this field is required"),
        (body(temperature=1.5), "temperature"),
        (body(stop_sequences=[""]), "stop_sequences.0"),
        (body(thinking={"type": "sometimes"}), "thinking.type"),
    ]
    for payload, words in cases:
        r = client.post("/v1/messages", json=payload)
        assert_envelope(r, 400, "invalid_request_error", words)
    r = client.post("/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"})
    assert_envelope(r, 400, "invalid_request_error", "JSON")
    assert spied == []
    ok = client.post("/v1/messages", json=body())
    assert ok.status_code == 200 and spied == ["render", "submit"]


def test_middleware_refusals_use_the_envelope_on_messages_only(stack):
    stack.service.keys = ApiKeys(["sk-good"])
    stack.service.max_body_bytes = 2000
    with TestClient(create_app(stack.service)) as c:
        r = c.post("/v1/messages", json=body())
        assert_envelope(r, 401, "authentication_error", "x-api-key")
        r = c.post("/v1/messages", json=body(), headers={"x-api-key": "sk-bad"})
        assert_envelope(r, 401, "authentication_error", "Incorrect API key")
        key = {"x-api-key": "sk-good"}
        assert c.post("/v1/messages", json=body(), headers=key).status_code == 200
        assert (
            c.post(
                "/v1/messages/count_tokens",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                headers=key,
            ).status_code
            == 200
        )
        r = c.post(
            "/v1/messages", content=json.dumps(body()).encode(), headers={**key, "content-type": "text/plain"}
        )
        assert_envelope(r, 415, "invalid_request_error", "Content-Type")
        r = c.post("/v1/messages", json=body(system="x" * 3000), headers=key)
        assert_envelope(r, 413, "request_too_large", "serve.max_body_bytes")
        r = c.get("/v1/messages", headers=key)
        assert_envelope(r, 405, "invalid_request_error", "Method Not Allowed")
        r = c.post("/v1/messages/nothing", json=body(), headers=key)
        assert_envelope(r, 404, "not_found_error")
        # chat completions keep OpenAI's error object
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": "sk-bad"},
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_full_queue_is_a_429_rate_limit_error(stack, client):
    stack.batch.queue_size = 0
    stack.batch.parallel = 0  # every place taken
    r = client.post("/v1/messages", json=body())
    assert_envelope(r, 429, "rate_limit_error")
    assert r.headers["retry-after"] == "2"


def test_model_aliases_answer_with_the_name_sent(stack):
    stack.service.model_aliases = ("claude-*",)
    with TestClient(create_app(stack.service)) as c:
        for name in ("claude-sonnet-4-5-20250929", "claude-haiku-4-5"):
            r = c.post("/v1/messages", json=body(model=name))
            assert r.status_code == 200 and r.json()["model"] == name


def test_blocks_from_reasoning_text_and_calls_streamed_and_whole():
    """A reasoning model's output as the parser splits it: thinking, then text, then a call
    (whitespace before the call dropped), as blocks and as events that rebuild them."""
    from moe_service.api import tools as tl

    call = tl.ToolCall("get_time", '{"zone": "UTC"}', id="call_abc")
    deltas = [
        tl.Delta("reasoning", "Need the "),
        tl.Delta("reasoning", "time."),
        tl.Delta("content", "Checking"),
        tl.Delta("content", ".\n"),
        tl.Delta("content", "\n"),
        tl.Delta("tool_call", call=call),
    ]
    for pieces in ([deltas], [[d] for d in deltas]):
        blocks = an._Blocks()
        events = []
        for i, part in enumerate(pieces):
            events += blocks.add(part, final=i == len(pieces) - 1)
        assert blocks.blocks == [
            {"type": "thinking", "thinking": "Need the time.", "signature": ""},
            {"type": "text", "text": "Checking.\n"},
            {"type": "tool_use", "id": "toolu_abc", "name": "get_time", "input": {"zone": "UTC"}},
        ]
        assert blocks.n_calls == 1
        # the events rebuild the same blocks, each opened, filled and closed in order
        rebuilt: dict[int, dict] = {}
        open_ = set()
        for name, data in events:
            i = data["index"]
            if name == "content_block_start":
                assert i not in rebuilt and not open_
                rebuilt[i] = dict(data["content_block"])
                open_.add(i)
            elif name == "content_block_delta":
                assert i in open_
                d = data["delta"]
                if d["type"] == "text_delta":
                    rebuilt[i]["text"] += d["text"]
                elif d["type"] == "thinking_delta":
                    rebuilt[i]["thinking"] += d["thinking"]
                elif d["type"] == "signature_delta":
                    rebuilt[i]["signature"] += d["signature"]
                else:
                    assert d["type"] == "input_json_delta"
                    rebuilt[i]["input"] = json.loads(d["partial_json"])
            else:
                assert name == "content_block_stop" and i in open_
                open_.remove(i)
        assert not open_ and [rebuilt[i] for i in sorted(rebuilt)] == blocks.blocks
    ev = type("Ev", (), {"finish_reason": "stop", "stop_sequence": None})
    assert an.stop_reason(ev, True) == "tool_use" and an.stop_reason(ev, False) == "end_turn"
    ev.finish_reason = "length"
    assert an.stop_reason(ev, True) == "max_tokens"


def test_engine_failure_is_an_api_error_and_a_streamed_error_event():
    poison = TOK.encode("z")[-1]
    s = Stack(poison=poison)
    try:
        with TestClient(s.app) as c:
            bad = body(messages=[{"role": "user", "content": "zzz"}])
            r = c.post("/v1/messages", json=bad)
            assert_envelope(r, 500, "api_error", "poisoned")
            with c.stream("POST", "/v1/messages", json={**bad, "stream": True}) as st:
                events = named_events(st.iter_lines())
            assert events[0][0] == "message_start" and events[-1][0] == "error"
            assert events[-1][1]["type"] == "error" and events[-1][1]["error"]["type"] == "api_error"
            assert c.post("/v1/messages", json=body()).status_code == 200
    finally:
        s.close()
