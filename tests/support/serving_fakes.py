"""Test doubles for the serving tests: a model with the real step()/kv interface and a
deterministic next-token rule, and a character-level tokenizer with a chat template.

The rule: after a sequence holds L tokens whose last is t, the next token is
``rule(t, L) = 2 + (3 * t + L) % (V - 2)`` (never EOS: tests of end-of-generation feed
:class:`~moe_service.engine.engine.Sequence` their own logits). Logits are one-hot-ish float32 [S, V] torch tensors, so greedy
sampling picks the rule's token.
"""

from __future__ import annotations

import threading
import time

import torch

from moe_service.engine.model import KVCache

BOS_ID, EOS_ID = 0, 1
ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.:!?\n"
N_VOCAB = 2 + len(ALPHABET)


def rule(last: int, length: int) -> int:
    return 2 + (3 * last + length) % (N_VOCAB - 2)


def expected_chain(prompt_ids: list[int], n: int) -> list[int]:
    """The greedy continuation the fake model produces for ``prompt_ids`` (n tokens)."""
    seq = list(prompt_ids)
    out = []
    for _ in range(n):
        tok = rule(seq[-1], len(seq))
        out.append(tok)
        seq.append(tok)
    return out


def FakeKV(n_seq: int, n_ctx: int) -> KVCache:
    """The real slot bookkeeping (alloc/free/length/n_free, same errors) without K/V storage."""
    return KVCache(n_seq, n_ctx, [], [])


class FakeModel:
    """Model.step's contract: batch of (slot, new token ids), each slot once, appended at its
    length; returns float32 logits [S, V] for each entry's last token (only the entries
    flagged in ``want_logits`` when given, in order).

    ``poison``: a token id whose presence in a step makes it raise RuntimeError;
    ``step_delay_s``: sleep per step. ``steps`` records each step's [(slot, n_tokens)],
    ``threads`` the names of the threads that called step.
    """

    def __init__(self, n_seq: int = 4, n_ctx: int = 256, *, poison: int | None = None, step_delay_s: float = 0.0):
        self.kv = FakeKV(n_seq, n_ctx)
        self.n_ctx = n_ctx
        self.poison = poison
        self.step_delay_s = step_delay_s
        self.steps: list[list[tuple[int, int]]] = []
        self._last: dict[int, int] = {}
        self.threads: set[str] = set()

    def step(self, batch: list[tuple[int, list[int]]], *, want_logits: list[bool] | None = None) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        if want_logits is not None and len(want_logits) != len(batch):
            raise ValueError(f"want_logits has {len(want_logits)} flags for {len(batch)} batch entries")
        slots = [s for s, _ in batch]
        assert len(set(slots)) == len(slots), f"a slot appears twice in one step: {slots}"
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        for s, toks in batch:
            if not toks:
                raise ValueError(f"sequence slot {s}: no tokens to compute")
            if self.kv.length[s] + len(toks) > self.n_ctx:
                raise ValueError(f"sequence slot {s}: exceeds the context of {self.n_ctx}")
            if self.poison is not None and self.poison in toks:
                raise RuntimeError(f"poisoned token {self.poison} in slot {s}")
        self.steps.append([(s, len(t)) for s, t in batch])
        want = want_logits if want_logits is not None else [True] * len(batch)
        logits = torch.zeros(sum(want), N_VOCAB, dtype=torch.float32)
        row = 0
        for i, (s, toks) in enumerate(batch):
            self.kv.length[s] += len(toks)
            if want[i]:
                logits[row, rule(toks[-1], self.kv.length[s])] = 10.0
                row += 1
        return logits


class FakeTokenizer:
    """One character per token (ALPHABET), BOS 0 / EOS 1 as control tokens, add_bos."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    add_bos = True
    eog_ids = frozenset({EOS_ID})

    @property
    def n_vocab(self) -> int:
        return N_VOCAB

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        ids = []
        i = 0
        while i < len(text):
            if parse_special and text.startswith("<s>", i):
                ids.append(BOS_ID)
                i += 3
                continue
            ch = text[i].lower()
            if ch in ALPHABET:
                ids.append(2 + ALPHABET.index(ch))
            i += 1
        if add_special and not (ids and ids[0] == BOS_ID):
            ids.insert(0, BOS_ID)
        return ids

    def token_to_piece(self, token_id: int, *, special: bool = False) -> bytes:
        if token_id < 2:
            return (b"<s>" if token_id == 0 else b"</s>") if special else b""
        return ALPHABET[token_id - 2].encode()

    def decode(self, ids, *, special: bool = False) -> str:
        return b"".join(self.token_to_piece(i, special=special) for i in ids).decode()

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, **extra) -> str:
        from moe_service.engine.tokenizer import ChatTemplateError

        for m in messages:
            if m["role"] == "assistant" and m is messages[0]:
                raise ChatTemplateError("chat template rejected the conversation: starts with assistant", "raised")
        text = "<s>" + "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


def make_engine(n_seq: int = 4, n_ctx: int = 256, *, ubatch_tokens: int = 8, max_tokens_default: int = 16,
                **model_kw):
    from moe_service.engine.engine import Engine

    model = FakeModel(n_seq, n_ctx, **model_kw)
    return Engine(model, FakeTokenizer(), model_name="fake-moe", ubatch_tokens=ubatch_tokens,
                  max_tokens_default=max_tokens_default)


def run_fake_service() -> int:
    """The real lifecycle and serve stage over a fake engine (``python -m tests.support.serving_fakes``).

    Stages ``warmup`` (builds the fake engine; step delay from $FAKE_STEP_DELAY_S) and ``serve``;
    settings from the usual config sources (tests pass MOE_SERVICE__* variables).
    """
    import os

    from moe_service.config import load_config
    from moe_service.log import configure_logging
    from pipeline.lifecycle import run_service
    from pipeline.serve import ServeStage
    from pipeline.spec import Stage

    class FakeWarmup(Stage):
        name = "warmup"
        writes = ("engine",)

        def run(self, ctx):
            cfg = ctx.config
            ctx.engine = make_engine(n_seq=cfg.serve.parallel, ubatch_tokens=cfg.engine.ubatch_tokens,
                                     max_tokens_default=cfg.serve.max_tokens_default,
                                     step_delay_s=float(os.environ.get("FAKE_STEP_DELAY_S", "0.01")))

        def close(self, ctx):
            ctx.engine = None

    settings = load_config(None)
    configure_logging(settings.log.level, settings.log.target)
    return run_service(settings, registry={"warmup": FakeWarmup, "serve": ServeStage}, prepare=lambda ctx: None)


if __name__ == "__main__":
    import sys

    sys.exit(run_fake_service())
