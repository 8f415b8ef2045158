"""A tool call cut by the output limit never leaks the template's markup into the text
(issue 26): every cut position of recorded calls, in every text family, finished with the
engine's ``length`` reason, through both answer builders."""

from __future__ import annotations

import json

import pytest

from moe_service.api import tools as tl
from moe_service.api.chat import MessageBuilder, StreamBuilder
from tests.moe_service.api.test_tools import DS_DSML, DS_V3, DS_V31, HERMES, TOOLS

B, E, CB, CE, SEP = tl.DS_CALLS_BEGIN, tl.DS_CALLS_END, tl.DS_CALL_BEGIN, tl.DS_CALL_END, tl.DS_SEP
D = tl.DSML

# (format, text before the call, the call as the model writes it, its markers)
CALLS = [
    (
        HERMES,
        "",
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ("<tool_call>", "</tool_call>"),
    ),
    (
        HERMES,
        "Let me look.",
        '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
        ("<tool_call>", "</tool_call>"),
    ),
    (DS_V3, "", f'{B}{CB}function{SEP}get_time\n```json\n{{"zone": "UTC"}}\n```{CE}{E}', (B, CB, SEP, CE, E)),
    (DS_V31, "Sure.", f'{B}{CB}get_time{SEP}{{"zone": "UTC"}}{CE}{E}', (B, CB, SEP, CE, E)),
    (
        DS_DSML,
        "",
        f'<{D}function_calls>\n<{D}invoke name="get_time">\n<{D}parameter name="zone" string="true">UTC'
        f"</{D}parameter>\n</{D}invoke>\n</{D}function_calls>",
        (f"<{D}", f"</{D}"),
    ),
]


def _markup_prefixes(markers):
    """Every prefix of 2+ characters of every marker (what a cut can leave)."""
    return {m[:n] for m in markers for n in range(2, len(m) + 1)}


def _run(fmt, pieces, reason):
    p = tl.OutputParser(fmt, tools=TOOLS, reasoning=True)
    out = []
    for piece in pieces:
        out += p.feed(piece)
    out += p.finish(reason)
    return out


@pytest.mark.parametrize(
    "fmt,before,call,markers", CALLS, ids=[f"{c[0].description}-{i}" for i, c in enumerate(CALLS)]
)
def test_every_cut_of_a_call_ends_with_the_partial_call_or_nothing(fmt, before, call, markers):
    full = before + call
    name = (
        json.loads("{" + call.split("{", 1)[1].rsplit("}", 1)[0] + "}").get("name")
        if fmt is HERMES
        else "get_time"
    )
    for n in range(len(before), len(full)):
        text = full[:n]
        for pieces in ([text], list(text)):
            deltas = _run(fmt, pieces, "length")
            mb = MessageBuilder()
            mb.add(deltas)
            msg = mb.message()
            content = msg["content"] or ""
            # no marker, and no start of one, at the end of the text; the text before the call stays
            assert not any(
                content.endswith(p) or p in content for p in _markup_prefixes(markers) if p.strip()
            ), (n, content)
            assert content.strip() == before.strip()
            calls = msg.get("tool_calls", [])
            assert len(calls) <= 1 and all(c["function"]["name"] == name for c in calls)
            assert mb.finish_reason("length") == "length"
            # streamed: the same text, and the whitespace before a cut call is not sent
            sb = StreamBuilder()
            streamed = sb.deltas(deltas, final=True)
            assert "".join(d.get("content", "") for d in streamed).strip() == before.strip()
            assert "".join(d.get("content", "") for d in streamed).rstrip() == content.rstrip()


def test_a_call_missing_only_its_closing_marker_is_kept():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool'
    mb = MessageBuilder()
    mb.add(_run(HERMES, [text], "length"))
    msg = mb.message()
    assert msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_time", {"zone": "UTC"})
    ]


def test_without_the_length_reason_the_text_is_the_models():
    """A model that writes ``<tool`` and stops (end of turn) wrote it: it stays text, as before."""
    assert "".join(d.text for d in _run(HERMES, ["See <tool"], "stop")) == "See <tool"
    bad = '<tool_call>\n{"name": "rm", "arguments": {}}'
    assert "".join(d.text for d in _run(HERMES, [bad], "stop")) == bad


def test_reasoning_cut_inside_its_closing_marker_drops_the_marker_start():
    deltas = _run(HERMES, ["<think>\nhmm</thi"], "length")
    assert "".join(d.text for d in deltas if d.kind == "reasoning") == "\nhmm"
    assert not [d for d in deltas if d.kind == "content"]
