"""Prometheus metrics of the service (prometheus-client, one registry per service instance).

Served at ``/metrics`` in the text exposition format. Names carry their unit:

==============================================  ===========  ==========================================
moe_service_requests_total{endpoint,status}     counter      HTTP requests by route and status code
moe_service_prompt_tokens_total                 counter      prompt tokens of accepted requests
moe_service_completion_tokens_total             counter      tokens generated
moe_service_time_to_first_token_seconds         histogram    request arrival -> first token sampled
moe_service_time_per_output_token_seconds       histogram    gap between consecutive tokens of a request
moe_service_request_duration_seconds{endpoint}  histogram    generation requests, arrival -> last byte
moe_service_queue_depth                         gauge        requests waiting for a sequence slot
moe_service_active_sequences                    gauge        sequences being prefilled or decoded
moe_service_batch_sequences                     histogram    sequences per engine step
moe_service_batch_tokens                        histogram    tokens per engine step (prefill + decode)
moe_service_step_seconds                        histogram    one model.step
moe_service_pipeline_stage_duration_seconds     gauge        each pipeline stage that ran, by stage
moe_service_node_bytes{node,source}             gauge        model bytes per NUMA node: source="plan"
                                                             (the layout) and "measured" (placement's
                                                             residency sampling)
moe_service_ready                               gauge        1 once serving, 0 while loading/stopping
moe_service_prefix_cache_hits_total             counter      requests that reused earlier requests' KV rows
moe_service_prefix_cache_reused_tokens_total    counter      prompt tokens not computed thanks to the cache
moe_service_prefix_cache_evictions_total        counter      64-token blocks evicted (LRU) to stay in budget
moe_service_prefix_cache_bytes                  gauge        host bytes the prefix cache holds
==============================================  ===========  ==========================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from moe_service.log import get_logger

log = get_logger(__name__)

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class _ContextCollector:
    """Reads the pipeline context at scrape time: stage durations and bytes per node."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx

    def collect(self):
        ctx = self.ctx
        stages = GaugeMetricFamily("moe_service_pipeline_stage_duration_seconds",
                                   "Wall time of each pipeline stage that ran", labels=["stage"])
        for name, seconds in dict(getattr(ctx, "stage_durations_s", {}) or {}).items():
            stages.add_metric([name], float(seconds))
        yield stages
        nodes = GaugeMetricFamily("moe_service_node_bytes",
                                  "Model bytes per NUMA node (plan: the layout; measured: residency sampling)",
                                  labels=["node", "source"])
        for source, obj in (("plan", getattr(ctx, "layout", None)), ("measured", getattr(ctx, "residency", None))):
            per_node = getattr(obj, "bytes_per_node", None)
            if per_node is None:
                continue
            try:
                values = per_node()
            except Exception as e:  # a scrape must never fail on a report object
                log.warning("metrics_node_bytes_failed", source=source, error=str(e))
                continue
            for node, nbytes in sorted(values.items()):
                nodes.add_metric([str(node), source], float(nbytes))
        yield nodes
        model = getattr(getattr(ctx, "engine", None), "model", None)
        routing = getattr(model, "routing", None)
        if routing is not None:
            k = GaugeMetricFamily("moe_service_experts_per_token",
                                  "Routed experts per token: in use (engine.experts_per_token, 0 = the model's "
                                  "own) and the model's own expert_used_count", labels=["which"])
            k.add_metric(["in_use"], float(routing.k))
            k.add_metric(["model"], float(getattr(model.arch.hp, "n_expert_used", routing.k)))
            yield k


class Metrics:
    """Every metric of one service instance, in its own ``registry``.

    The engine thread calls :meth:`observe_step`, :meth:`observe_first_token`,
    :meth:`observe_token_gap` and :meth:`set_load`; the HTTP layer counts requests and tokens.
    All methods are thread-safe (prometheus-client metrics are).
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("moe_service_requests", "HTTP requests by route and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("moe_service_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.completion_tokens = Counter("moe_service_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("moe_service_time_to_first_token_seconds",
                              "Time from request arrival to its first sampled token",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("moe_service_time_per_output_token_seconds",
                              "Time between consecutive tokens of one request",
                              buckets=_TOKEN_GAP_BUCKETS_S, registry=r)
        self.duration = Histogram("moe_service_request_duration_seconds",
                                  "Generation request time from arrival to the last byte", ["endpoint"],
                                  buckets=_DURATION_BUCKETS_S, registry=r)
        self.queue_depth = Gauge("moe_service_queue_depth", "Requests waiting for a sequence slot", registry=r)
        self.active = Gauge("moe_service_active_sequences", "Sequences being prefilled or decoded", registry=r)
        self.batch_sequences = Histogram("moe_service_batch_sequences", "Sequences per engine step",
                                         buckets=_TOKENS_BUCKETS[:8], registry=r)
        self.batch_tokens = Histogram("moe_service_batch_tokens", "Tokens per engine step (prefill + decode)",
                                      buckets=_TOKENS_BUCKETS, registry=r)
        self.step_seconds = Histogram("moe_service_step_seconds", "Wall time of one model step",
                                      buckets=_TOKEN_GAP_BUCKETS_S, registry=r)
        self.ready = Gauge("moe_service_ready", "1 while serving, 0 while loading or stopping", registry=r)
        self.prefix_hits = Counter("moe_service_prefix_cache_hits", "Requests that reused KV rows of earlier "
                                   "requests (prefix cache)", registry=r)
        self.prefix_reused_tokens = Counter("moe_service_prefix_cache_reused_tokens",
                                            "Prompt tokens whose KV rows came from the prefix cache", registry=r)
        self.prefix_evictions = Counter("moe_service_prefix_cache_evictions",
                                        "Prefix-cache blocks evicted (least recently used) to stay in budget",
                                        registry=r)
        self.prefix_bytes = Gauge("moe_service_prefix_cache_bytes", "Host bytes held by the prefix cache", registry=r)

    def attach_context(self, ctx) -> None:
        """Export ``ctx.stage_durations_s`` and the bytes per node of ``ctx.layout`` /
        ``ctx.residency`` (objects with ``bytes_per_node() -> {node: bytes}``) at each scrape."""
        self.registry.register(_ContextCollector(ctx))

    # engine thread
    def observe_step(self, sequences: int, tokens: int, seconds: float) -> None:
        self.batch_sequences.observe(sequences)
        self.batch_tokens.observe(tokens)
        self.step_seconds.observe(seconds)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_token_gap(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def observe_prefix_cache(self, *, hit: bool, reused_tokens: int, evictions: int, bytes_held: int) -> None:
        if hit:
            self.prefix_hits.inc()
        if reused_tokens:
            self.prefix_reused_tokens.inc(reused_tokens)
        if evictions:
            self.prefix_evictions.inc(evictions)
        self.prefix_bytes.set(bytes_held)

    def set_load(self, waiting: int, active: int) -> None:
        self.queue_depth.set(waiting)
        self.active.set(active)

    # HTTP side
    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def count_tokens(self, prompt_tokens: int, completion_tokens: int) -> None:
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.completion_tokens.inc(completion_tokens)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
