"""Continuous batching: one engine thread, every active sequence advanced by one shared step.

::

    HTTP handlers (asyncio)            engine thread (the only caller of model.step)
    submit(req) --> waiting queue --> admit (free slot, <= parallel) --> active sequences
                    (bounded: 429)                                        |
                                 each iteration: batch = [(slot, 1 decode token) for decoders]
                                               + [(slot, prompt chunk) while prefill budget
                                                  (ubatch_tokens per step) lasts]
                                 logits [S, V] = model.step(batch)   # one fused MoE dispatch
                                                                      # per layer for all of them
                                 per sequence: sample -> detokenize -> stop strings -> Event
    req.emit(Event)  <-- (loop.call_soon_threadsafe on the server side) --+
                                 finished / cancelled -> slot freed; liveness.beat()

Decoders are never stalled by a long prompt: a new prompt is prefilled ``ubatch_tokens`` at a
time inside the same steps that decode the others. A step that raises fails only the requests
in that step (500 error event), is logged, and the loop goes on. While idle the thread wakes
every ``idle_wait_s`` to advance the liveness counter, so the systemd watchdog keeps seeing a
live engine.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from moe_service.engine.engine import Engine, Event, GenerationRequest, RequestError, Sequence
from moe_service.log import get_logger

log = get_logger(__name__)


class QueueFull(RequestError):
    """Every sequence slot is busy and the waiting queue is full: 429 with Retry-After."""

    def __init__(self, capacity: int, retry_after_s: int):
        super().__init__(
            f"the server is at capacity ({capacity} requests running or queued); retry after {retry_after_s} s",
            status=429, type="rate_limit_error", code="queue_full",
        )
        self.retry_after_s = retry_after_s


def shutting_down_error() -> RequestError:
    """The error a request gets when the service stops before or while serving it (503)."""
    return RequestError("the server is shutting down", status=503, type="server_error", code="shutting_down")


class BatchLoop:
    """The engine thread and its scheduler.

    ``engine``: the :class:`~moe_service.engine.engine.Engine` whose ``model.step`` this loop
    alone calls once started; ``parallel``: most sequences decoded together (<= the model's KV
    slots); ``queue_size``: requests that may wait beyond those (more get :class:`QueueFull`);
    ``liveness``: a notify.Liveness advanced every iteration; ``metrics``: an object with
    ``observe_step(sequences, tokens, seconds)``, ``observe_first_token(seconds)``,
    ``observe_token_gap(seconds)``, ``set_load(waiting, active)`` (moe_service.metrics.Metrics)
    or None; ``prefix_cache``: a moe_service.engine.prefix.PrefixCache (a new request starts
    from the longest prefix held; prompts are published when their prefill completes and
    again at a normal finish), or None.
    """

    def __init__(self, engine: Engine, *, parallel: int = 4, queue_size: int = 16, retry_after_s: int = 1,
                 liveness=None, metrics=None, idle_wait_s: float = 0.1, max_failed_steps: int = 5,
                 stall_s: float = 120.0, prefix_cache=None):
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1 (got {parallel})")
        self.engine = engine
        self.model = engine.model
        self.parallel = parallel
        self.queue_size = queue_size
        self.retry_after_s = retry_after_s
        self.liveness = liveness
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.prefix_cache = prefix_cache  # engine/prefix.py PrefixCache, or None
        self.ubatch_tokens = max(1, engine.ubatch_tokens)
        self._cv = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._active: list[Sequence] = []  # engine thread only
        self._n_active = 0  # mirror of len(_active) for other threads, under _cv
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.failed_steps = 0
        self._mask_pool: ThreadPoolExecutor | None = None  # grammar mask worker, started by the first constrained step
        self.max_failed_steps = max(1, int(max_failed_steps))
        self.stall_s = float(stall_s)
        self.consecutive_failed_steps = 0
        self.last_error: str | None = None  # the latest failed step's error
        self._t_progress = time.monotonic()  # last completed step, or last time there was no work
        if liveness is not None and hasattr(liveness, "add_check"):
            liveness.add_check("engine", self.health)

    # -- any thread --------------------------------------------------------------------------

    def start(self) -> BatchLoop:
        """Start the engine thread (daemon, named ``engine``)."""
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        log.info("engine_loop_started", parallel=self.parallel, queue_size=self.queue_size,
                 ubatch_tokens=self.ubatch_tokens, n_ctx=self.engine.n_ctx)
        return self

    def submit(self, req: GenerationRequest) -> None:
        """Queue ``req``; its events arrive through ``req.emit`` from the engine thread.

        Raises QueueFull (429) when ``parallel + queue_size`` requests are already in the
        system, RequestError 503 when the loop is stopping.
        """
        with self._cv:
            if self._stopping:
                raise shutting_down_error()
            capacity = self.parallel + self.queue_size
            if len(self._waiting) + self._n_active >= capacity:
                raise QueueFull(capacity, self.retry_after_s)
            self._waiting.append(req)
            self._publish_load()
            self._cv.notify()

    def check_capacity(self) -> None:
        """Raise what :meth:`submit` would raise now (QueueFull, 503 stopping) without queueing:
        the server asks before it tokenizes a prompt. Advisory: submit checks again."""
        with self._cv:
            if self._stopping:
                raise shutting_down_error()
            capacity = self.parallel + self.queue_size
            if len(self._waiting) + self._n_active >= capacity:
                raise QueueFull(capacity, self.retry_after_s)

    def health(self) -> str | None:
        """None while the loop can do work, else the reason it cannot (a sentence):

        - the engine thread has exited;
        - ``max_failed_steps`` steps in a row failed (the latest error named);
        - the model's worker pool is dead (``model.ops.pool.broken``);
        - requests are waiting or running but no step completed for ``stall_s`` seconds.

        /health answers 503 with it, and the watchdog stops pinging (notify.Liveness checks).
        """
        if self._thread is not None and not self._thread.is_alive():
            return "the engine thread has exited"
        if self.consecutive_failed_steps >= self.max_failed_steps:
            return (f"{self.consecutive_failed_steps} engine steps in a row failed "
                    f"(serve.max_failed_steps = {self.max_failed_steps}); last: {self.last_error}")
        pool = getattr(getattr(self.model, "ops", None), "pool", None)
        broken = getattr(pool, "broken", None)
        if isinstance(broken, str):
            return f"the kernel worker pool is dead: {broken}"
        with self._cv:
            busy = bool(self._waiting) or self._n_active > 0
        idle_s = time.monotonic() - self._t_progress
        if busy and self._thread is not None and idle_s > self.stall_s:
            return (f"no engine step completed for {idle_s:.0f} s while requests wait "
                    f"(serve.engine_stall_s = {self.stall_s:g})")
        return None

    def cancel(self, req: GenerationRequest) -> None:
        """The requester is gone: drop ``req`` from the queue, or free its slot at the next step."""
        req.cancelled = True
        with self._cv:
            try:
                self._waiting.remove(req)
            except ValueError:
                pass
            self._publish_load()
            self._cv.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return self._n_active

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread: requests still queued or running get a 503 error event.

        Waits up to ``timeout_s`` for the current step to end (logs a warning past it).
        """
        with self._cv:
            self._stopping = True
            self._cv.notify()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("engine_loop_stop_timeout", timeout_s=timeout_s)
                self._thread = thread
            else:
                log.info("engine_loop_stopped", steps=self.steps, failed_steps=self.failed_steps)
        if self._mask_pool is not None and self._thread is None:
            self._mask_pool.shutdown(wait=False)
            self._mask_pool = None

    # -- engine thread -----------------------------------------------------------------------

    def _beat(self) -> None:
        if self.liveness is not None:
            self.liveness.beat()

    def _publish_load(self) -> None:
        if self.metrics is not None:
            self.metrics.set_load(len(self._waiting), self._n_active)

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._stopping:
                    break
                if not self._active and not self._waiting:
                    self._t_progress = time.monotonic()  # nothing to do is not a stall
                    self._cv.wait(self.idle_wait_s)
                    self._beat()
                    continue
                admit: list[GenerationRequest | None] = []  # None once accounted for (below)
                while self._waiting and self._n_active + len(admit) < self.parallel:
                    req = self._waiting.popleft()
                    if not req.cancelled:
                        admit.append(req)
                self._n_active += len(admit)  # reserved now, so submit() counts them
            try:
                for i, new in enumerate(admit):
                    assert new is not None  # set to None only after this iteration
                    try:
                        self._admit(new)
                    except Exception as e:  # noqa: BLE001 - the request fails, its place is freed
                        self._admit_failed(new, e)
                    finally:
                        admit[i] = None  # accounted for: admitted, or failed and released
                self._reap_cancelled()
                if self._active:
                    self._step()
            except Exception as e:  # a bug outside model.step: fail what runs, keep serving
                log.error("engine_iteration_failed", error=f"{type(e).__name__}: {e}", exc_info=e)
                for left in admit:  # reserved but never admitted: answer them, free their places
                    if left is not None:
                        self._admit_failed(left, e)
                for seq in list(self._active):
                    self._fail(seq, RequestError(f"internal engine error: {type(e).__name__}: {e}",
                                                 status=500, type="server_error", code="engine_error"))
            self._beat()
        self._drain_on_stop()

    def _admit(self, req: GenerationRequest) -> None:
        """Give ``req`` a sequence and a KV slot (its place in _n_active is already reserved)."""
        seq = self.engine.new_sequence(req)
        self._active.append(seq)
        try:
            if self.prefix_cache is not None:
                seq.slot, seq.n_prefilled = self.prefix_cache.acquire(req.prompt_ids)
                seq.cached_tokens = seq.n_prefilled
            else:
                seq.slot = self.model.kv.alloc()
        except Exception as e:  # more admitted than the KV cache has slots: a configuration bug
            log.error("engine_slot_alloc_failed", request_id=req.request_id, error=str(e))
            self._fail(seq, RequestError(f"no free sequence slot: {e}", status=500, type="server_error",
                                         code="engine_error"))
            return
        with self._cv:
            self._publish_load()

    def _admit_failed(self, req: GenerationRequest, exc: BaseException) -> None:
        """``req``'s admission raised: give back its reserved place (and its sequence and slot
        if it got that far) and answer it with a 500, so no place leaks and nobody waits."""
        log.error("engine_admit_failed", request_id=req.request_id, error=f"{type(exc).__name__}: {exc}",
                  exc_info=exc)
        seq = next((s for s in self._active if s.request is req), None)
        err = RequestError(f"the engine could not start this request: {type(exc).__name__}: {exc}",
                           status=500, type="server_error", code="engine_error")
        if seq is not None:
            self._fail(seq, err)  # releases the slot and the place
            return
        with self._cv:
            self._n_active -= 1
            self._publish_load()
        if req.emit is not None and not req.cancelled:
            try:
                req.emit(Event(error=err, prompt_tokens=len(req.prompt_ids)))
            except Exception as e:  # noqa: BLE001 - the requester is gone
                log.warning("engine_emit_failed", request_id=req.request_id, error=str(e))

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            if self.prefix_cache is not None:
                try:
                    self.prefix_cache.release(seq.slot)
                except Exception as e:  # noqa: BLE001 - never keep the slot: the next acquire starts it afresh
                    log.warning("prefix_cache_release_failed", slot=seq.slot, error=f"{type(e).__name__}: {e}")
            self.model.kv.free(seq.slot)
            seq.slot = None
        if seq in self._active:
            self._active.remove(seq)
            with self._cv:
                self._n_active -= 1
                self._publish_load()

    def _emit(self, seq: Sequence, ev: Event) -> None:
        emit = seq.request.emit
        if emit is None:
            return
        try:
            emit(ev)
        except Exception as e:  # the requester's loop is gone: nobody will read more
            log.warning("engine_emit_failed", request_id=seq.request.request_id, error=str(e))
            seq.request.cancelled = True

    def _fail(self, seq: Sequence, err: RequestError) -> None:
        self._emit(seq, Event(error=err, prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.generated)))
        self._release(seq)

    def _reap_cancelled(self) -> None:
        for seq in [s for s in self._active if s.request.cancelled]:
            log.info("request_cancelled", request_id=seq.request.request_id, prompt_tokens=len(seq.prompt_ids),
                     completion_tokens=len(seq.generated))
            self._release(seq)

    def _step(self) -> None:
        """One forward pass over every active sequence: decode tokens plus prefill chunks."""
        batch: list[tuple[int, list[int]]] = []
        entries: list[tuple[Sequence, int]] = []  # (sequence, prompt tokens in this step; 0 = decode)
        budget = self.ubatch_tokens
        for seq in self._active:
            assert seq.slot is not None  # an active sequence holds its slot (_admit) until _finish
            if seq.prefilling:
                if budget <= 0:
                    continue
                a = seq.n_prefilled
                n = min(budget, len(seq.prompt_ids) - a)
                budget -= n
                batch.append((seq.slot, seq.prompt_ids[a : a + n]))
                entries.append((seq, n))
            else:
                batch.append((seq.slot, seq.next_input()))
                entries.append((seq, 0))
        masks = self._start_masks(entries)
        # logits only for the sequences that sample after this step (decode, a prompt's last chunk)
        want = [n == 0 or seq.n_prefilled + n >= len(seq.prompt_ids) for seq, n in entries]
        t0 = time.monotonic()
        try:
            logits = self.model.step(batch, want_logits=want)  # [sum(want), V] float32
        except Exception as e:
            self._wait_masks(masks)
            self.failed_steps += 1
            self.consecutive_failed_steps += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.error("engine_step_failed", sequences=len(batch), tokens=sum(len(t) for _, t in batch),
                      requests=[s.request.request_id for s, _ in entries], error=f"{type(e).__name__}: {e}",
                      exc_info=e)
            err = RequestError(f"the engine failed on this request's step: {type(e).__name__}: {e}",
                               status=500, type="server_error", code="engine_error")
            for seq, _ in entries:
                self._fail(seq, err)
            return
        self._wait_masks(masks)
        now = time.monotonic()
        self.steps += 1
        self.consecutive_failed_steps = 0
        self._t_progress = now
        if self.metrics is not None:
            self.metrics.observe_step(len(batch), sum(len(t) for _, t in batch), now - t0)
        rows = logits.numpy() if hasattr(logits, "numpy") else logits
        row = 0
        for seq, n_prompt in entries:
            if n_prompt:
                seq.n_prefilled += n_prompt
                if seq.prefilling:
                    continue
                self._publish(seq, seq.prompt_ids)
            i, row = row, row + 1  # this entry's logits row (want was true for it)
            try:
                ev = seq.accept(rows[i])
            except Exception as e:
                log.error("engine_sample_failed", request_id=seq.request.request_id, error=str(e))
                self._fail(seq, RequestError(f"sampling failed: {e}", status=500, type="server_error",
                                             code="engine_error"))
                continue
            req = seq.request
            if req.t_first_token_s is None:
                req.t_first_token_s = now
                if self.metrics is not None:
                    self.metrics.observe_first_token(now - req.t_arrival_s)
            elif self.metrics is not None and seq.t_last_token_s is not None:
                self.metrics.observe_token_gap(now - seq.t_last_token_s)
            seq.t_last_token_s = now
            self._emit(seq, ev)
            if ev.final:
                if ev.finish_reason is not None:  # rows of the prompt and every fed token are complete
                    self._publish(seq, seq.prompt_ids + seq.generated[:-1])
                self._release(seq)

    def _start_masks(self, entries: list[tuple[Sequence, int]]):
        """Compute the grammar masks of the constrained sequences that sample after this step,
        in the mask worker thread while model.step runs (llguidance and the forward pass both
        drop the GIL), so a constrained sequence adds no serial time to the step. Returns the
        future, or None when no sequence in the step is constrained."""
        todo = [seq.request.constraint for seq, n in entries if seq.request.constraint is not None
                and (n == 0 or seq.n_prefilled + n >= len(seq.prompt_ids))]
        if not todo:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

        def run() -> None:
            for c in todo:
                c.compute_mask()

        return self._mask_pool.submit(run)

    @staticmethod
    def _wait_masks(fut) -> None:
        if fut is None:
            return
        try:
            fut.result()
        except Exception as e:  # computed again (and reported) on the engine thread by accept()
            log.warning("grammar_mask_failed", error=f"{type(e).__name__}: {e}")

    def _publish(self, seq: Sequence, tokens: list[int]) -> None:
        """Offer the slot's computed rows to the prefix cache (never fails the request)."""
        if self.prefix_cache is None or seq.slot is None:
            return
        try:
            self.prefix_cache.publish(seq.slot, tokens)
        except Exception as e:
            log.warning("prefix_cache_publish_failed", request_id=seq.request.request_id, error=str(e))

    def _drain_on_stop(self) -> None:
        with self._cv:
            waiting = list(self._waiting)
            self._waiting.clear()
        for seq in list(self._active):
            if not seq.request.cancelled:
                self._fail(seq, shutting_down_error())
            else:
                self._release(seq)
        for req in waiting:
            if req.emit is not None and not req.cancelled:
                try:
                    req.emit(Event(error=shutting_down_error(), prompt_tokens=len(req.prompt_ids)))
                except Exception:
                    pass
        with self._cv:
            self._publish_load()
