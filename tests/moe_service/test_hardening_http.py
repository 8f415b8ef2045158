"""Issue 15 (hardening) over the HTTP API and the engine loop, with the fake model of
serving_fakes: bad input gets a clear 4xx (never a 500 with a traceback), bounded resources
(body size, queue and prompt size before tokenization, stop strings, header timeout),
admission failures release their places, liveness that tells the truth (/health 503 with the
reason after N failed steps or with a dead worker pool, no watchdog pings then), chat
templates (missing, broken, runaway)."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

from moe_service.engine.sampler import StopSequenceMatcher
from moe_service.engine.tokenizer import ChatTemplate
from moe_service.notify import Liveness, Watchdog
from moe_service.request_limits import MAX_STOP_CHARS
from pipeline.serve import LoopHeartbeat, _uvicorn_server
from tests.support.serving_fakes import FakeTokenizer
from tests.support.serving_stack import Stack, ThreadedServer

CHAT_OK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def client(stack):
    """conftest's client, but a server error comes back as its 500 response instead of raising."""
    with TestClient(stack.app, raise_server_exceptions=False) as c:
        yield c


def _post_raw(c, path, raw: bytes):
    return c.post(path, content=raw, headers={"content-type": "application/json"})


# -- bad input: a clear 400 naming the problem --------------------------------------------------

BAD_BODIES = [
    ("/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 2}', "prompt", "surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages.0.content",
     "surrogate"),
    ("/v1/completions", b'{"prompt": "ab", "stop": ["\\ud83d"]}', "stop.0", "surrogate"),
    ("/v1/completions", b'{"prompt": "ab", "user": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", None, "nested"),
    ("/v1/completions", b'{"prompt": "ab", "user": ' + b"[" * 70 + b"]" * 70 + b"}", None, "nested"),
    ("/v1/completions", b'{"prompt": "ab", "max_tokens": ' + b"9" * 5000 + b"}", None, "too long"),
    ("/v1/completions", b'{"prompt": "ab", "temperature": 0.' + b"1" * 5000 + b"}", None, "too long"),
    ("/v1/completions", b'{"prompt": "ab", "temperature": NaN}', None, "NaN"),
    ("/v1/completions", b'{"prompt": "ab", "temperature": -Infinity}', None, "Infinity"),
    ("/v1/completions", b'{"prompt": "ab", "stop": "' + b"x" * (MAX_STOP_CHARS + 1) + b'"}', "stop", "at most"),
]


@pytest.mark.parametrize("path,raw,param,words", BAD_BODIES, ids=[w + str(i) for i, (*_, w) in enumerate(BAD_BODIES)])
def test_bad_input_is_a_clear_400(client, path, raw, param, words):
    r = _post_raw(client, path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and words in err["message"]
    assert err["param"] == param
    assert client.post("/v1/chat/completions", json=CHAT_OK).status_code == 200  # and it keeps serving


def test_subnormal_temperature_samples_greedily(client, stack):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "temperature": 1e-320})
    assert r.status_code == 200, r.text
    greedy = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "temperature": 0})
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


# -- bounded resources ----------------------------------------------------------------------------


def test_body_over_max_body_bytes_is_413(client, stack):
    stack.service.max_body_bytes = 1000
    r = client.post("/v1/completions", json={"prompt": "a" * 2000, "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(5):
            yield b" " * 400

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1}).status_code == 200


def test_queue_full_and_oversized_prompts_are_refused_before_tokenization(stack):
    calls = []
    real = stack.engine.encode_prompt

    def spy(*a, **k):
        calls.append(a)
        return real(*a, **k)

    stack.engine.encode_prompt = spy
    stack.engine.max_prompt_chars = 100
    with TestClient(stack.app) as c:
        r = c.post("/v1/completions", json={"prompt": "a" * 101, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert calls == []
        stack.batch.queue_size = 0
        stack.batch.parallel = 0  # every place taken
        r = c.post("/v1/completions", json={"prompt": "a" * 50, "max_tokens": 1})
        assert r.status_code == 429 and calls == [] and r.headers["retry-after"] == "2"


def test_admission_that_raises_releases_its_place(stack):
    """A request whose admission raises gets a 500, its place is released, and the requests
    admitted with it are answered: more than parallel + queue_size such failures in a row
    leave the server serving (before: every later request got 429)."""
    engine = stack.engine
    real = engine.new_sequence
    failing = {"n": 0}

    def new_sequence(req):
        if failing["n"] > 0:
            failing["n"] -= 1
            raise RuntimeError("injected admission fault")
        return real(req)

    engine.new_sequence = new_sequence
    capacity = stack.batch.parallel + stack.batch.queue_size
    with TestClient(stack.app) as c:
        failing["n"] = capacity + 2
        for _ in range(capacity + 2):
            r = c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
            assert r.status_code == 500 and "injected admission fault" in r.json()["error"]["message"]
        results = []

        def one():
            results.append(c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code)

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert results == [200, 200, 200]
    assert stack.batch.active == 0 and stack.batch.waiting == 0


def test_requests_admitted_with_a_failing_one_are_answered(stack):
    """Three requests admitted in one iteration, the first one's admission raises: the other
    two still run (before: the exception left them reserved, unadmitted and unanswered)."""
    from moe_service.engine.engine import GenerationRequest

    engine, batch = stack.engine, stack.batch
    real = engine.new_sequence
    first = {"done": False}

    def new_sequence(req):
        if not first["done"]:
            first["done"] = True
            raise RuntimeError("injected admission fault")
        return real(req)

    engine.new_sequence = new_sequence
    events = {i: [] for i in range(3)}
    done = threading.Event()

    def emit_for(i):
        def emit(ev):
            events[i].append(ev)
            if all(e and e[-1].final for e in events.values()):
                done.set()
        return emit

    with batch._cv:  # hold the loop so that the three are admitted together
        for i in range(3):
            batch.submit(GenerationRequest([0, 2, 3], 2, emit=emit_for(i), request_id=f"r{i}"))
    assert done.wait(20), {i: [e.final for e in evs] for i, evs in events.items()}
    finals = [evs[-1] for evs in events.values()]
    assert sum(e.error is not None for e in finals) == 1 and sum(e.finish_reason == "length" for e in finals) == 2
    deadline = time.monotonic() + 5
    while batch.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batch.active == 0 and batch.waiting == 0 and engine.model.kv.n_free == 4


def test_stop_strings_are_capped_and_matched_like_before():
    def brute(stops, chunks):  # the previous matcher (quadratic hold-back), as the reference
        held, out = "", []
        for t in chunks:
            buf = held + t
            found = [(buf.find(s), s) for s in stops if buf.find(s) >= 0]
            if found:
                out.append(buf[: min(found)[0]])
                return "".join(out)
            hold = 0
            for s in stops:
                for n in range(min(len(s) - 1, len(buf)), hold, -1):
                    if buf.endswith(s[:n]):
                        hold = n
                        break
            held = buf[len(buf) - hold:] if hold else ""
            out.append(buf[: len(buf) - hold])
        return "".join(out) + held

    rng = random.Random(15)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 3))]
        chunks = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(1, 8))]
        m = StopSequenceMatcher(stops)
        got = "".join(m.push(c) for c in chunks) + m.flush()
        assert got == brute(stops, chunks), (stops, chunks)


def test_stop_hold_back_is_linear_in_the_text():
    """A long chunk that keeps almost matching a long stop string: every prefix length the
    previous matcher tried with endswith failed only at the chunk's end, len(chunk) x len(stop)
    character comparisons (~20 s of CPU here); the KMP automaton reads each character once."""
    n = 1_000_000
    stop = "a" * n + "b"
    m = StopSequenceMatcher([stop])
    t0 = time.process_time()
    out = m.push("a" * (n - 1) + "x" + "a")
    assert out == "a" * (n - 1) + "x" and m.held == "a"
    for _ in range(50):  # then token-sized pushes stay cheap
        m.push("a")
    assert m.held == "a" * 51
    assert time.process_time() - t0 < 4.0  # linear: ~0.4 s of CPU; the previous matcher: ~20 s


def test_uvicorn_limits_come_from_the_config():
    server = _uvicorn_server(lambda *a: None, 1.0, max_connections=7, keepalive_timeout_s=3, header_timeout_s=0.5)
    assert server.config.limit_concurrency == 7 and server.config.timeout_keep_alive == 3
    assert server.config.http.__name__ == "HeaderTimeoutH11Protocol"


def test_a_client_that_sends_no_headers_is_disconnected():
    s = Stack()
    srv = ThreadedServer(s.app, 1.0, header_timeout_s=0.3)
    try:
        with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finishes the headers
            t0 = time.monotonic()
            assert sock.recv(100) == b""  # closed by the server
            assert time.monotonic() - t0 < 8
        with socket.create_connection((srv.host, srv.port), timeout=10) as sock:  # a normal request works
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        srv.stop()
        s.close()


# -- liveness ------------------------------------------------------------------------------------


class _Notifier:
    enabled = True

    def __init__(self):
        self.pings = 0

    def watchdog(self):
        self.pings += 1


def test_failed_steps_turn_health_503_and_stop_the_watchdog():
    """Fault injection through the model object (no hook in the service or its config)."""
    liveness = Liveness()
    s = Stack(step_delay_s=0.0)
    s.batch.stop()
    from moe_service.engine.batch import BatchLoop

    s.batch = BatchLoop(s.engine, parallel=4, queue_size=4, liveness=liveness, max_failed_steps=3,
                        idle_wait_s=0.01).start()
    s.service.batch = s.batch
    try:
        with TestClient(s.app) as c:
            assert c.get("/health").status_code == 200
            real_step = s.engine.model.step
            s.engine.model.step = lambda batch, **kw: (_ for _ in ()).throw(RuntimeError("injected step fault"))
            for _ in range(3):
                assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 500
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "unhealthy"
            assert "3 engine steps in a row failed" in r.json()["reason"]
            assert "injected step fault" in r.json()["reason"]
            assert liveness.problem() is not None
            notifier = _Notifier()
            wd = Watchdog(notifier, liveness, interval_s=0.05).start()
            time.sleep(0.3)
            wd.stop()
            assert notifier.pings == 1  # only the first ping at start; the engine loop still beats
            s.engine.model.step = real_step  # a step that completes makes it healthy again
            assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
            assert c.get("/health").status_code == 200 and liveness.problem() is None
    finally:
        s.batch.stop()


def test_a_blocked_http_event_loop_stops_the_watchdog():
    """The serve stage's heartbeat check: the engine keeps stepping (its counter advances on
    another thread), but a handler blocks the event loop; the pings stop while it is blocked,
    naming the event loop, and resume when the loop runs again."""
    import asyncio

    liveness = Liveness()
    heartbeat = LoopHeartbeat(stall_s=0.3)
    liveness.add_check("http", heartbeat.check)
    engine_running = threading.Event()
    engine_running.set()

    def engine_loop():
        while engine_running.is_set():
            liveness.beat()
            time.sleep(0.01)

    notifier = _Notifier()
    seen: dict[str, object] = {}

    async def serve():
        async def run_loop(seconds):
            t_end = time.monotonic() + seconds
            while time.monotonic() < t_end:
                await asyncio.sleep(0.02)
                heartbeat.beat()

        await run_loop(0.4)
        seen["pings_healthy"] = notifier.pings
        time.sleep(0.5)  # a handler that blocks the loop past stall_s
        seen["problem"] = liveness.problem()
        pings_at = notifier.pings
        time.sleep(0.4)  # still blocked: no ping goes out
        seen["pings_while_blocked"] = notifier.pings - pings_at
        pings_at = notifier.pings
        await run_loop(0.6)  # the loop runs again
        seen["problem_after"] = liveness.problem()
        seen["pings_after"] = notifier.pings - pings_at

    threading.Thread(target=engine_loop, daemon=True).start()
    wd = Watchdog(notifier, liveness, interval_s=0.05).start()
    try:
        asyncio.run(serve())
    finally:
        wd.stop()
        engine_running.clear()
    assert seen["pings_healthy"] > 2
    assert str(seen["problem"]).startswith("http: the HTTP event loop has not run for")
    assert seen["pings_while_blocked"] == 0
    assert seen["problem_after"] is None and seen["pings_after"] > 0


def test_a_dead_worker_pool_turns_health_503():
    s = Stack()
    try:
        class Pool:
            broken = None

        class Ops:
            pool = Pool()

        s.engine.model.ops = Ops()
        with TestClient(s.app) as c:
            assert c.get("/health").status_code == 200
            Ops.pool.broken = "worker 1 on CPU 1 failed: OSError(22)"
            r = c.get("/health")
            assert r.status_code == 503 and "worker pool is dead: worker 1 on CPU 1" in r.json()["reason"]
    finally:
        s.close()


def test_a_stalled_engine_turns_health_503():
    s = Stack(step_delay_s=1.0)
    s.batch.stall_s = 0.2
    try:
        with TestClient(s.app) as c:
            t = threading.Thread(target=lambda: c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1}))
            t.start()
            deadline = time.monotonic() + 5
            r = c.get("/health")
            while r.status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
                r = c.get("/health")
            assert r.status_code == 503 and "no engine step completed" in r.json()["reason"]
            t.join(10)
    finally:
        s.close()


def test_a_dead_engine_thread_turns_health_503(stack, client):
    stack.batch.stop()
    stack.batch._thread = threading.Thread(target=lambda: None)
    stack.batch._thread.start()
    stack.batch._thread.join()
    r = client.get("/health")
    assert r.status_code == 503 and "engine thread has exited" in r.json()["reason"]


def test_fault_injection_is_not_in_the_production_config():
    from moe_service.config import describe_fields

    keys = [f"{t}.{k}" for t, fields in describe_fields().items() for k in fields]
    words = {k: set(k.replace(".", "_").split("_")) for k in keys}
    assert not [k for k, w in words.items() if w & {"fault", "faults", "inject", "test"}]


# -- chat templates --------------------------------------------------------------------------


class _TemplateTokenizer(FakeTokenizer):
    def __init__(self, source):
        self.compiles = 0
        self.source = source
        self._chat = None

    @property
    def chat(self):
        if self._chat is None:
            from moe_service.errors import ModelFileError

            if self.source is None:
                raise ModelFileError("fake.gguf: the model has no tokenizer.chat_template.")
            self.compiles += 1
            self._chat = ChatTemplate(self.source, source="fake.gguf: tokenizer.chat_template", timeout_s=0.5)
        return self._chat

    def apply_chat_template(self, messages, *, add_generation_prompt=True, **extra):
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt)


def _chat_stack(source):
    from moe_service.engine.engine import Engine

    s = Stack()
    s.engine.tokenizer = _TemplateTokenizer(source)
    s.engine.chat_template_problem = Engine._check_chat_template(s.engine)
    return s


def test_a_model_without_chat_template_gets_400_saying_so():
    s = _chat_stack(None)
    try:
        assert "no tokenizer.chat_template" in s.engine.chat_template_problem  # found at start
        with TestClient(s.app) as c:
            r = c.post("/v1/chat/completions", json=CHAT_OK)
            assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
            assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1}).status_code == 200
    finally:
        s.close()


@pytest.mark.parametrize("source,words", [
    ("{{ messages[0].nothing.deeper }}", "failed to render"),
    ("{% for a in messages %}{% for b in messages %}{% for c in messages %}{% for d in messages %}"
     "{% for e in messages %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}", "runaway"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "runaway"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{{ 'x' * 1000000000 }}", "items"),
])
def test_a_broken_template_is_a_500_naming_it_compiled_once(source, words):
    s = _chat_stack(source)
    try:
        with TestClient(s.app) as c:
            body = {"messages": [{"role": "user", "content": "hi"}] * 60, "max_tokens": 1}
            for _ in range(2):
                t0 = time.monotonic()
                r = c.post("/v1/chat/completions", json=body)
                assert time.monotonic() - t0 < 30
                assert r.status_code == 500, r.text
                err = r.json()["error"]
                assert err["type"] == "server_error" and err["code"] == "chat_template_error"
                assert "tokenizer.chat_template" in err["message"] and words in err["message"]
        assert s.engine.tokenizer.compiles == 1
    finally:
        s.close()


def test_jinja2_is_recent_enough():
    from importlib.metadata import version

    major, minor, patch = (int(x) for x in version("jinja2").split(".")[:3])
    assert (major, minor, patch) >= (3, 1, 6)  # older versions have sandbox escapes
