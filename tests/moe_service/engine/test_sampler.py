"""Sampler: greedy ties, temperature/top-k/top-p sets, seeded reproducibility, stop strings."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine.sampler import Sampler, SamplingParams, StopSequenceMatcher, greedy


def test_greedy_picks_max_and_lowest_id_on_tie():
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.9], dtype=np.float32)
    assert greedy(logits) == 1
    assert Sampler(SamplingParams(temperature=0.0)).sample(logits) == 1
    # top_k == 1 is greedy too, whatever the temperature
    assert Sampler(SamplingParams(temperature=5.0, top_k=1, seed=3)).sample(logits) == 1


def test_greedy_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        greedy(np.array([0.0, np.nan, 1.0], dtype=np.float32))
    with pytest.raises(ValueError, match="NaN"):
        Sampler(SamplingParams(temperature=1.0, seed=0)).sample(np.array([0.0, np.nan], dtype=np.float32))


@pytest.mark.parametrize(
    "kw, message",
    [({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"seed": -2}, "seed"), ({"temperature": float("nan")}, "temperature")],
)
def test_params_validation_names_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_top_k_keeps_k_best_with_id_tiebreak_at_the_boundary():
    logits = np.array([1.0, 3.0, 2.0, 2.0, 2.0, 0.0], dtype=np.float32)
    ids, probs = Sampler(SamplingParams(top_k=3, seed=0)).candidates(logits)
    assert ids.tolist() == [1, 2, 3]  # 2.0 is tied three ways: lowest ids kept
    assert probs.sum() == pytest.approx(1.0)
    e = np.exp(np.array([3.0, 2.0, 2.0]) - 3.0)
    np.testing.assert_allclose(probs, e / e.sum())


def test_top_p_keeps_the_shortest_prefix_reaching_p():
    probs_in = np.array([0.05, 0.5, 0.3, 0.15])
    logits = np.log(probs_in).astype(np.float32)
    ids, probs = Sampler(SamplingParams(top_p=0.8, seed=0)).candidates(logits)
    assert ids.tolist() == [1, 2]  # 0.5 + 0.3 reaches 0.8
    np.testing.assert_allclose(probs, [0.5 / 0.8, 0.3 / 0.8], rtol=1e-6)
    ids, _ = Sampler(SamplingParams(top_p=0.81, seed=0)).candidates(logits)
    assert ids.tolist() == [1, 2, 3]
    ids, _ = Sampler(SamplingParams(top_p=0.01, seed=0)).candidates(logits)
    assert ids.tolist() == [1]  # always at least one token


def test_top_p_large_vocab_probe_matches_full_sort():
    rng = np.random.default_rng(7)
    for scale, top_p in [(8.0, 0.9), (0.2, 0.95), (3.0, 0.5)]:
        logits = (rng.standard_normal(50_000) * scale).astype(np.float32)
        s = Sampler(SamplingParams(top_p=top_p, seed=0))
        ids, probs = s.candidates(logits)
        # reference: full softmax, full sort
        x = logits.astype(np.float64)
        p = np.exp(x - x.max())
        p /= p.sum()
        order = np.argsort(-x, kind="stable")
        n = int(np.searchsorted(np.cumsum(p[order]), top_p, side="left")) + 1
        assert ids.tolist() == order[:n].tolist()
        np.testing.assert_allclose(probs, p[order[:n]] / p[order[:n]].sum(), rtol=1e-9)


def test_temperature_sharpens_and_flattens():
    logits = np.array([2.0, 1.0, 0.0], dtype=np.float32)
    _, cold = Sampler(SamplingParams(temperature=0.5, seed=0)).candidates(logits)
    _, hot = Sampler(SamplingParams(temperature=2.0, seed=0)).candidates(logits)
    _, one = Sampler(SamplingParams(temperature=1.0, seed=0)).candidates(logits)
    assert cold[0] > one[0] > hot[0]
    e = np.exp(np.array([2.0, 1.0, 0.0]) / 0.5)
    np.testing.assert_allclose(cold, e / e.sum())


def test_seed_reproduces_and_frequencies_follow_probabilities():
    logits = np.log(np.array([0.6, 0.3, 0.1])).astype(np.float32)
    a = [Sampler(SamplingParams(seed=42)).sample(logits) for _ in range(3)]
    s1, s2 = Sampler(SamplingParams(seed=42)), Sampler(SamplingParams(seed=42))
    seq1 = [s1.sample(logits) for _ in range(200)]
    seq2 = [s2.sample(logits) for _ in range(200)]
    assert seq1 == seq2
    assert len(set(a)) == 1
    s3 = Sampler(SamplingParams(seed=43))
    assert [s3.sample(logits) for _ in range(200)] != seq1
    counts = np.bincount([s1.sample(logits) for _ in range(20_000)], minlength=3) / 20_000
    np.testing.assert_allclose(counts, [0.6, 0.3, 0.1], atol=0.02)


def test_masked_tokens_are_never_drawn():
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0], dtype=np.float32)
    s = Sampler(SamplingParams(seed=1))
    assert {s.sample(logits) for _ in range(200)} == {1, 3}
    with pytest.raises(ValueError, match="-inf"):
        s.sample(np.full(4, -np.inf, dtype=np.float32))


def _stream(matcher: StopSequenceMatcher, chunks: list[str]) -> str:
    out = "".join(matcher.push(c) for c in chunks)
    return out + matcher.flush()


def test_stop_found_across_chunks_and_not_emitted():
    m = StopSequenceMatcher(["</answer>", "\n\n"])
    emitted = []
    for chunk in ["The answer", " is 4</ans", "wer> and more"]:
        emitted.append(m.push(chunk))
    assert emitted == ["The answer", " is 4", ""]
    assert m.stopped and m.matched == "</answer>"
    assert m.push("ignored") == "" and m.flush() == ""


def test_stop_earliest_position_wins():
    m = StopSequenceMatcher(["world", "lo w"])
    assert m.push("hello world") == "hel"
    assert m.matched == "lo w"


def test_partial_match_is_held_then_released():
    m = StopSequenceMatcher(["STOP"])
    assert m.push("abc ST") == "abc "
    assert m.held == "ST"
    assert m.push("OPPED?") == ""  # completes the stop string
    assert m.stopped
    m = StopSequenceMatcher(["STOP"])
    assert m.push("abc ST") == "abc "
    assert m.push("ART") == "START"  # the held tail was not a stop after all
    assert m.push("S") == ""
    assert m.flush() == "S"


def test_no_stops_passes_everything_through():
    m = StopSequenceMatcher(["", ""])
    assert _stream(m, ["a", "b", "c"]) == "abc"
    assert not m.stopped


def test_overlapping_prefixes_hold_longest_possible_tail():
    m = StopSequenceMatcher(["aab"])
    assert m.push("xaa") == "x"
    assert m.push("a") == "a"  # "aaa": only the last "aa" may still start "aab"
    assert m.push("b") == ""
    assert m.stopped
