"""The engine (prompts, context policy, finish reasons) and the continuous-batching loop, on a
fake model with the real step()/kv interface (tests/support/serving_fakes.py)."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from moe_service.engine.batch import BatchLoop, QueueFull
from moe_service.engine.engine import GenerationRequest, RequestError, served_model_name
from moe_service.engine.sampler import SamplingParams
from moe_service.notify import Liveness
from tests.support.serving_fakes import (
    ALPHABET,
    BOS_ID,
    EOS_ID,
    N_VOCAB,
    FakeTokenizer,
    expected_chain,
    make_engine,
)

TOK = FakeTokenizer()


def onehot(tok: int) -> np.ndarray:
    row = np.zeros(N_VOCAB, dtype=np.float32)
    row[tok] = 5.0
    return row


class Collector:
    """A request's emit target on a plain thread-safe queue."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()

    def __call__(self, ev):
        self.q.put(ev)

    def wait(self, timeout_s: float = 10.0):
        """All events up to the final one."""
        out = []
        end = time.monotonic() + timeout_s
        while True:
            ev = self.q.get(timeout=max(0.01, end - time.monotonic()))
            out.append(ev)
            if ev.final:
                return out


def request(prompt: str, max_tokens: int = 8, **kw) -> tuple[GenerationRequest, Collector]:
    c = Collector()
    ids = TOK.encode(prompt)
    return GenerationRequest(ids, max_tokens, SamplingParams(temperature=0.0), emit=c, request_id=prompt, **kw), c


def text_of(events) -> str:
    return "".join(e.text for e in events)


# -- engine ------------------------------------------------------------------------------------


def test_served_model_name_strips_gguf_and_shard_suffix():
    assert served_model_name("", "/m/Qwen3-235B-A22B-Q4_K_M-00001-of-00005.gguf") == "Qwen3-235B-A22B-Q4_K_M"
    assert served_model_name("", "/m/smollm2-135m-instruct-moe8.gguf") == "smollm2-135m-instruct-moe8"
    assert served_model_name("mine", "/m/x.gguf") == "mine"


def test_generate_follows_the_model_greedily():
    engine = make_engine()
    ids = engine.encode_prompt("hello")
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    gen = engine.generate(ids, max_tokens=12)
    chain = expected_chain(ids, 12)
    assert gen.token_ids == chain
    assert gen.text == TOK.decode(chain)
    assert gen.finish_reason == "length"
    assert engine.model.kv.n_free == 4  # the slot was returned


def test_chat_prompt_has_exactly_one_bos():
    engine = make_engine()
    ids = engine.encode_chat([{"role": "user", "content": "hi"}])
    # the fake template writes <s> itself and the tokenizer adds BOS: still exactly one
    assert ids[0] == BOS_ID and ids[1] != BOS_ID and ids.count(BOS_ID) == 1
    assert TOK.decode(ids) == "user: hi\nassistant: "


def test_chat_template_rejection_is_a_request_error():
    engine = make_engine()
    with pytest.raises(RequestError) as e:
        engine.encode_chat([{"role": "assistant", "content": "x"}])
    assert e.value.status == 400 and e.value.param == "messages"
    with pytest.raises(RequestError):
        engine.encode_chat([])


def test_empty_and_out_of_vocabulary_prompts_are_refused():
    engine = make_engine()
    for bad in ("", []):
        with pytest.raises(RequestError) as e:
            engine.encode_prompt(bad)
        assert e.value.param == "prompt"
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.encode_prompt([2, N_VOCAB])
    assert engine.encode_prompt([5, 6]) == [5, 6]  # ids are taken as given


def test_context_policy():
    engine = make_engine(n_ctx=32, max_tokens_default=16)
    assert engine.plan_max_tokens(10, None) == 16  # default fits
    assert engine.plan_max_tokens(26, None) == 6  # default clamped to the room left
    assert engine.plan_max_tokens(10, 22) == 22  # exactly fills the context
    with pytest.raises(RequestError) as e:
        engine.plan_max_tokens(10, 23)  # explicit request beyond the context
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    assert "32 tokens" in e.value.message and "33" in e.value.message
    for p in (32, 40):  # no room for a single completion token
        with pytest.raises(RequestError) as e:
            engine.plan_max_tokens(p, None, prompt_param="messages")
        assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


def test_sequence_finish_reasons():
    engine = make_engine()
    # end-of-generation token: "stop", nothing of it emitted
    seq = engine.new_sequence(GenerationRequest([BOS_ID, 2], 10))
    ev = seq.accept(onehot(5))
    assert (ev.text, ev.final) == ("d", False)
    ev = seq.accept(onehot(EOS_ID))
    assert ev.finish_reason == "stop" and ev.text == "" and ev.completion_tokens == 2 and ev.prompt_tokens == 2
    # max_tokens: "length"
    seq = engine.new_sequence(GenerationRequest([BOS_ID, 2], 2))
    seq.accept(onehot(2))
    ev = seq.accept(onehot(3))
    assert ev.finish_reason == "length" and ev.text == "b"
    # a stop string split across tokens: cut before it, "stop"
    seq = engine.new_sequence(GenerationRequest([BOS_ID, 2], 10, stop=("c.",)))
    out = [seq.accept(onehot(2 + ALPHABET.index(ch))) for ch in "abc."]
    assert "".join(e.text for e in out) == "ab" and out[-1].finish_reason == "stop"
    # ignore_eos: EOS does not end it
    seq = engine.new_sequence(GenerationRequest([BOS_ID, 2], 3, ignore_eos=True))
    assert not seq.accept(onehot(EOS_ID)).final
    # the context bounds generation even if max_tokens were larger
    engine = make_engine(n_ctx=4)
    seq = engine.new_sequence(GenerationRequest([BOS_ID, 2], 100))
    assert not seq.accept(onehot(3)).final
    assert seq.accept(onehot(4)).finish_reason == "length"


# -- the batch loop ------------------------------------------------------------------------------


@pytest.fixture
def loop_factory():
    loops = []

    def make(engine, **kw):
        lp = BatchLoop(engine, **kw).start()
        loops.append(lp)
        return lp

    yield make
    for lp in loops:
        lp.stop(timeout_s=5)


def test_single_request_through_the_loop(loop_factory):
    engine = make_engine()
    lp = loop_factory(engine)
    req, c = request("hello", max_tokens=10)
    lp.submit(req)
    events = c.wait()
    assert text_of(events) == TOK.decode(expected_chain(req.prompt_ids, 10))
    last = events[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", 6, 10)
    assert req.t_first_token_s is not None
    assert engine.model.threads == {"engine"}  # only the engine thread steps the model
    deadline = time.monotonic() + 2
    while engine.model.kv.n_free != 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.model.kv.n_free == 4


def test_concurrent_requests_share_every_step(loop_factory):
    engine = make_engine(ubatch_tokens=64)
    model = engine.model
    model.step_delay_s = 0.002
    prompts = ["alpha", "bravo charlie", "delta", "echo foxtrot golf"]
    reqs = [request(p, max_tokens=20) for p in prompts]
    lp = BatchLoop(engine, parallel=4)
    for r, _ in reqs:  # queued before the loop starts: all four join the first step
        lp.submit(r)
    lp.start()
    try:
        for r, c in reqs:
            assert text_of(c.wait()) == TOK.decode(expected_chain(r.prompt_ids, 20))
    finally:
        lp.stop()
    # one prefill step for all four prompts, then 19 decode steps carrying all four sequences
    assert len(model.steps) == 20
    assert all(len(step) == 4 for step in model.steps)
    assert all(n == 1 for step in model.steps[1:] for _, n in step)


def test_long_prompt_is_prefilled_in_chunks_without_stalling_decoders(loop_factory):
    engine = make_engine(ubatch_tokens=8)
    model = engine.model
    model.step_delay_s = 0.002
    lp = loop_factory(engine)
    a, ca = request("go", max_tokens=40)
    lp.submit(a)
    first = ca.q.get(timeout=5)  # A is decoding
    assert first.n_tokens == 1
    long_prompt = "the quick brown fox jumps over the lazy dog"  # 44 tokens with BOS
    b, cb = request(long_prompt, max_tokens=3)
    n_before = len(model.steps)
    lp.submit(b)
    events_b = cb.wait()
    events_a = [first, *ca.wait()]
    assert text_of(events_b) == TOK.decode(expected_chain(b.prompt_ids, 3))
    assert text_of(events_a) == TOK.decode(expected_chain(a.prompt_ids, 40))
    # every step that carries a chunk of B's prompt also decodes A (one token); chunks <= ubatch
    prefill_steps = [s for s in model.steps[n_before:] if len(s) == 2 and max(n for _, n in s) > 1]
    assert sum(max(n for _, n in s) for s in prefill_steps) == len(b.prompt_ids)
    assert len(prefill_steps) == -(-len(b.prompt_ids) // 8)
    for step in prefill_steps:
        ns = sorted(n for _, n in step)
        assert ns[0] == 1 and ns[1] <= 8


def test_queue_bound_gives_queue_full_with_retry_after(loop_factory):
    engine = make_engine(n_seq=1)
    engine.model.step_delay_s = 0.02
    lp = loop_factory(engine, parallel=1, queue_size=1, retry_after_s=3)
    r1, c1 = request("one", max_tokens=30)
    r2, c2 = request("two", max_tokens=2)
    r3, _ = request("three", max_tokens=2)
    lp.submit(r1)
    lp.submit(r2)
    with pytest.raises(QueueFull) as e:
        lp.submit(r3)
    assert e.value.status == 429 and e.value.retry_after_s == 3
    assert c1.wait()[-1].finish_reason == "length"
    assert c2.wait()[-1].finish_reason == "length"
    lp.submit(r3)  # room again


def test_cancel_frees_the_slot_and_stops_events(loop_factory):
    engine = make_engine(n_seq=2)
    engine.model.step_delay_s = 0.01
    lp = loop_factory(engine, parallel=2)
    r, c = request("cancel me", max_tokens=200)
    lp.submit(r)
    c.q.get(timeout=5)
    lp.cancel(r)
    deadline = time.monotonic() + 5
    while (lp.active or engine.model.kv.n_free != 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lp.active == 0 and engine.model.kv.n_free == 2
    time.sleep(0.05)
    while not c.q.empty():
        assert not c.q.get().final  # no final event for a cancelled request
    # a queued request cancelled before admission never runs
    r2, c2 = request("never", max_tokens=5)
    r2.cancelled = True
    lp.submit(r2)
    ok, cok = request("fine", max_tokens=3)
    lp.submit(ok)
    assert cok.wait()[-1].finish_reason == "length"
    assert c2.q.empty()


def test_a_failing_step_fails_only_its_requests(loop_factory):
    good, cgood = request("fine", max_tokens=4)
    used = set(good.prompt_ids) | set(expected_chain(good.prompt_ids, 4))
    poison_char = next(ch for ch in ALPHABET if 2 + ALPHABET.index(ch) not in used)
    engine = make_engine(n_seq=1, poison=2 + ALPHABET.index(poison_char))
    lp = loop_factory(engine, parallel=1)
    bad, cbad = request(poison_char * 3, max_tokens=4)
    lp.submit(bad)
    lp.submit(good)
    ev = cbad.wait()[-1]
    assert ev.error is not None and ev.error.status == 500 and "poisoned" in ev.error.message
    assert text_of(cgood.wait()) == TOK.decode(expected_chain(good.prompt_ids, 4))
    assert lp.failed_steps == 1 and lp.running
    assert engine.model.kv.n_free == 1


def test_liveness_advances_while_idle():
    engine = make_engine()
    live = Liveness()
    lp = BatchLoop(engine, liveness=live, idle_wait_s=0.01).start()
    try:
        c0 = live.count
        time.sleep(0.2)
        assert live.count >= c0 + 5
    finally:
        lp.stop()


def test_stop_fails_running_and_queued_requests_with_503():
    engine = make_engine(n_seq=1)
    engine.model.step_delay_s = 0.01
    lp = BatchLoop(engine, parallel=1, queue_size=4).start()
    r1, c1 = request("running", max_tokens=500)
    r2, c2 = request("queued", max_tokens=5)
    lp.submit(r1)
    lp.submit(r2)
    c1.q.get(timeout=5)
    lp.stop()
    assert not lp.running
    for c in (c1, c2):
        ev = c.wait()[-1]
        assert ev.error is not None and ev.error.status == 503
    with pytest.raises(RequestError) as e:
        lp.submit(request("late")[0])
    assert e.value.status == 503
    assert engine.model.kv.n_free == 1


def test_seeded_sampling_is_reproducible_in_a_batch(loop_factory):
    engine = make_engine()
    lp = loop_factory(engine)
    outs = []
    for _ in range(2):
        cs = []
        for p in ("same", "other"):
            c = Collector()
            ids = TOK.encode(p)
            r = GenerationRequest(ids, 12, SamplingParams(temperature=1.5, seed=7), emit=c, request_id=p)
            lp.submit(r)
            cs.append(c)
        outs.append([text_of(c.wait()) for c in cs])
    assert outs[0] == outs[1]


def test_submit_is_thread_safe_under_concurrency(loop_factory):
    engine = make_engine(ubatch_tokens=16)
    lp = loop_factory(engine, parallel=4, queue_size=64)
    results = {}

    def client(i):
        r, c = request(f"client {chr(97 + i)}", max_tokens=6)
        lp.submit(r)
        results[i] = (r, c.wait())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == 12
    for r, events in results.values():
        assert text_of(events) == TOK.decode(expected_chain(r.prompt_ids, 6))
    assert max(len(s) for s in engine.model.steps) <= 4
