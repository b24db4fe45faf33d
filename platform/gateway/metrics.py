"""The gateway's Prometheus metrics: requests by tenant, model and status; tokens; TTFT and
latency histograms. Label values are bounded: past ``MAX_LABEL_VALUES`` distinct tenants or
models, new ones are counted as "other", so a flood of names cannot blow up the registry."""

import json
import os
import threading
from pathlib import Path

from django.conf import settings
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from serving.metering import Meter
from tenants.models import Tenant

MAX_LABEL_VALUES = 200
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

registry = CollectorRegistry(auto_describe=True)
requests_total = Counter(
    "llm_gateway_requests",
    "API requests by tenant, model and outcome.",
    ["tenant", "model", "status"],
    registry=registry,
)
tokens_total = Counter(
    "llm_gateway_tokens",
    "Tokens metered, by tenant, model and kind (prompt, completion, cached).",
    ["tenant", "model", "kind"],
    registry=registry,
)
time_to_first_token = Histogram(
    "llm_gateway_time_to_first_token_seconds",
    "Time from admission to the first token.",
    ["model"],
    buckets=LATENCY_BUCKETS,
    registry=registry,
)
request_latency = Histogram(
    "llm_gateway_request_latency_seconds",
    "Time from admission to the last byte.",
    ["model"],
    buckets=LATENCY_BUCKETS,
    registry=registry,
)


class BoundedLabel:
    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) >= self.limit:
                return "other"
            self._seen.add(value)
        return value


tenant_label = BoundedLabel()
model_label = BoundedLabel()


def observe_refusal(model: str, status: str, tenant: str = "unknown") -> None:
    requests_total.labels(tenant_label(tenant), model_label(model), status).inc()


def observe_finished(model: str, tenant: Tenant, meter: Meter) -> None:
    tenant_name, model_name = tenant_label(tenant.slug), model_label(model)
    requests_total.labels(tenant_name, model_name, meter.status).inc()
    for kind, count in (
        ("prompt", meter.prompt_tokens),
        ("completion", meter.completion_tokens),
        ("cached", meter.cached_tokens),
    ):
        if count:
            tokens_total.labels(tenant_name, model_name, kind).inc(count)
    if meter.first_token_at is not None:
        time_to_first_token.labels(model_name).observe(meter.first_token_at - meter.started_at)
    request_latency.labels(model_name).observe(meter.finished_at - meter.started_at)


class SupervisedProcesses:
    """``llm_platform_process_restarts_total`` and ``llm_platform_process_up`` per process that
    ``make run``'s supervisor runs, read from its status file when scraped."""

    def collect(self):
        restarts = CounterMetricFamily(
            "llm_platform_process_restarts",
            "Times make run's supervisor restarted a process that died.",
            labels=["process"],
        )
        up = GaugeMetricFamily(
            "llm_platform_process_up",
            "1 while the process runs, 0 while it waits to be restarted.",
            labels=["process"],
        )
        for name, status in supervisor_status().items():
            restarts.add_metric([name], status.get("restarts", 0))
            up.add_metric([name], 1 if status.get("running") else 0)
        yield restarts
        yield up


def supervisor_status() -> dict[str, dict]:
    """What ``make run``'s supervisor last wrote about its processes; empty without one."""
    try:
        return json.loads((Path(settings.VAR_DIR) / "supervisor.json").read_text())
    except (OSError, ValueError):
        return {}


registry.register(SupervisedProcesses())


class _WithoutTenants:
    """A registry's metrics with the ``tenant`` label summed away: what an unauthenticated
    scrape of a production server sees (tenant names are the operator's to read). A
    counter's ``_created`` timestamp is no sum (three tenants' came out a century ahead): it
    is left out, as Prometheus allows."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self):
        for family in self.source.collect():
            if "tenant" not in {name for sample in family.samples for name in sample.labels}:
                yield family
                continue
            totals: dict[tuple, float] = {}
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "tenant"))
                key = (sample.name, labels)
                totals[key] = totals.get(key, 0.0) + sample.value
            family.samples = [
                type(family.samples[0])(name, dict(labels), value, None, None)
                for (name, labels), value in totals.items()
            ]
            yield family


def _collected() -> CollectorRegistry:
    """The registry a scrape reads: this process's; or, where the web processes share a port
    (``make run`` with ``WEB_PROCESSES`` > 1, each started with ``PROMETHEUS_MULTIPROC_DIR``),
    every web process's counts together (prometheus_client's multiprocess mode): a scrape
    reached one of them, and showed its share only, each scrape another's."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return registry
    every_process = CollectorRegistry()
    MultiProcessCollector(every_process)
    every_process.register(SupervisedProcesses())
    return every_process


def exposition(*, with_tenants: bool = True) -> bytes:
    collected = _collected()
    return generate_latest(collected if with_tenants else _WithoutTenants(collected))
