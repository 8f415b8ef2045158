"""The DeepSeek V4 chat format: the template synthetic deepseek4 files carry (and the
tokenizer's built-in fallback for a deepseek4 file without one) renders system / user /
assistant turns, <think> and DSML tool calls as the V4 (V3.2 encoding) format, and a chat
request on the tiny-deepseek4-chat model serves through the API with the deepseek reasoning
parser splitting reasoning_content from content.

Format facts (llama.cpp's models/templates/DeepSeek-V3.2.jinja and DeepSeek's V3.2 encoding,
which V4 keeps): BOS, the system text, ``<｜User｜>text<｜Assistant｜>`` then ``<think>`` for
the turn being generated in thinking mode or ``</think>`` otherwise; earlier assistant turns
drop their reasoning and end with ``<｜end▁of▁sentence｜>``.
"""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from moe_service.api import tools as tl
from moe_service.engine.engine import Engine
from moe_service.engine.model import Model
from moe_service.engine.ops import CpuOps
from moe_service.engine.tokenizer import Tokenizer
from moe_service.gguf_model import GGUFModel
from moe_service.synth_deepseek4 import deepseek4_template, write_deepseek4
from moe_service.weights import WeightStore
from tests.support.smollm2 import needs_smollm2

pytestmark = needs_smollm2

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "an earlier thought"},
        {"role": "user", "content": "Count"}]
TOOL = {"type": "function", "function": {"name": "get_time", "description": "the time",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_deepseek4(tmp_path_factory.mktemp("ds4chat") / "chat.gguf", "tiny-deepseek4-chat")


@pytest.fixture(scope="module")
def tok(chat_file):
    return Tokenizer.from_gguf(GGUFModel.open(chat_file).metadata, source=str(chat_file))


def test_turns_and_thinking_render_the_v4_format(tok):
    head = f"{BOS}You are terse.<｜User｜>Hi<｜Assistant｜></think>Hello.{EOS}<｜User｜>Count<｜Assistant｜>"
    assert tok.apply_chat_template(CHAT) == head + "<think>"
    assert tok.apply_chat_template(CHAT, enable_thinking=False) == head + "</think>"
    assert tok.apply_chat_template(CHAT, thinking=False) == head + "</think>"  # DeepSeek's name
    assert tok.apply_chat_template(CHAT[1:2]) == f"{BOS}<｜User｜>Hi<｜Assistant｜><think>"
    ids = tok.encode_chat(CHAT)
    assert ids[0] == tok.bos_id == 0 and ids[1] != 0  # exactly one BOS (the template writes it)
    assert ids[-2:] == [tok.token_to_id["<｜Assistant｜>"], tok.token_to_id["<think>"]]
    fmt = tl.detect_format(tok)
    assert (fmt.family, fmt.dialect, fmt.reasoning, fmt.native_tools, fmt.native_tool_calls) == \
        ("deepseek", "dsml", True, True, True)


def test_tool_calls_and_results_render_as_dsml(tok):
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC", "n": 3}}}
    msgs = CHAT + [{"role": "assistant", "content": None, "reasoning_content": "I need the time", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    text = tok.apply_chat_template(msgs, tools=[TOOL])
    assert text.startswith(f"{BOS}You are terse.\n\n## Tools\n")
    assert '\n<functions>\n{"name": "get_time", "description": "the time"' in text
    assert text.endswith(
        "<｜User｜>Count<｜Assistant｜><think>I need the time</think>\n\n<｜DSML｜function_calls>\n"
        '<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="tz" string="true">UTC</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        f"</｜DSML｜function_calls>{EOS}\n\n<function_results>\n<result>12:00</result>\n</function_results>\n\n<think>")
    # the deepseek parser reads such a block back as the call
    start = text.rindex("<｜DSML｜function_calls>")
    block = text[start:text.index(EOS, start)]
    (parsed,) = tl.parse_deepseek(block, {"get_time"})
    assert parsed.name == "get_time" and '"tz": "UTC"' in parsed.arguments and '"n": 3' in parsed.arguments


def test_a_v4_file_without_a_template_gets_the_builtin_one(chat_file):
    md = dict(GGUFModel.open(chat_file).metadata)
    del md["tokenizer.chat_template"]
    tok = Tokenizer.from_gguf(md, source="no-template.gguf")
    assert tok.chat_template == deepseek4_template()
    md["general.architecture"] = "llama"
    assert Tokenizer.from_gguf(md, source="llama.gguf").chat_template is None


@pytest.fixture(scope="module")
def client(chat_file):
    from moe_service.engine.batch import BatchLoop
    from moe_service.metrics import Metrics
    from moe_service.server import Service, create_app

    torch.set_num_threads(1)
    ops = CpuOps(threads=0)
    cat = GGUFModel.open(chat_file)
    model = Model(cat, WeightStore.load_simple(cat), ops, n_seq=2, n_ctx=512)
    tok = Tokenizer.from_gguf(cat.metadata, source=str(chat_file))
    engine = Engine(model, tok, model_name="tiny-v4")
    metrics = Metrics()
    batch = BatchLoop(engine, parallel=2, queue_size=4, retry_after_s=2, metrics=metrics).start()
    service = Service(engine=engine, batch=batch, metrics=metrics, model_name="tiny-v4", stage=lambda: "serve")
    service.ready = True
    try:
        with TestClient(create_app(service)) as c:
            yield c
    finally:
        batch.stop(timeout_s=5)
        ops.close()


def test_chat_request_serves_reasoning_then_content(client):
    """Thinking on: the prompt ends in <think>; the successor head writes "Let me count."
    (one user-defined token), </think>, then ordinary tokens: reasoning_content and content
    come apart. Thinking off (chat_template_kwargs): the prompt ends in </think>, content only."""
    body = {"model": "tiny-v4", "messages": CHAT, "max_tokens": 6, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    msg = out["choices"][0]["message"]
    assert msg["reasoning_content"] == "Let me count."
    assert msg["content"] and "think>" not in msg["content"]
    assert out["usage"]["completion_tokens"] == 6
    r = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert not msg.get("reasoning_content") and msg["content"] and "think>" not in msg["content"]
