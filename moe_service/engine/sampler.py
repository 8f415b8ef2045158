"""Next-token sampling and stop-sequence matching, one request at a time.

    logits [V] float32 --temperature--> --top-k--> --top-p--> softmax --draw (seeded)--> token id
    (temperature < 1e-6, 0 included: greedy argmax, the lowest id wins a tie, as llama.cpp's greedy sampler)

Order: temperature first, then top-k, then top-p on the tempered distribution (the
OpenAI/HF convention: a low temperature narrows the nucleus). Each request owns a numpy
``Generator`` (PCG64) seeded from its ``seed``, so a seeded request draws the same tokens
whatever else is being served. Draws are inverse-CDF over the kept tokens in descending
probability order (ties by lower id), one ``Generator.random()`` per token.

:class:`StopSequenceMatcher` finds the earliest stop string across streamed text chunks
and holds back a tail that could still become one, so no part of a stop string is ever
streamed to the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (OpenAI request fields).

    Attributes:
        temperature: >= 0; 0 means greedy.
        top_k: keep the k most likely tokens; 0 means no limit.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p;
            1.0 means no limit. In (0, 1].
        seed: seeds the request's random generator; ``None`` draws fresh OS entropy.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @classmethod
    def of_request(cls, temperature: float | None, top_k: int | None, top_p: float | None,
                   seed: int | None = None) -> SamplingParams:
        """From a request's fields as every protocol sends them: an absent field takes the
        default (temperature 1, no top-k, no top-p), a seed is taken modulo 2**64."""
        return cls(temperature=1.0 if temperature is None else temperature, top_k=top_k or 0,
                   top_p=1.0 if top_p is None else top_p, seed=None if seed is None else seed % (1 << 64))

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (got {self.temperature}).")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k}).")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p}).")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0 (got {self.seed}).")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below GREEDY_BELOW_TEMPERATURE,
        0 included, or top_k 1)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


GREEDY_BELOW_TEMPERATURE = 1e-6
"""Temperatures below this sample greedily: the tempered distribution is argmax to within
float64 already (a logit gap of 1e-4 becomes 100 nats), and dividing by a subnormal
temperature (1e-320) overflows every logit to +-inf, which cannot be sampled."""


def greedy(logits: np.ndarray) -> int:
    """Argmax of ``logits`` [V]; ties go to the lowest id (numpy returns the first maximum).

    Raises:
        ValueError: the maximum is NaN (a broken forward pass, not a choice).
    """
    idx = int(np.argmax(logits))
    if np.isnan(logits[idx]):
        raise ValueError("logits contain NaN: cannot pick a token.")
    return idx


# Top-p without top-k first tries the best _TOP_P_PROBE tokens (O(V) partition) and sorts the
# whole vocabulary only when their mass does not reach top_p.
_TOP_P_PROBE = 1024


class Sampler:
    """Draws next tokens for one request from its :class:`SamplingParams`.

    ``sample`` takes the last position's logits, a 1-D float array [V] (float32 as the
    engine produces them; copied to float64 for the softmax), and returns a token id.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(params.seed))

    def sample(self, logits: np.ndarray) -> int:
        """Next token id for ``logits`` [V].

        Raises:
            ValueError: ``logits`` is not 1-D, or the surviving logits are NaN / all -inf.
        """
        if logits.ndim != 1:
            raise ValueError(f"logits must be 1-D [V] (got shape {logits.shape}).")
        p = self.params
        if p.greedy:
            return greedy(logits)
        ids, probs = self.candidates(logits)
        u = self.rng.random()
        cdf = np.cumsum(probs)
        k = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        return int(ids[min(k, len(ids) - 1)])

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens sampling may pick and their probabilities.

        Returns:
            ``(ids int64 [N], probs float64 [N])``: ids in descending probability order (ties
            by lower id), probs renormalized to sum to 1 over the kept set.
        """
        p = self.params
        x = np.asarray(logits, dtype=np.float64)
        if p.temperature != 1.0:
            x = x / p.temperature
        if np.isnan(x).any():
            raise ValueError("logits contain NaN: cannot sample.")
        n_vocab = x.shape[0]
        k = p.top_k if 0 < p.top_k < n_vocab else n_vocab
        if k < n_vocab:
            ids = _top_ids(x, k)
        elif p.top_p < 1.0 and n_vocab > _TOP_P_PROBE:
            ids = _top_ids(x, _TOP_P_PROBE)
            # does the probe hold top_p of the full distribution's mass?
            m = x[ids[0]]
            if not np.isfinite(m):
                raise ValueError("all candidate logits are -inf: cannot sample.")
            full_mass = np.exp(x - m).sum()
            if np.exp(x[ids] - m).sum() < p.top_p * full_mass:
                ids = _sorted_ids(x)
            else:
                probs = np.exp(x[ids] - m) / full_mass
                return _nucleus(ids, probs, p.top_p)
        else:
            ids = _sorted_ids(x)
        sel = x[ids]
        m = sel[0]
        if not np.isfinite(m):
            raise ValueError("all candidate logits are -inf: cannot sample.")
        w = np.exp(sel - m)
        probs = w / w.sum()
        if p.top_p < 1.0:
            return _nucleus(ids, probs, p.top_p)
        return ids, probs


def _sorted_ids(x: np.ndarray) -> np.ndarray:
    # descending value, ties by lower id: stable sort of the negated values
    return np.argsort(-x, kind="stable")


def _top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values, descending, ties by lower id (also at the k boundary)."""
    kth = np.partition(x, x.shape[0] - k)[x.shape[0] - k]  # the k-th largest value
    above = np.flatnonzero(x > kth)
    tied = np.flatnonzero(x == kth)[: k - above.shape[0]]
    cand = np.concatenate([above, tied])
    return cand[np.argsort(-x[cand], kind="stable")]


def _nucleus(ids: np.ndarray, probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep the shortest prefix of ``ids`` whose probability mass reaches ``top_p`` (at least one)."""
    cdf = np.cumsum(probs)
    n = int(np.searchsorted(cdf, top_p, side="left")) + 1
    n = min(n, ids.shape[0])
    kept = probs[:n]
    return ids[:n], kept / kept.sum()


def _prefix_function(s: str) -> list[int]:
    """Knuth-Morris-Pratt failure function: fail[i] = length of the longest proper prefix of
    ``s[:i + 1]`` that is also its suffix. O(len(s))."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


def _advance(k: int, text: str, stop: str, fail: list[int]) -> int:
    """The KMP automaton of ``stop`` from state ``k`` (the longest prefix of ``stop`` the text
    so far ends with) over the new ``text``: the state after it. Amortized O(len(text)) per
    call, whatever the stop's length (trying every prefix length with endswith cost
    O(len(text) x len(stop)) per chunk). A complete match, which the caller finds first with
    str.find, falls back to the longest proper border."""
    for ch in text:
        while k and ch != stop[k]:
            k = fail[k - 1]
        if ch == stop[k]:
            k += 1
            if k == len(stop):  # only when text holds the stop itself; callers exclude that
                k = fail[k - 1]
    return k


class StopSequenceMatcher:
    """Cuts a streamed completion at the earliest stop string (the stop text is not emitted).

    Feed each decoded text chunk to :meth:`push`; it returns the text that is safe to stream
    now. A tail that is a prefix of some stop string is held back until the next chunk
    decides it; :meth:`flush` releases it at the end of generation. After a stop string is
    found, ``stopped`` is True, ``matched`` names it, and further pushes return ``""``.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._fail = [_prefix_function(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # per stop: longest prefix of it the text so far ends with
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Add a chunk; return the text to emit now (possibly ``""``)."""
        if self.stopped:
            return ""
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return buf
        best_at, best_stop = -1, None
        for stop in self.stops:
            at = buf.find(stop)
            if at >= 0 and (best_at < 0 or at < best_at):
                best_at, best_stop = at, stop
        if best_stop is not None:
            self.stopped, self.matched, self._held = True, best_stop, ""
            return buf[:best_at]
        hold = 0
        for k, (stop, fail) in enumerate(zip(self.stops, self._fail, strict=True)):
            self._state[k] = _advance(self._state[k], text, stop, fail)
            hold = max(hold, self._state[k])
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    @property
    def held(self) -> str:
        """Text withheld because it may start a stop string."""
        return self._held

    def flush(self) -> str:
        """End of generation without a stop string: release the held tail."""
        out, self._held = self._held, ""
        return "" if self.stopped else out
