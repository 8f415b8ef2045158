"""End to end: `moe-service serve` on the demo model through the real pipeline, driven by the
official openai client, checked against llama.cpp's greedy output (tests/fixtures/golden).

One server process serves most tests (session fixture); the SIGTERM test starts its own.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_proc import build_demo_model, default_numba_cache_dir, start_service

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


@pytest.fixture(scope="session")
def golden(demo_model):
    """llama.cpp's greedy chain for the chat prompt, cut at the end-of-generation token, as
    (prompt text, expected completion text, finish_reason) for MAX_TOKENS tokens."""
    from moe_service.engine.tokenizer import Tokenizer

    g = golden_model(GOLDEN)
    tok = Tokenizer.from_file(demo_model)
    assert tok.encode(g.prompt_text, parse_special=True) == g.prompt_ids
    chain = g.greedy_ids[:MAX_TOKENS]
    eog = next((i for i, t in enumerate(chain) if tok.is_eog(t)), None)
    if eog is not None:
        return g.prompt_text, tok.decode(chain[:eog]), "stop"
    return g.prompt_text, tok.decode(chain), "length"


@pytest.fixture(scope="session")
def service(demo_model, e2e_cache):
    sp = start_service(demo_model, e2e_cache, numba_cache_dir=default_numba_cache_dir(),
                       config={"max_tokens_default": 16})
    yield sp
    code = sp.terminate()
    sp.close()
    assert code == 0, sp.log_text()[-4000:]


@pytest.fixture
def client(service):
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=300)


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
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{service.url}{path}", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == etype and err["param"] == param and err["message"]
    ok = client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=2, temperature=0)
    assert ok.choices[0].text and ok.usage.completion_tokens == 2


def test_openai_client_raises_bad_request_for_unsupported(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], logprobs=True)
    assert e.value.body["param"] == "logprobs"


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
