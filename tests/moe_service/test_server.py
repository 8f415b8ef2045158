"""The HTTP API over the real engine loop and a fake model (tests/support/serving_fakes.py;
the stack and its fixtures: tests/support/serving_stack.py, tests/moe_service/conftest.py):
answers, SSE streams, error objects, 429, health, metrics, disconnects, the openai client."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from moe_service.metrics import Metrics
from pipeline.serve import fetch_health
from tests.support.serving_stack import MODEL, TOK, Stack, chat_ids, greedy_text, sse_events

# -- answers --------------------------------------------------------------------------------------


def test_chat_completion(client):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 7, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": greedy_text(chat_ids("hi"), 7)}
    assert choice["finish_reason"] == "length"
    n_prompt = len(chat_ids("hi"))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 7, "total_tokens": n_prompt + 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_text_and_token_prompt(client):
    ids = TOK.encode("once upon")
    for prompt in ("once upon", ids, [ids], ["once upon"]):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == greedy_text(ids, 5)
        assert body["usage"]["prompt_tokens"] == len(ids)


def test_stop_string_ends_with_stop(client):
    ids = TOK.encode("stop test")
    full = greedy_text(ids, 12)
    stop = full[4:6]
    r = client.post("/v1/completions", json={"prompt": "stop test", "max_tokens": 12, "temperature": 0, "stop": stop})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[: full.index(stop)]


def test_default_max_tokens_and_model_may_be_omitted(client, stack):
    r = client.post("/v1/completions", json={"prompt": "abc", "temperature": 0})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == stack.engine.max_tokens_default


def test_chat_stream_with_usage(client):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "stream"}], "max_tokens": 6,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == greedy_text(chat_ids("stream"), 6)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_stream_without_usage(client):
    ids = TOK.encode("plain")
    with client.stream("POST", "/v1/completions", json={"prompt": "plain", "max_tokens": 4, "temperature": 0,
                                                        "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == greedy_text(ids, 4)
    assert all("usage" not in c for c in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_models_and_health(client, stack):
    r = client.get("/v1/models")
    assert r.json()["data"][0]["id"] == MODEL
    assert client.get(f"/v1/models/{MODEL}").status_code == 200
    r = client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    stack.service.ready = False
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "loading", "stage": "warmup"}
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
    # SIGTERM: /health 503 at once, but a request that still arrives is served (a balancer may
    # send it before its checks saw the 503), and responses close the connection.
    stack.service.ready, stack.service.stopping = True, True
    r = client.get("/health")
    assert r.json() == {"status": "stopping"} and r.headers["connection"] == "close"
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"], r.text
    assert r.headers["connection"] == "close"
    stack.service.ready = False  # the serve stage closed (PipelineContext close): refused
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def test_metrics_parse_and_count(client):
    client.post("/v1/completions", json={"prompt": "count me", "max_tokens": 3, "temperature": 0})
    client.post("/v1/completions", json={"prompt": ""})
    r = client.get("/metrics")
    assert r.status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    reqs = {(s.labels["endpoint"], s.labels["status"]): s.value for s in fams["moe_service_requests"].samples
            if s.name == "moe_service_requests_total"}
    assert reqs[("/v1/completions", "200")] == 1 and reqs[("/v1/completions", "400")] == 1
    comp = [s.value for s in fams["moe_service_completion_tokens"].samples if s.name.endswith("_total")]
    assert comp == [3]
    for name in ("moe_service_time_to_first_token_seconds", "moe_service_time_per_output_token_seconds",
                 "moe_service_batch_sequences", "moe_service_queue_depth", "moe_service_active_sequences"):
        assert name in fams
    ttft = [s.value for s in fams["moe_service_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft == [1]


def test_metrics_export_pipeline_context():
    class Layout:
        def bytes_per_node(self):
            return {0: 1000, 1: 2000}

    class Ctx:
        stage_durations_s = {"fastload": 1.5, "warmup": 0.25}
        layout = Layout()
        residency = None

    m = Metrics()
    m.attach_context(Ctx())
    body, _ = m.render()
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    stages = {s.labels["stage"]: s.value for s in fams["moe_service_pipeline_stage_duration_seconds"].samples}
    assert stages == {"fastload": 1.5, "warmup": 0.25}
    nodes = {(s.labels["node"], s.labels["source"]): s.value for s in fams["moe_service_node_bytes"].samples}
    assert nodes == {("0", "plan"): 1000, ("1", "plan"): 2000}


# -- bad requests -----------------------------------------------------------------------------------

CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD = [
    # (endpoint, body or raw bytes, status, param, code)
    ("/v1/chat/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt", None),
    ("/v1/chat/completions", {**CHAT_OK, "model": "gpt-4"}, 400, "model", "model_not_found"),
    ("/v1/chat/completions", {**CHAT_OK, "n": 2}, 400, "n", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "invalid_value"),
    ("/v1/chat/completions", {**CHAT_OK, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("/v1/chat/completions", {**CHAT_OK, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400,
     "tools.0.function.name", None),
    ("/v1/chat/completions", {**CHAT_OK, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice.function.name", None),
    ("/v1/chat/completions", {**CHAT_OK, "tool_choice": "required"}, 400, "tool_choice", None),
    ("/v1/chat/completions", {**CHAT_OK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}}}],
        "tool_choice": "required"}, 400, "tools.0.function.parameters", "invalid_json_schema"),
    ("/v1/chat/completions", {**CHAT_OK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, 400, "response_format.json_schema.schema",
     "invalid_json_schema"),
    ("/v1/chat/completions", {**CHAT_OK, "response_format": {"type": "xml"}}, 400, "response_format.type", None),
    ("/v1/chat/completions", {**CHAT_OK, "functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": 3}, 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", {**CHAT_OK, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/chat/completions", {**CHAT_OK, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {**CHAT_OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("/v1/chat/completions", {**CHAT_OK, "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}, {"content": "x"}]}, 400, "messages.1.role",
     "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "function", "content": "x"}]}, 400, "messages.0.role",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.tool_call_id",
     "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content.0.type",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "first"}]}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/completions", {"prompt": "word " * 60, "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "short", "max_tokens": 250}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT_OK, "max_completion_tokens": 10_000}, 400, "max_completion_tokens",
     "context_length_exceeded"),
]


@pytest.fixture
def small_ctx_client():
    s = Stack(n_ctx=240)
    with TestClient(s.app) as c:
        yield c
    s.close()


@pytest.mark.parametrize("endpoint,body,status,param,code", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_request_then_a_good_one(small_ctx_client, endpoint, body, status, param, code):
    c = small_ctx_client
    if isinstance(body, bytes):
        r = c.post(endpoint, content=body, headers={"content-type": "application/json"})
    else:
        r = c.post(endpoint, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    ok = c.post("/v1/chat/completions", json=CHAT_OK)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_unknown_route_is_an_error_object(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_engine_failure_is_a_500_and_the_next_request_works():
    poison = TOK.encode("z")[-1]
    s = Stack(poison=poison)
    try:
        with TestClient(s.app) as c:
            r = c.post("/v1/completions", json={"prompt": "zzz", "max_tokens": 3})
            assert r.status_code == 500
            assert r.json()["error"]["type"] == "server_error" and "poisoned" in r.json()["error"]["message"]
            with c.stream("POST", "/v1/completions", json={"prompt": "zz", "max_tokens": 3, "stream": True}) as st:
                events = sse_events(st.iter_lines())
            assert events[-2]["error"]["type"] == "server_error" and events[-1] == "[DONE]"
            r = c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200
    finally:
        s.close()


def test_queue_full_is_429_with_retry_after():
    s = Stack(n_seq=1, parallel=1, queue_size=0, step_delay_s=0.02)
    try:
        with TestClient(s.app) as c:
            results = {}

            def long_request():
                results["long"] = c.post("/v1/completions", json={"prompt": "long", "max_tokens": 40})

            t = threading.Thread(target=long_request)
            t.start()
            deadline = time.monotonic() + 5
            while s.batch.active == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            r = c.post("/v1/completions", json={"prompt": "more", "max_tokens": 2})
            assert r.status_code == 429
            assert r.headers["retry-after"] == "2"
            assert r.json()["error"]["code"] == "queue_full"
            t.join(10)
            assert results["long"].status_code == 200
            assert c.post("/v1/completions", json={"prompt": "more", "max_tokens": 2}).status_code == 200
    finally:
        s.close()


# -- over a real socket ------------------------------------------------------------------------------


def test_fetch_health_over_the_socket(live):
    s, srv = live
    status, body = asyncio.run(fetch_health(srv.host, srv.port))
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_disconnected_stream_is_cancelled_and_its_slot_freed(live):
    s, srv = live
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "go on", "max_tokens": 200, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    deadline = time.monotonic() + 5
    while (s.batch.active or s.engine.model.kv.n_free != 4) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.batch.active == 0 and s.engine.model.kv.n_free == 4
    assert len(s.engine.model.steps) < 150  # cancelled, not run to max_tokens


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "slow", "max_tokens": 200}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "slow"}], "max_tokens": 200}),
        (
            "/v1/messages",
            {"model": MODEL, "messages": [{"role": "user", "content": "slow"}], "max_tokens": 200},
        ),
        ("/v1/responses", {"input": "slow", "max_output_tokens": 200}),
    ],
)
def test_disconnected_non_stream_request_is_cancelled(live, path, body):
    s, srv = live
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}{path}", json=body, timeout=0.3)
    deadline = time.monotonic() + 5
    while s.batch.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.batch.active == 0 and s.engine.model.kv.n_free == 4
    assert len(s.engine.model.steps) < 150  # cancelled, not run to max_tokens


def test_openai_client_chat_and_stream(live):
    from openai import OpenAI

    s, srv = live
    s.engine.model.step_delay_s = 0
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0)
    assert r.choices[0].message.content == greedy_text(chat_ids("hi"), 5)
    assert r.usage.completion_tokens == 5
    stream = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy_text(TOK.encode("abc"), 6)
    assert chunks[-1].usage.completion_tokens == 6
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    assert [m.id for m in client.models.list()] == [MODEL]
