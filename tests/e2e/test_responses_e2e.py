"""End to end: the Responses API of `moe-service serve` on the demo model, driven by the
official openai client (``client.responses``), streamed and not: plain answers, a function-tool
round trip through function_call_output, custom tools (a Lark and a regex grammar enforced, a
text one), text.format json_schema 20/20 at temperature 1, previous_response_id, the typed
event sequence in order, cached tokens on a second turn, and bad inputs as 400s naming the
field while the server carries on.

The server is the session fixture of tests/e2e/test_serve_e2e.py (one process for both files).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.test_serve_e2e import (  # noqa: F401 - the shared session fixtures
    API_KEY,
    MODEL_ID,
    demo_model,
    e2e_cache,
    key_file,
    service,
)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# Codex's own tool list carries these: they are skipped, not refused
HOSTED = [
    {"type": "web_search", "external_web_access": False},
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "sub-agents",
        "tools": [{"type": "function", "name": "close_agent", "parameters": {"type": "object"}}],
    },
]
CALC_LARK = 'start: "ADD " NUM " " NUM\nNUM: /[0-9]{1,3}/'
CALC = {
    "type": "custom",
    "name": "calc",
    "description": "Adds two numbers.",
    "format": {"type": "grammar", "syntax": "lark", "definition": CALC_LARK},
}
CODE = {
    "type": "custom",
    "name": "code",
    "description": "A product code.",
    "format": {"type": "grammar", "syntax": "regex", "definition": "[A-Z]{3}-[0-9]{4}"},
}
NOTE = {"type": "custom", "name": "note", "description": "Writes a note.", "format": {"type": "text"}}
LONG_INSTRUCTIONS = (
    "You are a careful assistant for a travel agency. Answer questions about cities, weather, "
    "local time and transport. Keep every answer short and factual, and never invent data. "
    "When a tool can answer, call it; when it cannot, say so plainly. "
) * 3


@pytest.fixture
def client(service):  # noqa: F811 - the imported session fixture
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def collect(stream) -> tuple[list, object]:
    """(every event, the final response) of a streamed create()."""
    events = list(stream)
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    return events, events[-1].response


def check_order(events) -> None:
    """The Responses stream grammar: created, in_progress, then per output item: added,
    (content_part.added, deltas, text done, content_part.done) or (arguments/input delta, done),
    item done; then completed/incomplete. sequence_number counts from 0."""
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    i, index = 2, 0
    while i < len(kinds) - 1:
        assert kinds[i] == "response.output_item.added", kinds[i:]
        assert events[i].output_index == index
        item = events[i].item
        i += 1
        if item.type in ("message", "reasoning"):
            delta = (
                "response.output_text.delta" if item.type == "message" else "response.reasoning_text.delta"
            )
            done = "response.output_text.done" if item.type == "message" else "response.reasoning_text.done"
            assert kinds[i] == "response.content_part.added"
            i += 1
            text = ""
            while kinds[i] == delta:
                text += events[i].delta
                i += 1
            assert kinds[i] == done and events[i].text == text
            assert kinds[i + 1] == "response.content_part.done"
            i += 2
        elif item.type == "function_call":
            assert kinds[i : i + 2] == [
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
            ]
            i += 2
        else:
            assert item.type == "custom_tool_call"
            assert kinds[i : i + 2] == [
                "response.custom_tool_call_input.delta",
                "response.custom_tool_call_input.done",
            ]
            i += 2
        assert kinds[i] == "response.output_item.done" and events[i].output_index == index
        assert events[i].item.id == item.id
        i += 1
        index += 1
    assert len(events[-1].response.output) == index


def create(client, stream: bool, **kw):
    if stream:
        events, resp = collect(client.responses.create(model=MODEL_ID, stream=True, **kw))
        check_order(events)
        return resp
    return client.responses.create(model=MODEL_ID, **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_create_answers_with_a_message(client, stream):
    r = create(
        client,
        stream,
        input="What is the capital of France?",
        instructions="Answer briefly.",
        max_output_tokens=12,
        temperature=0,
    )
    assert r.status in ("completed", "incomplete") and r.model == MODEL_ID and r.id.startswith("resp_")
    assert r.output[-1].type == "message" and r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert (
        r.usage.input_tokens_details.cached_tokens >= 0
        and r.usage.output_tokens_details.reasoning_tokens == 0
    )


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_round_trip_through_function_call_output(client, stream):
    tools = [WEATHER, *HOSTED]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = create(
        client,
        stream,
        input=question,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=48,
        store=False,
        prompt_cache_key="e2e",
        include=["reasoning.encrypted_content"],
        extra_body={"client_metadata": {"thread_id": "t"}},
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    assert isinstance(args["city"], str)
    # stateless (store=false, as Codex): the client sends the whole history back
    history = question + [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": json.dumps({"temperature": 18, "sky": "clear"}),
        },
    ]
    final = create(
        client, stream, input=history, tools=tools, tool_choice="none", temperature=0, max_output_tokens=12
    )
    assert final.output_text and not [o for o in final.output if o.type == "function_call"]


@pytest.mark.parametrize("stream", [False, True])
def test_custom_tools_lark_and_regex_grammars_enforced_and_round_trips(client, stream):
    r = create(
        client,
        stream,
        input="Add 12 and 30.",
        tools=[CALC, CODE, NOTE],
        tool_choice={"type": "custom", "name": "calc"},
        temperature=1,
        max_output_tokens=24,
    )
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert call.name == "calc" and re.fullmatch(r"ADD [0-9]{1,3} [0-9]{1,3}", call.input), call.input
    follow = create(
        client,
        stream,
        previous_response_id=r.id,
        tools=[CALC, CODE, NOTE],
        tool_choice="none",
        temperature=0,
        max_output_tokens=8,
        input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "42"}],
    )
    assert follow.output_text and follow.previous_response_id == r.id
    r = create(
        client,
        stream,
        input="Make a product code.",
        tools=[CALC, CODE, NOTE],
        tool_choice={"type": "custom", "name": "code"},
        temperature=1,
        max_output_tokens=24,
    )
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", call.input), call.input
    # a text custom tool's call and output in the history the client sends back
    history = [
        {"role": "user", "content": "Write a note that says hello."},
        {"type": "custom_tool_call", "call_id": "call_note1", "name": "note", "input": "hello"},
        {"type": "custom_tool_call_output", "call_id": "call_note1", "output": "saved"},
    ]
    r = create(client, stream, input=history, tools=[NOTE], temperature=0, max_output_tokens=8, store=False)
    assert r.status in ("completed", "incomplete") and r.output


def test_json_schema_text_format_twenty_samples_at_temperature_1_all_validate(client):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "pet": {"type": "boolean"},
        },
        "required": ["age", "color", "pet"],
        "additionalProperties": False,
    }

    def one(i):
        r = client.responses.create(
            model=MODEL_ID,
            input="Describe a person.",
            temperature=1,
            max_output_tokens=24,
            text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
            extra_body={"seed": i},
            stream=i % 2 == 1,
        )
        if i % 2 == 1:
            return collect(r)[1]
        return r

    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(one, range(20)))
    for r in answers:
        assert r.status == "completed", r.output
        jsonschema.validate(json.loads(r.output_text), schema)
    assert len({r.output_text for r in answers}) > 1  # sampled, not one answer repeated


def test_no_output_limit_is_not_cut_at_max_tokens_default(client):
    """The shared server's serve.max_tokens_default is 16: a Responses request without
    max_output_tokens gets the rest of the context (a 40+ character JSON string needs more)."""
    schema = {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 120, "maxLength": 160}},
        "required": ["story"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL_ID,
        input="Tell a story.",
        temperature=0,
        text={"format": {"type": "json_schema", "name": "s", "schema": schema}},
    )
    assert r.status == "completed" and r.usage.output_tokens > 16
    assert len(json.loads(r.output_text)["story"]) >= 120


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_and_cached_tokens_on_the_second_turn(client, stream):
    first = create(
        client,
        stream,
        instructions=LONG_INSTRUCTIONS,
        input="Name a city in Italy.",
        temperature=0,
        max_output_tokens=8,
    )
    assert first.usage.input_tokens > 128
    second = create(
        client,
        stream,
        instructions=LONG_INSTRUCTIONS,
        previous_response_id=first.id,
        input="And one in Spain?",
        temperature=0,
        max_output_tokens=8,
    )
    assert second.previous_response_id == first.id
    # the second prompt starts with the first one: its KV comes from the prefix cache (64-token blocks)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 64, second.usage
    # the same through the stateless form: the client repeats the first turn's history
    history = [
        {"role": "user", "content": "Name a city in Italy."},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": first.output_text}],
        },
        {"role": "user", "content": "And one in France?"},
    ]
    third = create(
        client,
        stream,
        instructions=LONG_INSTRUCTIONS,
        input=history,
        store=False,
        temperature=0,
        max_output_tokens=8,
    )
    assert third.usage.input_tokens_details.cached_tokens >= 64, third.usage


def test_empty_probe_and_hosted_tools_are_tolerated(client):
    r = client.responses.create(model=MODEL_ID, input=[], tools=HOSTED)
    assert r.status == "completed" and r.output == [] and r.usage.input_tokens == 0
    r = client.responses.create(model=MODEL_ID, input="hi", tools=HOSTED, max_output_tokens=4)
    assert r.status in ("completed", "incomplete")


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"input": [{"type": "no_such_item"}]}, "input.0.type"),
        ({"input": "hi", "previous_response_id": "resp_" + "0" * 32}, "previous_response_id"),
        (
            {
                "input": [
                    {"role": "user", "content": "q"},
                    {
                        "type": "function_call",
                        "call_id": "call_x",
                        "name": "get_weather",
                        "arguments": "city=Paris",
                    },
                ]
            },
            "input.1.arguments",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}
                ]
            },
            "input.0.content.0.type",
        ),
    ],
    ids=["unknown-item", "unknown-previous-id", "non-json-arguments", "image"],
)
def test_bad_inputs_are_400s_naming_the_field_and_the_server_carries_on(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_ID, tools=[WEATHER], **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"
    ok = client.responses.create(model=MODEL_ID, input="hi", max_output_tokens=2)
    assert ok.status in ("completed", "incomplete")
