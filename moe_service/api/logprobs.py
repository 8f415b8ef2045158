"""logprobs in the OpenAI shapes, from the engine's :class:`~moe_service.engine.engine.TokenLogprob`.

The numbers are the model's own distribution: log-softmax of the step's raw logits (float64),
before temperature, top-k/top-p and any grammar mask, the convention of vLLM's default
``raw_logprobs``. A token's text is its bytes decoded as UTF-8 (a token holding part of a
character shows U+FFFD; ``bytes`` carries the exact bytes).

- /v1/chat/completions, ``logprobs: true`` + ``top_logprobs: 0..20``::

    "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                 "bytes"}, ...]}, ...], "refusal": null}

- /v1/completions, ``logprobs: 0..20``::

    "logprobs": {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
                 "text_offset": [...]}

Streamed chunks carry the same objects for the tokens of that chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_TOP_LOGPROBS = 20


def _piece(tokenizer, token_id: int) -> tuple[str, bytes]:
    b = tokenizer.token_to_piece(token_id, special=True)
    return b.decode("utf-8", errors="replace"), b


def chat_content(tokenizer, entries: Sequence[Any]) -> list[dict[str, Any]]:
    """The ``logprobs.content`` list of a chat choice for ``entries`` (TokenLogprob)."""
    out = []
    for e in entries:
        text, b = _piece(tokenizer, e.token_id)
        top = []
        for tid, lp in e.top:
            t, tb = _piece(tokenizer, tid)
            top.append({"token": t, "logprob": lp, "bytes": list(tb)})
        out.append({"token": text, "logprob": e.logprob, "bytes": list(b), "top_logprobs": top})
    return out


def chat_logprobs(tokenizer, entries: Sequence[Any]) -> dict[str, Any]:
    return {"content": chat_content(tokenizer, entries), "refusal": None}


class CompletionLogprobs:
    """Builds the legacy completions ``logprobs`` object; ``text_offset`` counts characters of
    the completion text from ``start`` (OpenAI counts from the start of the prompt when echo
    is on; echo is not supported here)."""

    def __init__(self, tokenizer, start: int = 0):
        self.tokenizer = tokenizer
        self.offset = start

    def block(self, entries: Sequence[Any]) -> dict[str, Any]:
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            text, _ = _piece(self.tokenizer, e.token_id)
            tokens.append(text)
            lps.append(e.logprob)
            top: dict[str, float] = {}
            for tid, lp in e.top:
                t, _ = _piece(self.tokenizer, tid)
                top.setdefault(t, lp)
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
