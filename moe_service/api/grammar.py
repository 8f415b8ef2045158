"""Token-level constrained decoding with llguidance (JSON schemas, Lark grammars).

Why llguidance: measured against xgrammar and outlines-core on the demo model's 49,152-token
vocabulary (bench/grammar.py, numbers in docs/api.md) it builds its
token trie in well under a second, compiles a schema in milliseconds (no per-schema index
over the vocabulary as outlines-core builds), computes a mask in tens of microseconds and
accepts Lark grammars with embedded JSON schemas (``%json{...}``), which tool calls need
(literal framing text around a schema-checked object). It is maintained by Microsoft and used
by llama.cpp and vLLM.

Life of a constraint::

    request (handler thread, asyncio.to_thread)
        grammar text --compile_constraint--> TokenConstraint (LLMatcher, bitmask int32 [ceil(V/32)])
            (an uncompilable schema/grammar raises GrammarError: 400 naming the problem)
    engine thread, each step that samples for the sequence
        BatchLoop: compute_mask() in the mask worker thread while model.step runs (both drop
        the GIL), then per sequence: apply(logits [V]) -> disallowed ids = -inf -> sample
        -> consume(token)

The tokenizer adapter follows llguidance's llama.cpp binding: each token is its bytes
(control tokens written as their text), control tokens prefixed with 0xFF so the grammar's
text can never be spelled with them; the end-of-generation ids are the grammar's EOS tokens
(allowed only once the grammar is complete).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from moe_service.log import get_logger

log = get_logger(__name__)

# llguidance's JSON options for every schema we compile: no free whitespace (a sampled model
# could otherwise emit newlines forever inside a valid object), ", " and ": " separators.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar the engine cannot compile; the message names the problem."""


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads from a tokenizer: token bytes, EOS, BOS, encode."""

    def __init__(self, tokenizer) -> None:
        from moe_service.engine.tokenizer import ATTR_CONTROL

        attrs = getattr(tokenizer, "attrs", None)
        toks: list[bytes] = []
        for i in range(tokenizer.n_vocab):
            piece = tokenizer.token_to_piece(i, special=True)
            control = (attrs[i] & ATTR_CONTROL) if attrs is not None else tokenizer.is_eog(i) or i == tokenizer.bos_id
            toks.append(b"\xff" + piece if control else piece)
        self.tokens = toks
        eog = sorted(getattr(tokenizer, "eog_ids", ()) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else []))
        self.eos_token_id = eog[0] if eog else 0
        self.eog_ids = eog
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i, t in enumerate(toks) if t.startswith(b"\xff")]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


_LL_TOKENIZERS: dict[int, Any] = {}
_LL_LOCK = threading.Lock()


def ll_tokenizer(tokenizer):
    """The llguidance LLTokenizer of ``tokenizer`` (built once per tokenizer object, ~0.3-1 s
    for a 50k-150k vocabulary; thread-safe)."""
    import llguidance

    key = id(tokenizer)
    with _LL_LOCK:
        cached = _LL_TOKENIZERS.get(key)
        if cached is not None and cached[0] is tokenizer:
            return cached[1]
        view = _TokenizerView(tokenizer)
        llt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=tokenizer.n_vocab,
                                     eos_token=view.eog_ids or None)
        _LL_TOKENIZERS[key] = (tokenizer, llt)
        return llt


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """llguidance grammar text for a JSON schema (our JSON options merged in)."""
    import llguidance

    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object (got {type(schema).__name__})")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def lark_json(schema: dict[str, Any]) -> str:
    """A ``%json{...}`` Lark item for ``schema`` with our JSON options."""
    return "%json" + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}},
                                separators=(",", ":"))


def lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def compile_constraint(tokenizer, grammar: str) -> TokenConstraint:
    """A fresh :class:`TokenConstraint` for ``grammar`` (from json_schema_grammar / lark_grammar).

    Raises GrammarError with llguidance's message when the grammar does not compile, or when
    no token of the vocabulary can start the output (the first mask is empty).
    """
    import llguidance

    llt = ll_tokenizer(tokenizer)
    err = llguidance.LLMatcher.validate_grammar(grammar, llt)
    if err:
        raise GrammarError(err.strip())
    matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    c = TokenConstraint(matcher, tokenizer.n_vocab)
    c.compute_mask()  # the first mask now: kept for the first sampling step
    if matcher.is_error() or not c.bitmask.any():
        raise GrammarError("no token of this model's vocabulary can start the required output"
                           + (f": {matcher.get_error()}" if matcher.is_error() else ""))
    return c


class TokenConstraint:
    """One sequence's grammar state: which tokens may come next.

    ``matcher``: a llguidance LLMatcher; ``n_vocab``: V. The mask is an int32 bitmask
    [ceil(V/32)] (bit i of word w allows token 32*w + i). Not thread-safe: the engine thread
    and, during a step, the mask worker (never both at once) use it.
    """

    def __init__(self, matcher, n_vocab: int):
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.bitmask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self._mask_ready = False
        self.mask_s = 0.0  # time spent computing masks (seconds, for the bench and logs)
        self.masks = 0

    def compute_mask(self) -> None:
        """Fill the bitmask for the next token (drops the GIL; ~10-100 us)."""
        import time

        t0 = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        self._mask_ready = True

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next."""
        if not self._mask_ready:
            self.compute_mask()
        bits = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")
        return bits[: self.n_vocab].astype(bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` [V] float32 with every disallowed token at -inf (a new array).

        Raises ValueError when the grammar is in an error state or allows nothing.
        """
        if self.matcher.is_error():
            raise ValueError(f"grammar error: {self.matcher.get_error()}")
        ok = self.allowed()
        if not ok.any():
            raise ValueError("the grammar allows no next token")
        return np.where(ok, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def consume(self, token: int) -> None:
        """Advance past ``token`` (sampled under the mask). Raises ValueError when the grammar
        refuses it (a bug: the mask allowed it)."""
        self._mask_ready = False
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """True when the grammar admits nothing more (only an end-of-generation token)."""
        return self.matcher.is_stopped()
