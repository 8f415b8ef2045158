"""The synthetic gpt-oss writer: llama.cpp's tensor layout, deterministic bytes, the harmony
vocabulary and chat template (rendered by our jinja2 renderer)."""

from __future__ import annotations

import datetime

import numpy as np
import pytest

from moe_service import synth_gpt_oss as S
from moe_service.engine import tokenizer as tk
from moe_service.errors import ConfigError
from moe_service.gguf_model import GGUFModel
from moe_service.synth import sha256_file


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return S.write_gpt_oss(tmp_path_factory.mktemp("oss") / "tiny.gguf", "tiny-gpt-oss", n_layer=2)


def test_layout_and_metadata(tiny):
    m = GGUFModel.open(tiny)
    p = m.params
    assert (p.arch, p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.head_dim) == ("gpt-oss", 2, 256, 8, 2, 64)
    assert (p.n_expert, p.n_expert_used, p.n_ff_exp, p.n_vocab, p.rope_freq_base) == (16, 4, 256, 8192, 150000.0)
    md = m.metadata
    assert md["gpt-oss.attention.sliding_window"] == 16
    assert md["gpt-oss.rope.scaling.type"] == "yarn" and md["gpt-oss.rope.scaling.factor"] == 32.0
    assert md["gpt-oss.rope.scaling.original_context_length"] == 4096
    t = m.tensors
    H, E, I, Q, KV = 256, 16, 256, 8 * 64, 2 * 64  # noqa: E741
    want = {"attn_q.weight": (H, Q), "attn_q.bias": (Q,), "attn_k.bias": (KV,), "attn_v.weight": (H, KV),
            "attn_output.weight": (Q, H), "attn_output.bias": (H,), "attn_sinks.weight": (8,),
            "post_attention_norm.weight": (H,), "ffn_gate_inp.weight": (H, E), "ffn_gate_inp.bias": (E,),
            "ffn_gate_exps.weight": (H, I, E), "ffn_gate_exps.bias": (I, E), "ffn_up_exps.bias": (I, E),
            "ffn_down_exps.weight": (I, H, E), "ffn_down_exps.bias": (H, E)}
    for name, ne in want.items():
        assert tuple(t[f"blk.1.{name}"].ne) == ne, name
    assert t["blk.0.ffn_gate_exps.weight"].ggml_type == 39  # MXFP4
    assert t["blk.0.ffn_down_exps.bias"].ggml_type == 0  # F32
    assert sorted(m.expert_layers[1]) == ["down", "gate", "up"]  # biases are not expert slabs


def test_same_arguments_same_bytes(tiny, tmp_path):
    again = S.write_gpt_oss(tmp_path / "again.gguf", "tiny-gpt-oss", n_layer=2)
    assert sha256_file(again) == sha256_file(tiny)
    other = S.write_gpt_oss(tmp_path / "seed1.gguf", "tiny-gpt-oss", n_layer=2, seed=1)
    assert sha256_file(other) != sha256_file(tiny)


def test_presets_validate():
    with pytest.raises(ConfigError, match="expert_type 'TQ1_0'"):
        S.resolve_preset("tiny-gpt-oss", expert_type="TQ1_0")
    with pytest.raises(ConfigError, match="unknown gpt-oss preset"):
        S.resolve_preset("gpt-oss-1t")
    p = S.resolve_preset("gpt-oss-120b")
    assert (p.n_embd, p.n_expert, p.n_ff_exp, p.n_expert_used) == (2880, 128, 2880, 4)


def test_harmony_vocabulary_and_template(tiny, monkeypatch):
    md = tk.read_gguf_metadata(tiny, prefixes=("tokenizer.",))
    tok = tk.Tokenizer.from_gguf(md, source=str(tiny))
    ids = {t: tok.token_to_id[t] for t in S.HARMONY_SPECIALS}
    assert md["tokenizer.ggml.eos_token_id"] == ids["<|return|>"]
    assert md["tokenizer.ggml.bos_token_id"] == ids["<|startoftext|>"]
    assert {ids["<|return|>"], ids["<|call|>"]} <= set(tok.eog_ids)
    monkeypatch.setattr(tk, "_strftime_now", lambda fmt: datetime.date(2026, 12, 1).strftime(fmt))
    tmpl = tk.ChatTemplate(md["tokenizer.chat_template"])
    text = tmpl.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                    "Knowledge cutoff: 2024-06\nCurrent date: 2026-12-01\n\nReasoning: medium\n\n"
                    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
                    "<|end|><|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
                    "<|start|>user<|message|>Hi<|end|><|start|>assistant")
    enc = tok.encode(text, add_special=False, parse_special=True)
    assert enc.count(ids["<|start|>"]) == 4 and enc.count(ids["<|end|>"]) == 3
    assert "<|channel|>analysis" not in text
    with pytest.raises(tk.ChatTemplateError, match="harmony channel tags"):
        tmpl.render([{"role": "user", "content": "x"},
                     {"role": "assistant", "content": "<|channel|>final<|message|>y"}, {"role": "user", "content": "z"}])
    with pytest.raises(tk.ChatTemplateError, match="tool message must follow"):
        tmpl.render([{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}])


def test_tool_call_turns_render(monkeypatch):
    monkeypatch.setattr(tk, "_strftime_now", lambda fmt: "2026-12-01")
    tmpl = tk.ChatTemplate(S.harmony_template())
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
            "days": {"type": "integer", "default": 1}, "tags": {"type": "array", "items": {"type": "string"}}}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "thinking": "need the tool",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": '{"temp": 21}'}]
    text = tmpl.render(msgs, tools=tools, reasoning_effort="high")
    assert "Reasoning: high" in text
    assert ("type get_weather = (_: {\n// City name\ncity: string,\nunit?: \"c\" | \"f\", // default: c,\n"
            "days?: number, // default: 1,\ntags?: string[],\n}) => any;") in text
    assert text.endswith('<|start|>assistant<|channel|>analysis<|message|>need the tool<|end|>'
                         '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                         '"{\\"city\\": \\"Paris\\"}"<|call|>'
                         '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
                         '"{\\"temp\\": 21}"<|end|><|start|>assistant')
    assert np.char.count(text, "<|start|>developer") == 1
