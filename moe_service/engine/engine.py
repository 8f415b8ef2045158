"""The engine: model + tokenizer + sampler, one request's life from prompt text to finished text.

::

    chat messages --chat template--> prompt text --encode (one BOS)--> prompt ids [P]
    completion prompt (text or ids) -------------------------------^
    prompt ids --plan_max_tokens (context policy)--> GenerationRequest
      --Sequence: per step, logits [V] --sample--> token --detokenize--> text --stop strings--> delta
      --finish: "stop" (end-of-generation token or a stop string) | "length" (max_tokens / context)

:class:`Engine` holds what every request shares; :class:`Sequence` holds one request's state
(sampler with its seeded generator, incremental detokenizer, stop-string matcher, counts) and
is advanced by whoever calls ``model.step`` (the batch loop in moe_service.engine.batch, or
:meth:`Engine.generate` when nothing else runs: warmup, tools).

Context policy (P prompt tokens, C = ``model.n_ctx`` tokens per sequence, M = max_tokens):

- P >= C: refused (400, code ``context_length_exceeded``): no room for a single completion token;
- M given and P + M > C: policy ``refuse`` (the OpenAI API's): refused (400,
  ``context_length_exceeded``); policy ``clamp`` (llama.cpp's server; what agents that ask for a
  fixed large output need, Claude Code sends 32,000): M = C - P, and the answer ends with the
  length reason when it reaches the context;
- M not given: M = min(``serve.max_tokens_default``, C - P) (``absent="default"``), or C - P
  (``absent="context"``: the rest of the context, for clients that never send a limit), and
  the answer ends with finish_reason ``"length"`` when it reaches M.

So a completion never runs past the context. Which policy each endpoint uses is
``serve.max_tokens_policy`` (moe_service.server.Service.plan_output).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moe_service.engine.sampler import Sampler, SamplingParams, StopSequenceMatcher
from moe_service.engine.tokenizer import IncrementalDetokenizer
from moe_service.log import get_logger

log = get_logger(__name__)

_SHARD_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")


def served_model_name(configured: str, path: str | Path) -> str:
    """The model id served at /v1/models and checked in requests: ``configured`` when set, else
    the file name without ``.gguf`` and without a ``-0000k-of-0000N`` shard suffix."""
    if configured:
        return configured
    name = Path(path).name
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    return _SHARD_SUFFIX.sub("", name)


class RequestError(ValueError):
    """A request the engine cannot serve as asked (the server answers with an OpenAI error object).

    ``status``: HTTP status (400 unless said otherwise); ``type``: OpenAI error type;
    ``param``: the request field at fault (dotted, e.g. ``messages.1.content``) or None;
    ``code``: a short machine-readable code or None.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerationRequest:
    """One request as the engine runs it.

    ``prompt_ids``: token ids [P] (BOS included where the model wants it); ``max_tokens``: most
    tokens to generate (already fitted to the context by :meth:`Engine.plan_max_tokens`);
    ``sampling``: temperature/top-k/top-p/seed; ``stop``: strings that end the completion (not
    emitted); ``ignore_eos``: keep generating past end-of-generation tokens (benchmarks);
    ``constraint``: a moe_service.api.grammar.TokenConstraint (or any object with
    ``apply(logits) -> logits``, ``consume(token)``, ``done``, ``compute_mask()``) whose mask
    is applied before every sampling; ``logprobs``: when not None, each sampled token's
    log-probability and this many alternatives (0..20) ride on the events. ``emit`` is called
    from the engine thread with each :class:`Event` and must not block. ``t_arrival_s`` (time.monotonic) is when the server received it; the batch loop
    fills ``t_first_token_s``. ``cancelled`` may be set from any thread (a client went away).
    """

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    stop: tuple[str, ...] = ()
    emit: Any = None
    request_id: str = ""
    t_arrival_s: float = field(default_factory=time.monotonic)
    t_first_token_s: float | None = None
    cancelled: bool = False
    ignore_eos: bool = False
    constraint: Any = None
    logprobs: int | None = None


@dataclass
class TokenLogprob:
    """One sampled token's log-probability under the model (log-softmax of the raw logits,
    before temperature, top-k/top-p and any grammar mask), and the ``top`` alternatives as
    (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 [V] log-probabilities of ``logits`` [V] (max-subtracted, one log-sum-exp)."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x)
    z = x - m
    return z - np.log(np.sum(np.exp(z)))


def token_logprob(logp: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """``token``'s entry and the ``n_top`` best of ``logp`` [V] (ties: lower id first)."""
    top: list[tuple[int, float]] = []
    if n_top > 0:
        from moe_service.engine.sampler import _top_ids

        top = [(int(i), float(logp[i])) for i in _top_ids(logp, min(n_top, logp.shape[0]))]
    return TokenLogprob(int(token), float(logp[token]), top)


@dataclass
class Event:
    """What the engine hands to the request's owner after a step.

    ``text``: new completion text (may be empty: held back by a stop-string prefix or a
    partial UTF-8 character); ``n_tokens``: tokens generated by this step for the request
    (0 or 1). The last event of a request has ``finish_reason`` ("stop" or "length") and the
    usage counts, or ``error`` (a RequestError with status 500/503) instead. ``token_ids``:
    the tokens sampled by this step (parsers that read tokens: gpt-oss harmony);
    ``logprobs``: their :class:`TokenLogprob` entries when the request asked for logprobs
    (end-of-generation tokens excluded: they add no text).
    """

    text: str = ""
    n_tokens: int = 0
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: RequestError | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (usage.prompt_tokens_details)
    stop_sequence: str | None = None  # the request's stop string that ended it (Anthropic's stop_reason)

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Sequence:
    """One request in generation: feeds prompt then generated tokens, turns logits into text.

    The caller owns the model slot and the stepping: it feeds :attr:`prompt_ids` (in chunks),
    then after every step whose last input token was this sequence's, calls :meth:`accept`
    with that step's logits row [V] float32; :meth:`next_input` gives the token to feed next.
    """

    def __init__(self, engine: Engine, request: GenerationRequest):
        self.engine = engine
        self.request = request
        self.prompt_ids = request.prompt_ids
        self.n_prefilled = 0  # prompt tokens already in the KV cache
        self.cached_tokens = 0  # of which reused from earlier requests (engine/prefix.py)
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.slot: int | None = None  # the model's KV slot while the batch loop runs it
        self.t_last_token_s: float | None = None  # time.monotonic() of the last sampled token
        self.sampler = Sampler(request.sampling)
        self.detok = IncrementalDetokenizer(engine.tokenizer)
        self.stops = StopSequenceMatcher(request.stop)

    @property
    def prefilling(self) -> bool:
        return self.n_prefilled < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_input(self) -> list[int]:
        """The one token to feed in a decode step: the last generated token."""
        return [self.generated[-1]]

    def accept(self, logits: np.ndarray) -> Event:
        """Sample the next token from ``logits`` [V] and advance; returns the event to emit.

        With a constraint, tokens its grammar forbids are masked to -inf before sampling, and
        a grammar that is complete after the token ends the sequence ("stop") without another
        step. Raises ValueError when the logits cannot be sampled (NaN, all -inf, a grammar
        that allows nothing).
        """
        req = self.request
        n_top = req.logprobs
        logp = log_softmax(logits) if n_top is not None else None
        constraint = req.constraint
        tok = self.sampler.sample(constraint.apply(logits) if constraint is not None else logits)
        self.generated.append(tok)
        n = len(self.generated)
        is_eog = self.engine.tokenizer.is_eog(tok)
        lp = [token_logprob(logp, tok, n_top)] if logp is not None and n_top is not None and not is_eog else None
        if constraint is not None and not is_eog:
            constraint.consume(tok)
        if is_eog and not req.ignore_eos:
            return self._finish("stop", self.stops.push(self.detok.flush()) + self.stops.flush(), tok, lp)
        text = self.stops.push(self.detok.push(tok))
        if self.stops.stopped:
            return self._finish("stop", text, tok, lp)
        if (constraint is not None and constraint.done) or n >= req.max_tokens \
                or len(self.prompt_ids) + n >= self.engine.n_ctx:
            text += self.stops.push(self.detok.flush())
            if self.stops.stopped or (constraint is not None and constraint.done):
                return self._finish("stop", text + self.stops.flush(), tok, lp)
            return self._finish("length", text + self.stops.flush(), tok, lp)
        return Event(text=text, n_tokens=1, token_ids=[tok], logprobs=lp)

    def _finish(self, reason: str, text: str, tok: int, lp: list[TokenLogprob] | None) -> Event:
        self.finish_reason = reason
        return Event(text=text, n_tokens=1, finish_reason=reason, prompt_tokens=len(self.prompt_ids),
                     completion_tokens=len(self.generated), token_ids=[tok], logprobs=lp,
                     cached_tokens=self.cached_tokens, stop_sequence=self.stops.matched if self.stops.stopped else None)


@dataclass
class Generation:
    """Result of :meth:`Engine.generate`: text, token ids, finish reason, timings in seconds."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    prefill_s: float
    decode_s: float


class Engine:
    """Tokenizer + model + sampling: what the server needs to turn a request into tokens.

    ``model``: moe_service.engine.model.Model (or any object with ``step(batch) -> logits
    [S, V]``, ``kv.alloc()/free()/n_free`` and ``n_ctx``); ``tokenizer``:
    moe_service.engine.tokenizer.Tokenizer; ``model_name``: the id clients must send;
    ``ubatch_tokens``: prompt tokens per forward step; ``max_tokens_default``: when a request
    gives none. Only one thread may call ``model.step`` at a time (the batch loop, or
    :meth:`generate` before the loop starts).
    """

    def __init__(self, model, tokenizer, *, model_name: str, ubatch_tokens: int = 128,
                 max_tokens_default: int = 256):
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.ubatch_tokens = int(ubatch_tokens)
        self.max_tokens_default = int(max_tokens_default)
        self.n_ctx = int(model.n_ctx)
        self.created_s = int(time.time())
        tokens = getattr(tokenizer, "tokens", None)
        # No prompt longer than this can fit: every token covers at most its longest text's
        # characters (byte-level and SPM token texts have at least one character per byte).
        self.max_prompt_chars: int | None = (self.n_ctx * max(1, max(map(len, tokens)))
                                             if isinstance(tokens, list) and tokens else None)
        self.chat_template_problem = self._check_chat_template()

    def _check_chat_template(self) -> str | None:
        """Compile the chat template now (once) and log what /v1/chat/completions will answer:
        None when it compiled, else the reason chat requests fail."""
        if not hasattr(type(self.tokenizer), "chat"):
            return None
        from moe_service.engine.tokenizer import ChatTemplateError
        from moe_service.errors import ModelFileError

        try:
            self.tokenizer.chat  # noqa: B018 - compiles and caches it
        except ModelFileError as e:
            log.warning("chat_template_missing", model=self.model_name, error=str(e),
                        effect="/v1/chat/completions answers 400 no_chat_template")
            return str(e)
        except ChatTemplateError as e:
            log.error("chat_template_invalid", model=self.model_name, error=str(e),
                      effect="/v1/chat/completions answers 500 chat_template_error")
            return str(e)
        return None

    # -- prompts -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | SequenceABC[int], *, param: str = "prompt") -> list[int]:
        """Token ids of a completion prompt: text (special tokens parsed, BOS added where the
        model wants it, as llama.cpp's server tokenizes prompts) or token ids taken as given.

        Raises RequestError (param ``prompt``) for an empty prompt or an id outside the vocabulary.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt must not be empty", param=param)
            ids = self.tokenizer.encode(prompt, add_special=True, parse_special=True)
        else:
            ids = [int(t) for t in prompt]
            n_vocab = self.tokenizer.n_vocab
            bad = next((t for t in ids if not 0 <= t < n_vocab), None)
            if bad is not None:
                raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {n_vocab})", param=param)
        if not ids:
            raise RequestError("prompt must not be empty", param=param)
        return ids

    def encode_chat(self, messages: SequenceABC[Mapping[str, Any]]) -> list[int]:
        """Render ``messages`` with the model's chat template (generation prompt added) and
        tokenize with special tokens parsed and exactly one BOS where the model wants one.

        Raises RequestError (param ``messages``) when the template rejects the conversation.
        """
        return self.render_chat(messages)[0]

    def render_chat(self, messages: SequenceABC[Mapping[str, Any]],
                    template_vars: Mapping[str, Any] | None = None) -> tuple[list[int], str]:
        """:meth:`encode_chat` with extra template variables (``tools``, ``enable_thinking``,
        ...); returns (prompt ids, rendered prompt text).

        Raises RequestError (param ``messages``) when the template rejects the conversation.
        """
        from moe_service.engine.tokenizer import ChatTemplateError
        from moe_service.errors import ModelFileError

        if not messages:
            raise RequestError("messages must hold at least one message", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                      **dict(template_vars or {}))
        except ChatTemplateError as e:
            if e.kind == "raised":  # the template refused this conversation: the client's to fix
                raise RequestError(str(e), param="messages") from None
            # the model's template is broken (syntax, render failure, runaway loop): our fault
            raise RequestError(f"the model's chat template failed: {e}", status=500, type="server_error",
                               code="chat_template_error") from None
        except ModelFileError as e:  # no tokenizer.chat_template in the model
            raise RequestError(f"this model has no chat template ({e}); /v1/chat/completions cannot format "
                               "messages for it: use /v1/completions with a formatted prompt",
                               param="messages", code="no_chat_template") from None
        ids = self.tokenizer.encode(text, add_special=True, parse_special=True)
        bos = self.tokenizer.bos_id
        if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # a template that writes BOS itself plus add_bos: keep exactly one
        if not ids:
            raise RequestError("the rendered chat prompt is empty", param="messages")
        return ids, text

    def plan_max_tokens(self, prompt_tokens: int, requested: int | None, *, prompt_param: str = "prompt",
                        param: str = "max_tokens", policy: str = "refuse", absent: str = "default") -> int:
        """The completion budget under the context policy (module docstring): ``policy``
        ``refuse`` | ``clamp`` for a ``requested`` that does not fit; ``absent`` ``default``
        (serve.max_tokens_default) | ``context`` (the rest of the context) when ``requested`` is
        None.

        Raises RequestError (code ``context_length_exceeded``, naming ``prompt_param`` or
        ``param``) when the prompt leaves no room, or when an explicit ``requested`` does not
        fit under ``refuse``. ValueError for an unknown ``policy`` or ``absent``.
        """
        if policy not in ("refuse", "clamp") or absent not in ("default", "context"):
            raise ValueError(f"plan_max_tokens: policy {policy!r} / absent {absent!r}")
        room = self.n_ctx - prompt_tokens
        if room <= 0:
            raise RequestError(
                f"This model's maximum context length is {self.n_ctx} tokens. However, your prompt has "
                f"{prompt_tokens} tokens, which leaves no room for a completion. Please shorten the prompt.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            return room if absent == "context" else min(self.max_tokens_default, room)
        if prompt_tokens + requested > self.n_ctx and policy == "clamp":
            log.info("max_tokens_clamped", requested=requested, served=room, prompt_tokens=prompt_tokens,
                     n_ctx=self.n_ctx)
            return room
        if prompt_tokens + requested > self.n_ctx:
            raise RequestError(
                f"This model's maximum context length is {self.n_ctx} tokens. However, you requested "
                f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} in the "
                f"completion). Please reduce the prompt or the completion length.",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    # -- running -----------------------------------------------------------------------------

    def new_sequence(self, request: GenerationRequest) -> Sequence:
        """A :class:`Sequence` for ``request`` (no model slot yet)."""
        return Sequence(self, request)

    def generate(self, prompt_ids: list[int], *, max_tokens: int,
                 sampling: SamplingParams | None = None, stop: tuple[str, ...] = ()) -> Generation:
        """Run one request to the end on this thread (prefill in ubatch chunks, then decode).

        For warmup and tools only: it calls ``model.step`` directly, so it must not run while
        the batch loop runs. Raises RuntimeError when no sequence slot is free.
        """
        req = GenerationRequest(list(prompt_ids), max_tokens, sampling or SamplingParams(temperature=0.0), stop)
        seq = self.new_sequence(req)
        slot = self.model.kv.alloc()
        parts: list[str] = []
        try:
            t0 = time.monotonic()
            logits = None
            n = len(seq.prompt_ids)
            for a in range(0, n, self.ubatch_tokens):
                last = a + self.ubatch_tokens >= n
                logits = self.model.step([(slot, seq.prompt_ids[a : a + self.ubatch_tokens])], want_logits=[last])
            seq.n_prefilled = len(seq.prompt_ids)
            t1 = time.monotonic()
            if logits is None:
                raise ValueError("generate: empty prompt (no token to prefill)")
            while True:
                row = logits[0]
                ev = seq.accept(row.numpy() if hasattr(row, "numpy") else row)
                parts.append(ev.text)
                if ev.final:
                    break
                logits = self.model.step([(slot, seq.next_input())])
            t2 = time.monotonic()
        finally:
            self.model.kv.free(slot)
        return Generation("".join(parts), list(seq.generated), seq.finish_reason or "length",
                          len(seq.prompt_ids), t1 - t0, t2 - t1)

    def close(self) -> None:
        """Stop the model's kernel workers (``ops.close()`` when it has one) and drop the model
        (its KV cache and dense tensors) and the tokenizer."""
        ops = getattr(self.model, "ops", None)
        if ops is not None and hasattr(ops, "close"):
            try:
                ops.close()
            except Exception as e:  # closing goes on
                log.warning("engine_ops_close_failed", error=str(e))
        self.model = None
        self.tokenizer = None
