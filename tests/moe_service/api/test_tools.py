"""Tool-call and reasoning parsers of every family on model outputs in each family's format
(well-formed and malformed), whole and streamed in pieces; format detection by template
probing; the fallback prompt; the constraint grammars of each family (llguidance, on SmolLM2's
real vocabulary) accepting the family's own call and refusing others.

The outputs are written in the formats the models emit (Qwen2.5/Qwen3 Hermes calls, DeepSeek
R1/V3 fenced calls, V3.1 calls, V3.2/V4 DSML, Llama 3.1 JSON, gpt-oss harmony); no such model
runs here, so they are transcriptions of those formats, plus the demo model's own outputs.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from moe_service.api import tools as tl
from tests.support.smollm2 import needs_smollm2

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
                                                                               "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
]

HERMES = tl.ChatFormat(family="hermes", reasoning=True)
DS_V3 = tl.ChatFormat(family="deepseek", dialect="v3", reasoning=True)
DS_V31 = tl.ChatFormat(family="deepseek", dialect="v31", reasoning=True)
DS_DSML = tl.ChatFormat(family="deepseek", dialect="dsml", reasoning=True)
LLAMA3 = tl.ChatFormat(family="llama3")

B, E, CB, CE, SEP = tl.DS_CALLS_BEGIN, tl.DS_CALLS_END, tl.DS_CALL_BEGIN, tl.DS_CALL_END, tl.DS_SEP
D = tl.DSML

# (format, prompt opened <think>, output, expected calls [(name, args)], content, reasoning)
RECORDED = [
    # Qwen2.5: one call
    (HERMES, False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     '</tool_call>', [("get_weather", {"city": "Paris", "unit": "celsius"})], "", ""),
    # Qwen2.5: text, then two parallel calls
    (HERMES, False, 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}\n</tool_call>',
     [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "Europe/Oslo"})], "Let me check both.\n\n", ""),
    # Qwen3 thinking, then a call
    (HERMES, False, '<think>\nThe user wants the weather in Rome.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Rome"}}\n</tool_call>', [("get_weather", {"city": "Rome"})], "",
     "\nThe user wants the weather in Rome.\n"),
    # Qwen3 thinking, plain answer
    (HERMES, False, "<think>\nEasy.\n</think>\n\nIt is 4.", [], "It is 4.", "\nEasy.\n"),
    # malformed: JSON missing a brace -> content
    (HERMES, False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', [],
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', ""),
    # malformed: unknown function -> content
    (HERMES, False, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', [],
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', ""),
    # malformed: arguments not an object -> content
    (HERMES, False, '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>', [],
     '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>', ""),
    # malformed: cut off by max_tokens -> content
    (HERMES, False, 'ok <tool_call>\n{"name": "get_wea', [], 'ok <tool_call>\n{"name": "get_wea', ""),
    # a lone "<" that is not a marker stays content
    (HERMES, False, "a < b and <tool is fine", [], "a < b and <tool is fine", ""),
    # DeepSeek R1 (prompt opened <think>): reasoning, then fenced call
    (DS_V3, True, f"I should call the tool.\n</think>\n\n{B}{CB}function{SEP}get_weather\n```json\n"
     f'{{"city": "Lima"}}\n```{CE}{E}', [("get_weather", {"city": "Lima"})], "", "I should call the tool.\n"),
    # DeepSeek V3: two calls
    (DS_V3, False, f'{B}{CB}function{SEP}get_weather\n```json\n{{"city": "A"}}\n```{CE}\n{CB}function{SEP}'
     f'get_time\n```json\n{{"zone": "UTC"}}\n```{CE}{E}',
     [("get_weather", {"city": "A"}), ("get_time", {"zone": "UTC"})], "", ""),
    # DeepSeek V3.1
    (DS_V31, False, f'Sure.{B}{CB}get_time{SEP}{{"zone": "Asia/Tokyo"}}{CE}{E}',
     [("get_time", {"zone": "Asia/Tokyo"})], "Sure.", ""),
    # DeepSeek V3.1: bad JSON -> content
    (DS_V31, False, f'{B}{CB}get_time{SEP}{{"zone": Asia}}{CE}{E}', [],
     f'{B}{CB}get_time{SEP}{{"zone": Asia}}{CE}{E}', ""),
    # DeepSeek V3.2 / V4 DSML
    (DS_DSML, False, f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" '
     f'string="true">Hangzhou</{D}parameter>\n<{D}parameter name="unit" string="true">celsius</{D}parameter>\n'
     f'</{D}invoke>\n</{D}function_calls>', [("get_weather", {"city": "Hangzhou", "unit": "celsius"})], "", ""),
    (DS_DSML, False, f'<{D}function_calls>\n<{D}invoke name="get_time">\n<{D}parameter name="zone" '
     f'string="false">[1, 2]</{D}parameter>\n</{D}invoke>\n</{D}function_calls>', [("get_time", {"zone": [1, 2]})],
     "", ""),
    # DSML with a non-JSON value for string="false" -> content
    (DS_DSML, False, f'<{D}function_calls>\n<{D}invoke name="get_time">\n<{D}parameter name="zone" '
     f'string="false">not json</{D}parameter>\n</{D}invoke>\n</{D}function_calls>', [],
     f'<{D}function_calls>\n<{D}invoke name="get_time">\n<{D}parameter name="zone" '
     f'string="false">not json</{D}parameter>\n</{D}invoke>\n</{D}function_calls>', ""),
    # Llama 3.1 JSON call, bare and after <|python_tag|>
    (LLAMA3, False, '{"name": "get_weather", "parameters": {"city": "Cairo"}}', [("get_weather", {"city": "Cairo"})],
     "", ""),
    (LLAMA3, False, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
     [("get_time", {"zone": "UTC"})], "", ""),
    (LLAMA3, False, '{"name": "get_weather", "parameters": {"city": }', [],
     '{"name": "get_weather", "parameters": {"city": }', ""),
    (LLAMA3, False, "The weather is fine.", [], "The weather is fine.", ""),
]


def _collect(deltas):
    calls = [(d.call.name, json.loads(d.call.arguments)) for d in deltas if d.kind == "tool_call"]
    content = "".join(d.text for d in deltas if d.kind == "content")
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    return calls, content, reasoning


def _parse(fmt, opened, text, pieces):
    p = tl.OutputParser(fmt, tools=TOOLS, reasoning=True, in_reasoning=opened)
    out = []
    for piece in pieces:
        out += p.feed(piece)
    out += p.finish()
    return _collect(out)


@pytest.mark.parametrize("fmt,opened,text,calls,content,reasoning", RECORDED,
                         ids=[f"{r[0].description}-{i}" for i, r in enumerate(RECORDED)])
def test_parsers_on_recorded_outputs_whole_and_streamed(fmt, opened, text, calls, content, reasoning):
    assert _parse(fmt, opened, text, [text]) == (calls, content, reasoning)
    # one character at a time, and random cuts: same result
    assert _parse(fmt, opened, text, list(text)) == (calls, content, reasoning)
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert _parse(fmt, opened, text, pieces) == (calls, content, reasoning)


def test_content_streams_before_the_call_is_complete():
    p = tl.OutputParser(HERMES, tools=TOOLS, reasoning=True)
    first = p.feed("Checking the weather now. <tool_")
    assert _collect(first) == ([], "Checking the weather now. ", "")  # the marker prefix is held
    assert p.feed('call>\n{"name": "get_time", ') == []
    done = p.feed('"arguments": {"zone": "UTC"}}\n</tool_call>')
    assert _collect(done)[0] == [("get_time", {"zone": "UTC"})]


def test_without_tools_a_call_is_plain_content():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    p = tl.OutputParser(HERMES, tools=None, reasoning=False)
    assert _collect(p.feed(text) + p.finish()) == ([], text, "")


def test_call_ids_are_openai_shaped_and_unique():
    ids = {tl.new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("call_") and len(i) == 29 for i in ids)


# -- harmony (openai-harmony needs the genuine o200k vocabulary, which only a gpt-oss GGUF holds) --


def _harmony_encoding():
    base = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if not base or not os.path.exists(os.path.join(base, "o200k_base.tiktoken")):
        pytest.skip("openai-harmony needs the o200k vocabulary (a gpt-oss GGUF's, or TIKTOKEN_ENCODINGS_BASE): "
                    "the package checks the file's SHA-256, so no stand-in can be made here")
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def test_harmony_parser_on_recorded_gpt_oss_output():
    enc = _harmony_encoding()

    class Tok:
        pass

    tok = Tok()
    tl._HARMONY[id(tok)] = enc
    text = ('<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    ids = enc.encode(text, allowed_special="all")
    p = tl.OutputParser(tl.ChatFormat(family="harmony"), tools=TOOLS, reasoning=True, tokenizer=tok)
    out = []
    for t in ids:
        out += p.feed("", [t])
    out += p.finish()
    assert _collect(out) == ([("get_weather", {"city": "Paris"})], "", "Need the weather tool.")


# -- formats and prompts --------------------------------------------------------------------------

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


class TemplateTok:
    def __init__(self, template, vocab=()):
        from moe_service.engine.tokenizer import ChatTemplate

        self.chat_template = template
        self.token_to_id = {t: i for i, t in enumerate(vocab)}
        self._t = ChatTemplate(template)

    def apply_chat_template(self, messages, *, add_generation_prompt=True, **extra):
        return self._t.render(messages, add_generation_prompt=add_generation_prompt, **extra)


def test_template_without_tools_gets_the_hermes_fallback():
    tok = TemplateTok(CHATML)
    fmt = tl.detect_format(tok)
    assert (fmt.family, fmt.native_tools, fmt.native_tool_calls) == ("hermes", False, False)
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out, extra = tl.prepare_messages(fmt, msgs, TOOLS)
    assert extra == {}
    text = tok.apply_chat_template(out)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text


def test_template_with_tools_gets_them_as_its_jinja_variable():
    tok = TemplateTok(QWEN_LIKE, vocab=["<tool_call>", "</tool_call>", "<think>"])
    fmt = tl.detect_format(tok)
    assert (fmt.family, fmt.native_tools, fmt.native_tool_calls, fmt.args_as_object, fmt.reasoning) == \
        ("hermes", True, True, True, True)
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out, extra = tl.prepare_messages(fmt, msgs, TOOLS)
    assert extra == {"tools": TOOLS}
    text = tok.apply_chat_template(out, **extra)
    assert '{"name": "get_weather", "arguments": {"city": "X"}}' in text  # arguments as an object
    assert "sunny" in text and text.count("<tools>") == 1


def test_family_detection_from_vocabulary_and_template():
    assert tl.detect_format(TemplateTok("x", vocab=[tl.DS_CALLS_BEGIN, "<think>"])).description == "deepseek/v31"
    assert tl.detect_format(TemplateTok("```json {{ x }}", vocab=[tl.DS_CALLS_BEGIN])).description == "deepseek/v3"
    assert tl.detect_format(TemplateTok(f"<{tl.DSML}invoke", vocab=[])).description == "deepseek/dsml"
    assert tl.detect_format(TemplateTok("<|python_tag|>{{ tools }}")).family == "llama3"


def test_reasoning_opened_by_the_prompt():
    assert tl.prompt_opens_reasoning(HERMES, "<|im_start|>assistant\n<think>\n")
    assert not tl.prompt_opens_reasoning(HERMES, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not tl.prompt_opens_reasoning(tl.ChatFormat(), "<think>\n")


# -- constraint grammars on a real vocabulary ---------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from moe_service.demo_model import smollm2_gguf_path
    from moe_service.engine.tokenizer import Tokenizer

    return Tokenizer.from_file(smollm2_gguf_path())


def _accepts(tok, grammar, text) -> bool:
    from moe_service.api.grammar import compile_constraint

    c = compile_constraint(tok, grammar)
    for t in tok.encode(text, add_special=False):
        if not c.allowed()[t]:
            return False
        c.consume(t)
    return c.matcher.is_accepting()


CANONICAL = {
    "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
    "deepseek/v3": f'{B}{CB}function{SEP}get_time\n```json\n{{"zone": "UTC"}}\n```{CE}{E}',
    "deepseek/v31": f'{B}{CB}get_time{SEP}{{"zone": "UTC"}}{CE}{E}',
    "deepseek/dsml": f'<{D}function_calls>\n<{D}invoke name="get_time">\n<{D}parameter name="zone" string="true">UTC'
                     f'</{D}parameter>\n</{D}invoke>\n</{D}function_calls>',
    "llama3": '{"name": "get_time", "parameters": {"zone": "UTC"}}',
}


@needs_smollm2
@pytest.mark.parametrize("fmt", [HERMES, DS_V3, DS_V31, DS_DSML, LLAMA3], ids=lambda f: f.description)
def test_tool_grammar_accepts_the_family_call_and_refuses_others(tok, fmt):
    g = tl.tool_grammar(fmt, tok, TOOLS, parallel=False, reasoning_open=False, reasoning_allowed=False)
    good = CANONICAL[fmt.description]
    assert _accepts(tok, g, good)
    assert not _accepts(tok, g, good.replace("get_time", "rm_rf"))
    assert not _accepts(tok, g, "Sure, the time is noon.")
    # and the parser reads what the grammar admits
    p = tl.OutputParser(fmt, tools=TOOLS, reasoning=False)
    assert _collect(p.feed(good) + p.finish())[0] == [("get_time", {"zone": "UTC"})]


@needs_smollm2
def test_tool_grammar_named_function_and_reasoning_prefix(tok):
    named = [TOOLS[0]]
    g = tl.tool_grammar(HERMES, tok, named, parallel=False, reasoning_open=False, reasoning_allowed=True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _accepts(tok, g, call)
    assert _accepts(tok, g, "<think>\nweather, so call it\n</think>\n\n" + call)
    assert not _accepts(tok, g, CANONICAL["hermes"])  # get_time is not the named function
    assert not _accepts(tok, g, '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius"}}\n</tool_call>')
    par = tl.tool_grammar(HERMES, tok, TOOLS, parallel=True, reasoning_open=False, reasoning_allowed=False)
    assert _accepts(tok, par, call + "\n" + CANONICAL["hermes"])
    assert not _accepts(tok, g, call + "\n" + call)


@needs_smollm2
def test_json_grammar_and_uncompilable_schema(tok):
    from moe_service.api.grammar import GrammarError, compile_constraint, json_schema_grammar

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    assert _accepts(tok, tl.json_grammar(HERMES, schema, reasoning_open=False, reasoning_allowed=False), '{"n": 3}')
    assert not _accepts(tok, tl.json_grammar(HERMES, schema, reasoning_open=False, reasoning_allowed=False),
                        '{"n": "3"}')
    assert _accepts(tok, tl.json_grammar(HERMES, schema, reasoning_open=True, reasoning_allowed=True),
                    'hmm\n</think>\n{"n": 3}')
    with pytest.raises(GrammarError, match="pattern|regex|parse"):
        compile_constraint(tok, json_schema_grammar({"type": "string", "pattern": "(["}))
    with pytest.raises(GrammarError, match="nope"):
        compile_constraint(tok, json_schema_grammar({"$ref": "#/nope"}))


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = RECORDED[1][2]  # text + two calls
    p = tl.OutputParser(HERMES, tools=TOOLS, reasoning=False, max_calls=1)
    calls, content, _ = _collect(p.feed(text) + p.finish())
    assert calls == [("get_weather", {"city": "Oslo"})] and content.startswith("Let me check both.")
