"""The gateway's Prometheus metrics, served at GET /metrics.

One registry per app, so several apps (tests) in one process don't collide.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class KeptChildren:
    """A labelled metric whose children are kept: prometheus_client's labels() checks its values and takes a lock
    on every call, several microseconds each, three or four times per request."""

    def __init__(self, metric: Counter | Histogram):
        self._metric = metric
        self._children: dict[tuple[str, ...], Counter | Histogram] = {}

    def labels(self, *values: str) -> Counter | Histogram:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = KeptChildren(Counter("flatwire_requests", "HTTP generation requests received", ["endpoint"],
                                             registry=self.registry))
        self.errors = KeptChildren(Counter("flatwire_request_errors", "HTTP requests answered with an error",
                                           ["endpoint", "status"], registry=self.registry))
        self.time_to_first_token = KeptChildren(Histogram(
            "flatwire_time_to_first_token_seconds", "from request arrival to its first generated token",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry))
        self.inter_token_latency = KeptChildren(Histogram(
            "flatwire_inter_token_latency_seconds",
            "time between consecutive generated tokens (a chunk's gap spread over its tokens)", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=self.registry))
        self.prompt_tokens = Counter("flatwire_prompt_tokens", "prompt tokens of submitted requests",
                                     registry=self.registry)
        self.generated_tokens = Counter("flatwire_generated_tokens", "tokens generated", registry=self.registry)
        self.bytes_sent = KeptChildren(Counter("flatwire_response_bytes", "response body bytes, by logprob format",
                                               ["format"], registry=self.registry))

    def watch_engine(self, engine) -> None:
        """Export the engine client's admission control (the gRPC API's requests included) and each scheduler
        replica's KV memory and prefix cache (as of its last health round); read at each scrape."""
        self.registry.register(_AdmissionCollector(engine))
        self.registry.register(_ReplicaCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _AdmissionCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        rejected = CounterMetricFamily(
            "flatwire_admission_rejected", "requests refused by admission control (HTTP 429, gRPC RESOURCE_EXHAUSTED): "
            "queue=gateway, past --max-outstanding-requests (a batch counts once); queue=scheduler, a generation "
            "every scheduler refused (waiting list full)", labels=["queue"])
        for queue, count in self.engine.rejected.items():
            rejected.add_metric([queue], count)
        yield rejected
        yield GaugeMetricFamily("flatwire_outstanding_generations", "generations this gateway holds now (HTTP and "
                                "gRPC)", value=self.engine.outstanding)
        yield GaugeMetricFamily("flatwire_admission_limit", "most generations this gateway holds at once",
                                value=self.engine.admission_limit)


# SchedulerStats field -> (metric, help); counters count since the replica started.
REPLICA_GAUGES = {
    "running": ("flatwire_scheduler_running_requests", "requests running in the replica"),
    "waiting": ("flatwire_scheduler_waiting_requests", "requests waiting in the replica"),
    "kv_pages_total": ("flatwire_kv_pages", "pages of the replica's KV memory"),
    "kv_pages_used": ("flatwire_kv_pages_used", "KV pages that running requests hold"),
    "kv_pages_cached": ("flatwire_kv_pages_cached", "KV pages the prefix cache holds (some also in use)"),
}
REPLICA_COUNTERS = {
    "prefill_tokens": ("flatwire_prefill_tokens", "prompt tokens whose KV the replica computed"),
    "cached_prompt_tokens": ("flatwire_cached_prompt_tokens", "prompt tokens found in the prefix cache"),
    "retractions": ("flatwire_retractions", "running requests retracted (preempted) for want of KV pages"),
}


class _ReplicaCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        replicas = [(address, replica.stats) for address, replica in self.engine.schedulers.replicas.items()
                    if replica.stats is not None]
        for fields, family in ((REPLICA_GAUGES, GaugeMetricFamily), (REPLICA_COUNTERS, CounterMetricFamily)):
            for field, (name, help_text) in fields.items():
                metric = family(name, help_text, labels=["replica"])
                for address, stats in replicas:
                    metric.add_metric([address], getattr(stats, field))
                yield metric
        router = self.engine.schedulers.router
        routed = CounterMetricFamily("flatwire_routed_requests", "requests sent to a replica: by=affinity, where "
                                     "their session or prompt prefix went before; by=load, to the least loaded",
                                     labels=["by"])
        routed.add_metric(["affinity"], router.by_affinity)
        routed.add_metric(["load"], router.by_load)
        yield routed


class TokenTimer:
    """Time to first token and inter-token latency of one generation."""

    def __init__(self, metrics: GatewayMetrics, endpoint: str, started: float):
        self._first_token = metrics.time_to_first_token.labels(endpoint)
        self._inter_token = metrics.inter_token_latency.labels(endpoint)
        self._generated = metrics.generated_tokens
        self._last = started
        self._first = True

    def tokens(self, count: int, now: float) -> None:
        if count == 0:
            return
        gap = now - self._last
        if self._first:
            self._first_token.observe(gap)
            self._first = False
        else:
            self._inter_token.observe(gap / count)
        self._last = now
        self._generated.inc(count)
