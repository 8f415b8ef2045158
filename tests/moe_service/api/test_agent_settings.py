"""Settings the agent protocols share, over the real engine loop and the fake model:
serve.model_aliases, keys from ``x-api-key`` as well as ``Authorization: Bearer``."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from moe_service.api.auth import ApiKeys
from moe_service.engine.engine import RequestError
from moe_service.server import create_app
from tests.support.serving_stack import MODEL, chat_ids, greedy_text

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


def test_model_aliases_names_and_globs_mean_the_served_model(stack):
    stack.service.model_aliases = ("claude-*", "gpt-5")
    with TestClient(create_app(stack.service)) as c:
        for name in ("claude-sonnet-4-5-20250929", "claude-3-5-haiku-latest", "gpt-5", MODEL):
            r = c.post("/v1/chat/completions", json={**CHAT, "model": name})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == MODEL  # the answer names the served model
            assert r.json()["choices"][0]["message"]["content"] == greedy_text(chat_ids("hi"), 3)
        r = c.post("/v1/completions", json={"model": "claude-x", "prompt": "abc", "max_tokens": 2})
        assert r.status_code == 200, r.text
        for name in ("gpt-5-mini", "Claude-sonnet", "llama"):
            r = c.post("/v1/chat/completions", json={**CHAT, "model": name})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            msg = r.json()["error"]["message"]
            assert repr(MODEL) in msg and "claude-*" in msg
        assert c.get("/v1/models/claude-opus").json()["id"] == MODEL


def test_without_aliases_an_unknown_model_is_a_400_naming_the_served_one(stack):
    with TestClient(create_app(stack.service)) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "model": "claude-sonnet-4"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "model" and err["code"] == "model_not_found" and repr(MODEL) in err["message"]


def test_x_api_key_or_bearer_either_admits(stack):
    stack.service.keys = ApiKeys(["sk-good"])
    with TestClient(create_app(stack.service)) as c:
        assert c.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "sk-good"}).status_code == 200
        assert (
            c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-good"}).status_code
            == 200
        )
        # one valid key among the two admits
        both = {"authorization": "Bearer sk-bad", "x-api-key": "sk-good"}
        assert c.post("/v1/chat/completions", json=CHAT, headers=both).status_code == 200
        both = {"authorization": "Bearer sk-good", "x-api-key": "sk-bad"}
        assert c.post("/v1/chat/completions", json=CHAT, headers=both).status_code == 200
        r = c.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "sk-bad"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["message"] == "Incorrect API key provided."
        r = c.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": ""})
        assert r.status_code == 401 and "x-api-key" in r.json()["error"]["message"]


def test_max_tokens_policy_refuse_by_default_on_chat_clamp_when_set(stack):
    n_ctx = stack.engine.n_ctx
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": n_ctx, "temperature": 0}
    n_prompt = len(chat_ids("hi"))
    with TestClient(create_app(stack.service)) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "max_tokens"
        stack.service.max_tokens_policy = "clamp"
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == n_ctx - n_prompt
        # a prompt that fills the context is refused whatever the policy
        r = c.post("/v1/completions", json={"prompt": list(range(3, 3 + n_ctx)), "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_plan_output_per_endpoint_policy_and_absent_limit(stack):
    svc, n_ctx, default = stack.service, stack.engine.n_ctx, stack.engine.max_tokens_default
    assert svc.max_tokens_policy == "auto"
    # auto: the endpoint's own policy
    assert svc.plan_output(10, n_ctx, endpoint_policy="clamp") == n_ctx - 10
    with pytest.raises(RequestError) as e:
        svc.plan_output(10, n_ctx, endpoint_policy="refuse", param="max_output_tokens")
    assert e.value.param == "max_output_tokens" and e.value.code == "context_length_exceeded"
    # no limit given: serve.max_tokens_default, or the rest of the context (Codex sends none)
    assert svc.plan_output(10, None, endpoint_policy="clamp") == min(default, n_ctx - 10)
    assert svc.plan_output(10, None, endpoint_policy="clamp", absent="context") == n_ctx - 10
    # an explicit setting wins over the endpoint's default
    svc.max_tokens_policy = "refuse"
    with pytest.raises(RequestError):
        svc.plan_output(10, n_ctx, endpoint_policy="clamp")
    svc.max_tokens_policy = "clamp"
    assert svc.plan_output(10, n_ctx, endpoint_policy="refuse") == n_ctx - 10
    assert svc.plan_output(10, 5, endpoint_policy="refuse") == 5
