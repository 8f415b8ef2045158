"""The agent-facing API over the real engine loop and the fake model: logprobs against the
model's own log-softmax (both endpoints, streamed too), grammar-constrained decoding in the
batch loop beside unconstrained sequences, API keys (file reload, 401 objects, /health and
/metrics), Content-Type, Host allow-list and CORS, the openai client's AuthenticationError."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from moe_service.api.auth import ApiKeyFileError, ApiKeys, host_allowed, is_loopback, warn_if_open
from moe_service.server import create_app
from tests.support.serving_fakes import N_VOCAB, expected_chain
from tests.support.serving_stack import MODEL, TOK, ThreadedServer, chat_ids, greedy_text, sse_events


def fake_logprobs(seq_ids: list[int], n: int, top: int):
    """Expected (token, logprob, top list) for n greedy steps after ``seq_ids``: the fake model's
    logits row (10.0 at the rule's token, 0 elsewhere) through torch.log_softmax in float64."""
    from tests.support.serving_fakes import rule

    out = []
    seq = list(seq_ids)
    for _ in range(n):
        t = rule(seq[-1], len(seq))
        row = torch.zeros(N_VOCAB, dtype=torch.float64)
        row[t] = 10.0
        lp = torch.log_softmax(row, 0)
        order = sorted(range(N_VOCAB), key=lambda i: (-lp[i].item(), i))[:top]
        out.append((t, lp[t].item(), [(i, lp[i].item()) for i in order]))
        seq.append(t)
    return out


def piece(t):
    return TOK.token_to_piece(t, special=True).decode()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_match_the_models_log_softmax(client, stream):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "stream": stream}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        content = [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                   for x in c["choices"][0]["logprobs"]["content"]]
    else:
        content = r.json()["choices"][0]["logprobs"]["content"]
    want = fake_logprobs(chat_ids("hi"), 5, 3)
    assert len(content) == 5
    for got, (t, lp, top) in zip(content, want, strict=True):
        assert got["token"] == piece(t) and got["bytes"] == list(piece(t).encode())
        assert got["logprob"] == pytest.approx(lp, abs=1e-9)
        assert [(x["token"], x["logprob"]) for x in got["top_logprobs"]] == \
            [(piece(i), pytest.approx(v, abs=1e-9)) for i, v in top]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_match_the_models_log_softmax(client, stream):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "temperature": 0, "logprobs": 2,
                                             "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        blocks = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        lp = {k: [x for b in blocks for x in b[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        text = "".join(c["choices"][0]["text"] for c in chunks)
    else:
        lp = r.json()["choices"][0]["logprobs"]
        text = r.json()["choices"][0]["text"]
    want = fake_logprobs(TOK.encode("abc"), 4, 2)
    assert lp["tokens"] == [piece(t) for t, _, _ in want]
    assert lp["token_logprobs"] == pytest.approx([v for _, v, _ in want], abs=1e-9)
    assert [list(d) for d in lp["top_logprobs"]] == [[piece(i) for i, _ in top] for _, _, top in want]
    assert lp["text_offset"] == [0, 1, 2, 3] and text == greedy_text(TOK.encode("abc"), 4)


def test_constrained_sequence_beside_free_ones_in_the_batch_loop(stack):
    """A grammar forces its tokens against the model's preference; sequences decoded in the
    same steps without a constraint still get exactly the model's greedy chain."""
    import threading

    from moe_service.api.grammar import compile_constraint, lark_grammar
    from moe_service.engine.engine import GenerationRequest
    from moe_service.engine.sampler import SamplingParams

    done: dict[str, list] = {"c": [], "f1": [], "f2": []}
    finished = threading.Event()

    def emit(name):
        def f(ev):
            done[name].append(ev)
            if all(d and d[-1].final for d in done.values()):
                finished.set()
        return f

    constraint = compile_constraint(TOK, lark_grammar('start: /[abc]{6}/ "!"'))
    greedy = SamplingParams(temperature=0.0)
    prompts = {"c": TOK.encode("zzz"), "f1": TOK.encode("hello"), "f2": TOK.encode("world")}
    reqs = {
        "c": GenerationRequest(prompts["c"], 30, greedy, emit=emit("c"), constraint=constraint),
        "f1": GenerationRequest(prompts["f1"], 12, greedy, emit=emit("f1")),
        "f2": GenerationRequest(prompts["f2"], 12, greedy, emit=emit("f2")),
    }
    for r in reqs.values():
        stack.batch.submit(r)
    assert finished.wait(10)
    text = {k: "".join(e.text for e in v) for k, v in done.items()}
    assert len(text["c"]) == 7 and set(text["c"][:6]) <= set("abc") and text["c"][6] == "!"
    assert done["c"][-1].finish_reason == "stop"  # the grammar completed: no extra step
    for k in ("f1", "f2"):
        assert text[k] == TOK.decode(expected_chain(prompts[k], 12))
    assert constraint.masks >= 7


def test_json_schema_on_a_model_that_cannot_write_json_is_refused_cleanly(client):
    """The fake vocabulary has no '{': the grammar cannot be satisfied, the request gets a 400
    that says so, and the server keeps serving."""
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                                   "response_format": {"type": "json_object"}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format" and "vocabulary" in err["message"]
    ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert ok.status_code == 200


# -- API keys and browser hardening ---------------------------------------------------------------------


def test_key_file_is_read_and_reloaded(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-one\n\n  sk-two  \n")
    keys = ApiKeys(["sk-static"], f)
    assert keys.enabled and keys.count == 3
    assert keys.check("sk-one") and keys.check("sk-two") and keys.check("sk-static")
    assert not keys.check("sk-on") and not keys.check("") and not keys.check(None)
    f.write_text("sk-three\n")
    assert keys.reload()
    assert keys.check("sk-three") and not keys.check("sk-one") and keys.check("sk-static")
    f.unlink()
    assert not keys.reload()  # unreadable: the previous keys stay
    assert keys.check("sk-three")
    with pytest.raises(ApiKeyFileError, match=str(f)):
        ApiKeys([], f)
    f.write_text("# nothing\n")
    empty = ApiKeys([], f)
    assert empty.enabled and empty.count == 0 and not empty.check("anything")


def test_hosts_and_loopback():
    assert host_allowed("api.example.com:8000", ["api.example.com"])
    assert host_allowed("x.example.com", ["*.example.com"]) and not host_allowed("example.org", ["*.example.com"])
    assert host_allowed("[::1]:8000", ["::1"]) and host_allowed("anything", ["*"])
    assert not host_allowed("evil.example", ["localhost", "127.0.0.1"])
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    assert warn_if_open("0.0.0.0", None) and not warn_if_open("127.0.0.1", None)
    assert not warn_if_open("0.0.0.0", ApiKeys(["k"]))


def _keyed_app(stack, **kw):
    svc = stack.service
    svc.keys = ApiKeys(["sk-good"])
    for k, v in kw.items():
        setattr(svc, k, v)
    return create_app(svc)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("metrics_auth", [False, True])
def test_keys_401_200_health_open_metrics_per_setting(stack, metrics_auth):
    with TestClient(_keyed_app(stack, metrics_auth=metrics_auth)) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                      "param": None, "code": "invalid_api_key"}}
        assert c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-bad"}).status_code == 401
        assert c.get("/v1/models", headers={"authorization": "Basic sk-good"}).status_code == 401
        assert c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-good"}).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == (401 if metrics_auth else 200)
        assert c.get("/metrics", headers={"authorization": "Bearer sk-good"}).status_code == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x", None])
def test_non_json_bodies_are_refused(client, ctype):
    headers = {"content-type": ctype} if ctype else {}
    r = client.post("/v1/chat/completions", content=json.dumps(CHAT).encode(), headers=headers)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    ok = client.post("/v1/chat/completions", content=json.dumps(CHAT).encode(),
                     headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_host_allow_list(stack):
    stack.service.allowed_hosts = ("api.example.com",)
    with TestClient(create_app(stack.service), base_url="http://evil.example") as c:
        r = c.get("/v1/models")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert c.get("/health").status_code == 200
    with TestClient(create_app(stack.service), base_url="http://api.example.com:8000") as c:
        assert c.get("/v1/models").status_code == 200


def test_cors_off_by_default_and_configurable(stack, client):
    pre = {"origin": "https://app.example", "access-control-request-method": "POST",
           "access-control-request-headers": "content-type"}
    r = client.options("/v1/chat/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers
    r = client.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://app.example"})
    assert "access-control-allow-origin" not in r.headers
    stack.service.cors_origins = ("https://app.example",)
    with TestClient(create_app(stack.service)) as c:
        r = c.options("/v1/chat/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.options("/v1/chat/completions", headers={**pre, "origin": "https://other.example"})
        assert r.headers.get("access-control-allow-origin") != "https://other.example"


def test_openai_client_gets_authentication_error_without_the_key(stack):
    import openai

    srv = ThreadedServer(_keyed_app(stack))
    try:
        bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-bad", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-good", max_retries=0)
        r = good.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2, temperature=0)
        assert r.choices[0].message.content == greedy_text(chat_ids("hi"), 2)
    finally:
        srv.stop()
