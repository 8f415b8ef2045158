"""End to end: `moe-service serve` on the demo model through the real pipeline, driven by the
official openai client, checked against llama.cpp's greedy output (tests/fixtures/golden).

One server process serves most tests (session fixture); the SIGTERM test starts its own.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.service_proc import ServiceProc, build_demo_model, default_numba_cache_dir, start_service
from tests.fixtures.golden import golden_model

GOLDEN = "smollm2-135m-moe8"
MODEL_ID = "smollm2-135m-instruct-moe8"
SYSTEM = "You are a concise assistant."
USER = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 12


@pytest.fixture(scope="session")
def e2e_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e-cache")


@pytest.fixture(scope="session")
def demo_model(e2e_cache):
    return build_demo_model(e2e_cache)


def golden_answer(model: Path) -> tuple[str, list[int], str, str]:
    """llama.cpp's greedy chain for the golden chat prompt (GOLDEN), MAX_TOKENS tokens cut at the
    end-of-generation token, decoded with ``model``'s tokenizer: (prompt text, prompt ids,
    expected completion text, finish_reason)."""
    from moe_service.engine.tokenizer import Tokenizer

    g = golden_model(GOLDEN)
    tok = Tokenizer.from_file(model)
    assert tok.encode(g.prompt_text, parse_special=True) == g.prompt_ids
    chain = g.greedy_ids[:MAX_TOKENS]
    eog = next((i for i, t in enumerate(chain) if tok.is_eog(t)), None)
    if eog is not None:
        return g.prompt_text, g.prompt_ids, tok.decode(chain[:eog]), "stop"
    return g.prompt_text, g.prompt_ids, tok.decode(chain), "length"


@pytest.fixture(scope="session")
def golden(demo_model):
    """(prompt text, expected completion text, finish_reason): ``golden_answer``."""
    prompt_text, _, text, finish = golden_answer(demo_model)
    return prompt_text, text, finish


API_KEY = "sk-e2e-" + "0" * 24


@pytest.fixture(scope="session")
def key_file(e2e_cache):
    """serve.api_key_file of the shared server (0600, one key): every request below sends it."""
    path = e2e_cache / "api-keys"
    path.write_text(f"# e2e\n{API_KEY}\n")
    path.chmod(0o600)
    return path


def served(model: Path, cache: Path, **kw) -> Iterator[ServiceProc]:
    """``moe-service serve`` on ``model`` for a fixture to ``yield from``: bench.service_proc's
    start_service (``kw``: its config / extra_env) with the shared numba cache; after the tests,
    SIGTERM must end it with exit 0 (its log's tail otherwise)."""
    sp = start_service(model, cache, numba_cache_dir=default_numba_cache_dir(), **kw)
    yield sp
    code = sp.terminate()
    sp.close()
    assert code == 0, sp.log_text()[-4000:]


@pytest.fixture(scope="session")
def service(demo_model, e2e_cache, key_file):
    yield from served(demo_model, e2e_cache, config={"max_tokens_default": 16, "api_key_file": str(key_file)})


@pytest.fixture
def client(service):
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def chat_messages():
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


def test_ready_only_after_health_answers(service):
    assert service.health_at_ready == 200
    texts = service.sink.texts()
    ready = next(i for i, t in enumerate(texts) if "READY=1" in t)
    # every stage reported STATUS before READY, the serve stage last
    assert any("STATUS=warmup" in t for t in texts[:ready])
    assert any("STATUS=serve" in t for t in texts[:ready])
    log_lines = [json.loads(line) for line in service.log_text().splitlines() if line.startswith("{")]
    events = [e.get("event") for e in log_lines]
    assert events.index("serve_listening") < events.index("service_ready")
    assert "warmup_done" in events


def test_chat_completion_matches_llama_cpp(client, golden):
    _, text, finish = golden
    r = client.chat.completions.create(model=MODEL_ID, messages=chat_messages(), max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens == len(golden_model(GOLDEN).prompt_ids)
    assert r.model == MODEL_ID


def test_streamed_completion_matches_llama_cpp(client, golden):
    prompt, text, finish = golden
    stream = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(golden_model(GOLDEN).prompt_ids)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL_ID]


def test_eight_concurrent_streams_all_finish_right(service, client, golden):
    _, text, finish = golden
    results: dict[int, tuple[str, str]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            stream = client.chat.completions.create(model=MODEL_ID, messages=chat_messages(), max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True)
            parts, reason = [], None
            for c in stream:
                if c.choices:
                    parts.append(c.choices[0].delta.content or "")
                    reason = c.choices[0].finish_reason or reason
            results[i] = ("".join(parts), reason)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert results == {i: (text, finish) for i in range(8)}
    assert service.proc.poll() is None
    assert httpx.get(f"{service.url}/health").status_code == 200
    # the streams were decoded together: some engine step carried more than one sequence
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{service.url}/metrics").text)}
    buckets = {s.labels["le"]: s.value for s in fams["moe_service_batch_sequences"].samples
               if s.name.endswith("_bucket")}
    assert buckets["1.0"] < buckets["+Inf"]


BAD_REQUESTS = [
    # (path, body (dict, or raw bytes), status, error type, param)
    ("/v1/chat/completions", b"{\"model\": ", 400, "invalid_request_error", None),
    ("/v1/completions", {"model": MODEL_ID, "prompt": ""}, 400, "invalid_request_error", "prompt"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "model"),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "n": 3}, 400,
     "invalid_request_error", "n"),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}],
                              "temperature": "warm"}, 400, "invalid_request_error", "temperature"),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "hello " * 10000, "max_tokens": 4}, 400,  # > the 8192 context
     "invalid_request_error", "prompt"),
]


@pytest.mark.parametrize("path,body,status,etype,param", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_request_gets_its_error_and_the_next_request_succeeds(service, client, path, body, status, etype, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{service.url}{path}", timeout=60, headers={"authorization": f"Bearer {API_KEY}",
                                                                   "content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == etype and err["param"] == param and err["message"]
    ok = client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=2, temperature=0)
    assert ok.choices[0].text and ok.usage.completion_tokens == 2


def test_openai_client_raises_bad_request_for_unsupported(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                       presence_penalty=0.5)
    assert e.value.body["param"] == "presence_penalty"


def test_metrics_parse(service, client):
    client.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=2, temperature=0)
    text = httpx.get(f"{service.url}/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    reqs = {(s.labels["endpoint"], s.labels["status"]): s.value for s in fams["moe_service_requests"].samples
            if s.name == "moe_service_requests_total"}
    assert reqs[("/v1/completions", "200")] >= 1
    stages = {s.labels["stage"] for s in fams["moe_service_pipeline_stage_duration_seconds"].samples}
    assert {"fastload", "warmup"} <= stages
    assert any(s.value > 0 for s in fams["moe_service_node_bytes"].samples)
    for name in ("moe_service_time_to_first_token_seconds", "moe_service_time_per_output_token_seconds",
                 "moe_service_completion_tokens", "moe_service_queue_depth", "moe_service_batch_sequences"):
        assert name in fams, name


def test_sigterm_during_a_request_finishes_it_and_exits_0(demo_model, e2e_cache):
    sp = start_service(demo_model, e2e_cache, numba_cache_dir=default_numba_cache_dir())
    try:
        client = openai.OpenAI(base_url=f"{sp.url}/v1", api_key="unused", max_retries=0, timeout=300)
        stream = client.chat.completions.create(model=MODEL_ID, messages=chat_messages(), max_tokens=24,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        it = iter(stream)
        first = next(it)
        assert first.choices[0].delta.role == "assistant"
        sp.proc.send_signal(signal.SIGTERM)
        rest = list(it)
        assert rest[-1].usage.completion_tokens == 24
        assert [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason] == ["length"]
        assert sp.proc.wait(120) == 0
        deadline = time.monotonic() + 5
        while not any("STOPPING=1" in t for t in sp.sink.texts()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any("STOPPING=1" in t for t in sp.sink.texts())
    finally:
        sp.close()


def test_watchdog_pings_while_serving_and_stops_when_the_engine_stalls(demo_model, e2e_cache):
    """Under systemd with WatchdogSec: after READY=1, WATCHDOG=1 at most half of WATCHDOG_USEC
    apart while the engine loop runs, none once it stalls (the test hook freezes the liveness
    signal), and no EXTEND_TIMEOUT_USEC after READY=1 (systemd applies it to the watchdog timer
    too: the lab found a serving process whose extensions hid a stalled engine)."""
    env = {
        "WATCHDOG_USEC": "1000000",
        "MOE_SERVICE_TEST_STALL_AFTER_S": "3",
        "MOE_SERVICE__PIPELINE__EXTEND_AFTER_S": "0",
        "MOE_SERVICE__PIPELINE__EXTEND_INTERVAL_S": "0.5",
        "MOE_SERVICE__PIPELINE__EXTEND_TIMEOUT_S": "2",
    }
    sp = start_service(demo_model, e2e_cache, numba_cache_dir=default_numba_cache_dir(), extra_env=env)
    try:
        time.sleep(5.5)
        msgs = [(t, m.decode("latin-1")) for t, m in list(sp.sink.messages)]
        pings = [t for t, m in msgs if m == "WATCHDOG=1" and t >= sp.t_ready]
        alive = [t for t in pings if t <= sp.t_ready + 3.0]
        assert len(alive) >= 5
        assert max(b - a for a, b in zip(alive, alive[1:], strict=False)) <= 0.5
        assert [t for t in pings if t > sp.t_ready + 3.0 + 0.5] == []
        assert [m for t, m in msgs if m.startswith("EXTEND_TIMEOUT_USEC=") and t > sp.t_ready] == []
        assert sp.proc.poll() is None  # stalled, not dead: systemd is the one that restarts it
    finally:
        sp.close()


# -- the agent-facing API on the demo model (moe_service.api) ------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
TOOL_RESULTS = {"get_weather": {"temperature": 18, "unit": "celsius", "sky": "clear"},
                "get_time": {"time": "14:05"}}


def _chat(client, stream: bool, **kw):
    """(message dict as a client keeps it, finish_reason), from a streamed or a plain answer."""
    if not stream:
        r = client.chat.completions.create(model=MODEL_ID, **kw)
        return r.choices[0].message.model_dump(exclude_none=True), r.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(model=MODEL_ID, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            c["id"] = tc.id or c["id"]
            if tc.function and tc.function.name:
                c["function"]["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                c["function"]["arguments"] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    msg = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, finish


def _round_trip(client, stream: bool, choice: str) -> dict:
    import jsonschema

    tools = [WEATHER, CLOCK]
    if choice == "required":
        question, tool_choice, expect = "What is the weather in Paris?", "required", {"get_weather", "get_time"}
    else:
        question, tool_choice, expect = "What time is it in Tokyo?", {"type": "function",
                                                                     "function": {"name": "get_time"}}, {"get_time"}
    msgs = [{"role": "user", "content": question}]
    first, finish = _chat(client, stream, messages=msgs, tools=tools, tool_choice=tool_choice,
                          parallel_tool_calls=False, temperature=0, max_tokens=48)
    assert finish == "tool_calls", first
    calls = first["tool_calls"]
    assert len(calls) == 1 and calls[0]["id"].startswith("call_")
    name = calls[0]["function"]["name"]
    assert name in expect
    args = json.loads(calls[0]["function"]["arguments"])
    schema = next(t for t in tools if t["function"]["name"] == name)["function"]["parameters"]
    jsonschema.validate(args, schema)
    msgs += [first, {"role": "tool", "tool_call_id": calls[0]["id"], "content": json.dumps(TOOL_RESULTS[name])}]
    final, finish = _chat(client, stream, messages=msgs, tools=tools, tool_choice="none", temperature=0,
                          max_tokens=12)
    assert finish in ("stop", "length") and final["content"] and "tool_calls" not in final
    return {"call": (name, args), "answer": final["content"]}


def test_tool_round_trips_required_and_named_streamed_and_not(client):
    """Round trips at once (the server batches them): assistant tool_calls -> tool message ->
    final answer, with tool_choice 'required' (not streamed) and a named function (streamed)."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [(False, "required"), (True, "named")]
    with ThreadPoolExecutor(len(cases)) as ex:
        results = list(ex.map(lambda sc: _round_trip(client, *sc), cases))
    assert results[0]["call"][0] in ("get_weather", "get_time") and results[1]["call"][0] == "get_time"


def test_json_schema_twenty_samples_at_temperature_1_all_validate(client):
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    schema = {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"type": "string", "enum": ["red", "green", "blue"]}, "pet": {"type": "boolean"}},
        "required": ["age", "color", "pet"], "additionalProperties": False}

    def one(seed):
        r = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "Describe a person."}], temperature=1, seed=seed,
            max_tokens=24, response_format={"type": "json_schema",
                                            "json_schema": {"name": "person", "schema": schema, "strict": True}})
        return r.choices[0].finish_reason, r.choices[0].message.content

    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(one, range(20)))
    for finish, text in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert len({t for _, t in answers}) > 1  # sampled, not one answer repeated


def test_uncompilable_schema_is_a_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {
                "a": {"$ref": "#/definitions/missing"}}}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert "missing" in e.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_greedy_chain_is_the_top_choice(client, stream):
    kw = dict(messages=chat_messages(), max_tokens=6, temperature=0, logprobs=True, top_logprobs=5)
    if stream:
        entries, text = [], ""
        for ch in client.chat.completions.create(model=MODEL_ID, stream=True, **kw):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                entries += ch.choices[0].logprobs.content if ch.choices[0].logprobs else []
    else:
        r = client.chat.completions.create(model=MODEL_ID, **kw)
        entries, text = r.choices[0].logprobs.content, r.choices[0].message.content
    assert 1 <= len(entries) <= 6 and "".join(e.token for e in entries) == text
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert e.top_logprobs[0].token == e.token and e.logprob == tops[0]  # greedy: the argmax
        assert sum(2.718281828 ** t for t in tops) <= 1 + 1e-9
    r = client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=3, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.top_logprobs) == 3
    assert all(max(d.values()) == v for d, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))


def test_api_keys_401_200_health_open_and_sighup_reload(service, client, key_file):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{service.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert e.value.body["code"] == "invalid_api_key"
    assert httpx.post(f"{service.url}/v1/completions", json={"prompt": "x"}).status_code == 401
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    assert httpx.get(f"{service.url}/health").status_code == 200
    assert httpx.get(f"{service.url}/metrics").status_code == 200  # serve.metrics_auth = false
    new = "sk-rotated-" + "1" * 20
    original = key_file.read_text()
    try:
        key_file.write_text(original + new + "\n")
        service.proc.send_signal(signal.SIGHUP)
        rotated = openai.OpenAI(base_url=f"{service.url}/v1", api_key=new, max_retries=0)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert [m.id for m in rotated.models.list()] == [MODEL_ID]
                break
            except openai.AuthenticationError:
                assert time.monotonic() < deadline, "the new key was not accepted after SIGHUP"
                time.sleep(0.1)
    finally:
        key_file.write_text(original)
        service.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while httpx.get(f"{service.url}/v1/models", headers={"authorization": f"Bearer {new}"}).status_code != 401:
        assert time.monotonic() < deadline, "the removed key still works after SIGHUP"
        time.sleep(0.1)
    assert service.proc.poll() is None


def test_plain_text_content_type_is_refused(service):
    body = json.dumps({"model": MODEL_ID, "prompt": "x", "max_tokens": 1})
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        r = httpx.post(f"{service.url}/v1/completions", content=body,
                       headers={"content-type": ctype, "authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
