"""Prometheus metrics of one engine process, with vLLM's metric names after an ``engine:`` prefix.

Gauges are read from the busy loop's latest snapshot when scraped, so the step loop does no
metrics work. Counters and histograms are fed by the output processor: token counts per step,
inter-token latency per token, the rest once per finished request from its engine timings.
The plain totals kept next to the Prometheus objects are what STATS reports.

Per tenant (for fair scheduling): tokens served, queue time, and waiting requests, labelled by
tenant id. Labels are bounded: the first ``MAX_TENANT_LABELS`` tenants seen get their own,
the rest share ``other``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from inference_engine.protocol import FinishReason, RequestTimings

PREFIX = "engine:"
MAX_TENANT_LABELS = 100
OTHER_TENANTS = "other"
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        gauges: Callable[[], tuple[int, int, float]],
        waiting_by_tenant: Callable[[], dict[str, int]] = dict,
    ) -> None:
        """``gauges()`` returns (running, waiting, kv cache usage 0..1) right now;
        ``waiting_by_tenant()`` the waiting requests of each tenant."""
        self.registry = CollectorRegistry()
        self._tenant_labels: set[str] = set()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str, index: int) -> None:
            metric = Gauge(PREFIX + name, doc, list(labels), registry=self.registry)
            metric.labels(**labels).set_function(lambda: gauges()[index])

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, list(labels), registry=self.registry).labels(
                **labels
            )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name, doc, list(labels), buckets=buckets, registry=self.registry
            ).labels(**labels)

        gauge("num_requests_running", "Requests in the running batch.", 0)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", 1)
        gauge("kv_cache_usage_perc", "Share of KV cache blocks in use (1 means 100%).", 2)
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self._generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self._prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._mid_step_admissions = counter(
            "mid_step_admissions",
            "Newcomers' first chunks run between two layers of another step (fair, CPU).",
        )
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        self._ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self._itl = histogram("inter_token_latency_seconds", "Between two tokens.", ITL_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self._queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS
        )
        tenant_labels = [*labels, "tenant"]
        self._tenant_tokens = Counter(
            PREFIX + "tenant_tokens",
            "Tokens served per tenant, by kind (prompt or generation), of finished requests.",
            [*tenant_labels, "kind"],
            registry=self.registry,
        )
        self._tenant_queue_time = Histogram(
            PREFIX + "tenant_request_queue_time_seconds",
            "Arrival to first scheduled, per tenant.",
            tenant_labels,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_TenantWaiting(model_name, waiting_by_tenant, self.tenant_label))

    def tenant_label(self, tenant_id: str) -> str:
        if tenant_id in self._tenant_labels:
            return tenant_id
        if len(self._tenant_labels) < MAX_TENANT_LABELS:
            self._tenant_labels.add(tenant_id)
            return tenant_id
        return OTHER_TENANTS

    def serve(self, port: int, host: str) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def record_tokens(self, num_tokens: int) -> None:
        self.generation_tokens_total += num_tokens
        self._generation_tokens.inc(num_tokens)

    def record_mid_step_admission(self) -> None:
        self._mid_step_admissions.inc()

    def record_inter_token_latency(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def record_finished(
        self,
        reason: FinishReason,
        timings: RequestTimings | None,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        *,
        tenant_id: str = "",
        num_output_tokens: int = 0,
    ) -> None:
        self.prompt_tokens_total += num_prompt_tokens
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_cached_tokens
        self._prompt_tokens.inc(num_prompt_tokens)
        self._prefix_queries.inc(num_prompt_tokens)
        self._prefix_hits.inc(num_cached_tokens)
        self._success.labels(self._model_name, str(reason)).inc()
        tenant = self.tenant_label(tenant_id)
        self._tenant_tokens.labels(self._model_name, tenant, "prompt").inc(num_prompt_tokens)
        self._tenant_tokens.labels(self._model_name, tenant, "generation").inc(num_output_tokens)
        if timings is None or not timings.arrival:
            return
        if timings.first_scheduled:
            queue_time = timings.first_scheduled - timings.arrival
            self._queue_time.observe(queue_time)
            self._tenant_queue_time.labels(self._model_name, tenant).observe(queue_time)
        if timings.first_token:
            self._ttft.observe(timings.first_token - timings.arrival)
        if timings.finished:
            self._e2e.observe(timings.finished - timings.arrival)


class _TenantWaiting:
    """``engine:tenant_requests_waiting``, read from the busy loop's snapshot when scraped."""

    def __init__(
        self,
        model_name: str,
        waiting_by_tenant: Callable[[], dict[str, int]],
        label: Callable[[str], str],
    ) -> None:
        self.model_name = model_name
        self.waiting_by_tenant = waiting_by_tenant
        self.label = label

    def collect(self):
        family = GaugeMetricFamily(
            PREFIX + "tenant_requests_waiting",
            "Requests waiting to be scheduled, per tenant.",
            labels=["model_name", "tenant"],
        )
        totals: dict[str, int] = {}
        for tenant_id, count in self.waiting_by_tenant().items():
            label = self.label(tenant_id)
            totals[label] = totals.get(label, 0) + count
        for label, count in totals.items():
            family.add_metric([self.model_name, label], count)
        yield family
