"""Usage over a date range, per hour or per day, as the dashboards chart it.

The past comes from the roll-ups; what the roll-up task has not reached yet (it runs every
few minutes) comes from the raw usage records, so a request sent a second ago shows. The
roll-ups' cursor says where one hands over to the other: hours before the hour it last
rolled are read rolled up, everything from that hour on is read raw. Refusals before
admission come from their hourly counts (``RefusalCount``), which are always current.
"""

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db.models import Min, Sum
from django.utils import timezone

from console.selectors import MAX_SERIES, DateRange
from tenants.models import ApiKey, RefusalCount, RollupCursor, Tenant, UsageRecord, UsageRollup
from tenants.rollups import (
    CREATED_AT_SLACK,
    CURSOR,
    HISTOGRAM_BOUNDS,
    STATUS_FIELDS,
    empty_histogram,
    histogram_add,
    histogram_merge,
    histogram_percentile,
    time_per_output_token_ms,
)
from tenants.selectors import tenant_priority, tenant_share

GRANULARITIES = ("hour", "day")
MAX_HOURLY_DAYS = 7  # 168 bars
HOUR = timedelta(hours=1)


@dataclass
class Totals:
    """Counts and latency histograms of one period, one label, or a whole range."""

    requests: int = 0  # usage records: admitted, and refused by the engine ("rejected")
    ok: int = 0
    errors: int = 0
    rejected: int = 0
    cancelled: int = 0
    refused: int = 0  # refused before admission (no usage record)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    histograms: dict[str, list[int]] = field(
        default_factory=lambda: {name: empty_histogram(b) for name, b in HISTOGRAM_BOUNDS.items()}
    )

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def attempts(self) -> int:
        return self.requests + self.refused

    @property
    def error_rate(self) -> float | None:
        """Failed after admission, of every request sent."""
        return self.errors / self.attempts if self.attempts else None

    @property
    def refusal_rate(self) -> float | None:
        """Refused (a quota, an unknown model, a busy or missing engine, a prompt too long),
        of every request sent."""
        return (self.refused + self.rejected) / self.attempts if self.attempts else None

    def percentile(self, name: str, q: float) -> float | None:
        """``name`` is ``ttft``, ``tpot`` or ``latency``; milliseconds."""
        histogram_name = f"{name}_histogram"
        return histogram_percentile(
            self.histograms[histogram_name], q, HISTOGRAM_BOUNDS[histogram_name]
        )

    def add_rollup(self, row: UsageRollup) -> None:
        for name in ("requests", "ok", "errors", "rejected", "cancelled"):
            setattr(self, name, getattr(self, name) + getattr(row, name))
        self.prompt_tokens += row.prompt_tokens
        self.completion_tokens += row.completion_tokens
        self.cached_tokens += row.cached_tokens
        for name, bounds in HISTOGRAM_BOUNDS.items():
            self.histograms[name] = histogram_merge(
                [self.histograms[name], getattr(row, name)], bounds
            )

    def add_record(self, record: dict) -> None:
        self.requests += 1
        status = STATUS_FIELDS[record["status"]]
        setattr(self, status, getattr(self, status) + 1)
        self.prompt_tokens += record["prompt_tokens"]
        self.completion_tokens += record["completion_tokens"]
        self.cached_tokens += record["cached_tokens"]
        ttft, latency = record["time_to_first_token_ms"], record["latency_ms"]
        tpot = time_per_output_token_ms(latency, ttft, record["completion_tokens"])
        for name, value in (
            ("ttft_histogram", ttft),
            ("latency_histogram", latency),
            ("tpot_histogram", tpot),
        ):
            histogram_add(self.histograms[name], value, HISTOGRAM_BOUNDS[name])


@dataclass
class UsageReport:
    granularity: str  # "hour" or "day"
    starts: list[datetime]  # each period's start (UTC)
    by_period: list[Totals]
    by_label: dict[str, Totals]  # the top lines by tokens (then requests), then the rest
    total: Totals
    as_of: datetime  # the raw records are read up to now
    rolled_up_until: datetime | None  # roll-ups cover the hours before; None: none yet
    end_user: str | None = None  # set: only its requests, all read from the raw records
    tokens_by: dict[str, list[float]] = field(default_factory=dict)
    requests_by: dict[str, list[float]] = field(default_factory=dict)
    tenant_links: dict[str, str] = field(default_factory=dict)  # a line's name -> its tenant

    @property
    def rows(self) -> list[tuple[str, Totals, str | None]]:
        """``by_label`` as (name, totals, tenant slug or None) for a template: a dict's
        ``items`` there would be its key "items" where a line has that name."""
        return [
            (label, totals, self.tenant_links.get(label)) for label, totals in self.by_label.items()
        ]

    @property
    def labels(self) -> list[str]:
        if self.granularity == "day":
            return [start.strftime("%b %d") for start in self.starts]
        labels, previous_day = [], None
        for start in self.starts:
            day = start.date()
            labels.append(start.strftime("%b %d %H:00" if day != previous_day else "%H:00"))
            previous_day = day
        return labels

    def percentiles(self, name: str) -> dict[str, list[float | None]]:
        """p50 and p95 of ``name`` per period (ms), for a line chart."""
        return {
            f"p{round(q * 100)}": [period.percentile(name, q) for period in self.by_period]
            for q in (0.5, 0.95)
        }

    def rates(self) -> dict[str, list[float | None]]:
        """Error and refusal rates per period (percent), for a line chart."""
        return {
            "errors": [_percent(period.error_rate) for period in self.by_period],
            "refused": [_percent(period.refusal_rate) for period in self.by_period],
        }


def _percent(rate: float | None) -> float | None:
    return None if rate is None else 100 * rate


def _hour_floor(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def granularity_of(date_range: DateRange, asked: str | None) -> str:
    """``asked`` (``hour`` or ``day``), or by default per hour for a range of up to two days."""
    if asked in GRANULARITIES:
        return asked
    return "hour" if len(date_range.days) <= 2 else "day"


def range_shown(date_range: DateRange, granularity: str) -> DateRange:
    """The range a page shows ``date_range`` as: per hour its last ``MAX_HOURLY_DAYS`` days at
    most (168 bars), and every figure on the page then covers that range."""
    if granularity == "hour" and len(date_range.days) > MAX_HOURLY_DAYS:
        return DateRange(date_range.end - timedelta(days=MAX_HOURLY_DAYS - 1), date_range.end)
    return date_range


def _periods(date_range: DateRange, granularity: str) -> tuple[list[datetime], datetime, timedelta]:
    start, end = date_range.bounds
    step = HOUR if granularity == "hour" else timedelta(days=1)
    return [start + i * step for i in range(int((end - start) / step))], end, step


def rolled_up_until() -> datetime | None:
    """The start of the hour the roll-up task last rolled: roll-ups before it are complete."""
    cursor = RollupCursor.objects.filter(name=CURSOR).first()
    return _hour_floor(cursor.position) if cursor is not None else None


@dataclass(frozen=True)
class _Series:
    """One line of a breakdown: what it counts (``kind`` and ``ident``), the name it is shown
    by, and a longer name for when another line of the same report has that name (two keys
    may share a name, and a key may be called "chat" or "other")."""

    kind: str
    ident: object
    name: str
    distinct_name: str
    tenant_slug: str | None = None  # a tenant's line links to its dashboard


_REST = _Series("rest", None, "other", "other (the rest)")


class _Labeller:
    def __init__(self, group_by: str, tenant: Tenant | None) -> None:
        self.group_by = group_by
        self.key_names = (
            {
                pk: (name, f"sk-{prefix}…")
                for pk, name, prefix in ApiKey.objects.filter(tenant=tenant).values_list(
                    "pk", "name", "prefix"
                )
            }
            if tenant
            else {}
        )
        self.slugs = dict(Tenant.objects.values_list("pk", "slug")) if group_by == "tenant" else {}

    def __call__(
        self, *, tenant_id: int, api_key_id: int | None, model: str, source: str
    ) -> _Series:
        if self.group_by == "key":
            if api_key_id is None and source in ("chat", "batch"):
                return _Series("source", source, source, f"{source} (no API key)")
            if api_key_id not in self.key_names:
                return _Series("deleted key", None, "deleted key", "deleted keys")
            name, prefix = self.key_names[api_key_id]
            return _Series("key", api_key_id, name, f"{name} ({prefix})")
        if self.group_by == "tenant":
            slug = self.slugs.get(tenant_id)
            if slug is None:
                return _Series("deleted tenant", None, "deleted tenant", "deleted tenants")
            return _Series("tenant", tenant_id, slug, slug, tenant_slug=slug)
        if self.group_by == "source":
            label = UsageRecord.Source(source).label
            return _Series("source", source, label, label)
        if not model:
            return _Series("model", "", "unknown model", "(no model name)")
        return _Series("model", model, model, model)


def _display_names(series: list[_Series]) -> dict[_Series, str]:
    """Each line's name, the longer one where two lines would show the same (and a number
    after it should even those meet)."""
    shown = Counter(line.name for line in series)
    names = {line: line.name if shown[line.name] == 1 else line.distinct_name for line in series}
    taken = Counter(names.values())
    seen: Counter[str] = Counter()
    for line in series:
        name = names[line]
        if taken[name] > 1:
            seen[name] += 1
            names[line] = f"{name} #{seen[name]}"
    return names


def usage_report(
    *,
    date_range: DateRange,
    tenant: Tenant | None = None,
    group_by: str = "model",
    granularity: str = "day",
    end_user: str | None = None,
    now: datetime | None = None,
) -> UsageReport:
    """Usage in ``date_range`` (per hour: of ``MAX_HOURLY_DAYS`` at most, see ``range_shown``)
    for one tenant or all, grouped by ``model``, ``key`` or ``tenant``.

    With ``end_user`` (the API requests' ``user``), only that end user's requests: the
    roll-ups and the refusal counts do not carry it, so the whole range is read from the raw
    records, and refusals before admission (which have no record) are left out."""
    if range_shown(date_range, granularity) != date_range:
        raise ValueError(f"per hour, a range of {MAX_HOURLY_DAYS} days at most")
    now = now or timezone.now()
    starts, end, step = _periods(date_range, granularity)
    start = starts[0] if starts else end
    handover = handover_of(start, end, end_user)
    by_period = [Totals() for _ in starts]
    by_label: dict[_Series, Totals] = defaultdict(Totals)
    tokens_by: dict[_Series, list[float]] = defaultdict(lambda: [0.0] * len(starts))
    requests_by: dict[_Series, list[float]] = defaultdict(lambda: [0.0] * len(starts))
    label_of = _Labeller(group_by, tenant)

    def index(moment: datetime) -> int | None:
        i = int((moment.astimezone(UTC) - start) / step)
        return i if 0 <= i < len(starts) else None

    def count(i: int | None, label: _Series, add) -> None:
        if i is None:
            return
        before = (by_label[label].tokens, by_label[label].requests)
        add(by_period[i])
        add(by_label[label])
        tokens_by[label][i] += by_label[label].tokens - before[0]
        requests_by[label][i] += by_label[label].requests - before[1]

    def scoped(queryset):
        return queryset.filter(tenant=tenant) if tenant is not None else queryset

    for row in rollups_before(scoped, granularity, start, handover):
        label = label_of(
            tenant_id=row.tenant_id, api_key_id=row.api_key_id, model=row.model, source=row.source
        )
        count(index(row.period_start), label, lambda totals, row=row: totals.add_rollup(row))
    for record in raw_records(scoped, handover, end, end_user):
        label = label_of(
            tenant_id=record["tenant_id"],
            api_key_id=record["api_key_id"],
            model=record["model"],
            source=record["source"],
        )
        count(index(record["started_at"]), label, lambda totals, r=record: totals.add_record(r))
    refusals = scoped(RefusalCount.objects).filter(hour__gte=start, hour__lt=end)
    if end_user is not None:
        refusals = refusals.none()
    for group in refusals.values("tenant_id", "api_key_id", "model", "source", "hour").annotate(
        n=Sum("count")
    ):
        label = label_of(
            tenant_id=group["tenant_id"],
            api_key_id=group["api_key_id"],
            model=group["model"],
            source=group["source"],
        )
        count(index(group["hour"]), label, lambda totals, n=group["n"]: _refuse(totals, n))

    order = sorted(by_label, key=lambda line: (-by_label[line].tokens, -by_label[line].attempts))
    shown = order[:MAX_SERIES] + ([_REST] if len(order) > MAX_SERIES else [])
    names = _display_names(shown)
    total = Totals()
    for period in by_period:
        _merge_into(total, period)
    return UsageReport(
        granularity=granularity,
        starts=starts,
        by_period=by_period,
        by_label=_top_totals(by_label, order, names),
        tenant_links={names[line]: line.tenant_slug for line in shown if line.tenant_slug},
        total=total,
        as_of=now,
        rolled_up_until=rolled_up_until(),
        end_user=end_user,
        tokens_by=_top_series(tokens_by, order, names),
        requests_by=_top_series(requests_by, order, names),
    )


def usage_csv_rows(
    *, date_range: DateRange, tenant: Tenant, end_user: str | None = None
) -> list[list]:
    """The CSV export's rows (``USAGE_CSV_HEADER``): one per day, model, source and API key,
    read as the dashboard reads them: roll-ups up to the cursor, raw records after it (so
    today is there), and with ``end_user`` that end user's records only."""
    start, end = date_range.bounds
    handover = handover_of(start, end, end_user)
    keys = ApiKey.objects.filter(tenant=tenant).only("pk", "name", "prefix")
    key_names = {key.pk: (key.name, key.display_prefix) for key in keys}
    by_row: dict[tuple, Totals] = defaultdict(Totals)

    def scoped(queryset):
        return queryset.filter(tenant=tenant)

    for row in rollups_before(scoped, "day", start, handover):
        day = row.period_start.astimezone(UTC).date()
        by_row[(day, row.model, row.source, row.api_key_id)].add_rollup(row)
    for record in raw_records(scoped, handover, end, end_user):
        day = record["started_at"].astimezone(UTC).date()
        by_row[(day, record["model"], record["source"], record["api_key_id"])].add_record(record)
    return [
        [
            day.isoformat(),
            model,
            source,
            key_names.get(api_key_id, ("", ""))[0],
            totals.requests,
            totals.prompt_tokens,
            totals.completion_tokens,
            totals.cached_tokens,
            totals.errors,
            key_names.get(api_key_id, ("", ""))[1],
        ]
        for (day, model, source, api_key_id), totals in sorted(
            by_row.items(), key=lambda item: (item[0][0], item[0][1], item[0][2], item[0][3] or 0)
        )
    ]


def handover_of(start: datetime, end: datetime, end_user: str | None) -> datetime:
    """Where the roll-ups hand over to the raw records, within the range: the hour the roll-up
    last ran in, or the earlier hour a record it may have missed began in (one created since
    it ran, less the slack its next run rolls over again: a long stream that began in an hour
    rolled up before it ended was missing until the next run); the range's start for an end
    user's usage (the roll-ups do not carry end users)."""
    if end_user is not None:
        return start
    cursor = RollupCursor.objects.filter(name=CURSOR).first()
    if cursor is None:
        return start
    missed = UsageRecord.objects.filter(created_at__gte=cursor.position - CREATED_AT_SLACK)
    earliest = missed.aggregate(earliest=Min("started_at"))["earliest"]
    handover = _hour_floor(cursor.position)
    if earliest is not None:
        handover = min(handover, _hour_floor(earliest))
    return min(max(handover, start), end)


def raw_records(scoped, handover: datetime, end: datetime, end_user: str | None):
    """The usage records from ``handover`` to ``end`` (an end user's only, if one is given),
    as the dicts ``Totals.add_record`` reads, with their tenant, key, model and source (and
    what they are billed as, for ``console.batches_selectors``)."""
    records = scoped(UsageRecord.objects).filter(started_at__gte=handover, started_at__lt=end)
    if end_user is not None:
        records = records.filter(end_user=end_user)
    return records.values(
        "tenant_id", "api_key_id", "model", "source", "status", "prompt_tokens",
        "completion_tokens", "cached_tokens", "billed_tokens", "time_to_first_token_ms",
        "latency_ms", "started_at",
    )  # fmt: skip


def _refuse(totals: Totals, n: int) -> None:
    totals.refused += n


def rollups_before(
    scoped, granularity: str, start: datetime, handover: datetime
) -> list[UsageRollup]:
    """The roll-ups before ``handover``: days while whole days lie before it, then hours."""
    hours_from = start
    rows: list[UsageRollup] = []
    if granularity == "day":
        hours_from = max(start, handover.replace(hour=0))
        rows += scoped(UsageRollup.objects).filter(
            period=UsageRollup.Period.DAY, period_start__gte=start, period_start__lt=hours_from
        )
    rows += scoped(UsageRollup.objects).filter(
        period=UsageRollup.Period.HOUR, period_start__gte=hours_from, period_start__lt=handover
    )
    return rows


def _merge_into(total: Totals, part: Totals) -> None:
    for name in ("requests", "ok", "errors", "rejected", "cancelled", "refused",
                 "prompt_tokens", "completion_tokens", "cached_tokens"):  # fmt: skip
        setattr(total, name, getattr(total, name) + getattr(part, name))
    for name, bounds in HISTOGRAM_BOUNDS.items():
        total.histograms[name] = histogram_merge(
            [total.histograms[name], part.histograms[name]], bounds
        )


def _top_totals(
    by_series: dict[_Series, Totals], order: list[_Series], names: dict[_Series, str]
) -> dict[str, Totals]:
    top = {names[line]: by_series[line] for line in order[:MAX_SERIES]}
    if len(order) > MAX_SERIES:
        rest = Totals()
        for line in order[MAX_SERIES:]:
            _merge_into(rest, by_series[line])
        top[names[_REST]] = rest
    return top


def _top_series(
    series: dict[_Series, list[float]], order: list[_Series], names: dict[_Series, str]
) -> dict[str, list[float]]:
    """The first ``MAX_SERIES`` lines of ``order`` (the same colours in every chart), the
    rest summed as one."""
    top = {names[line]: series[line] for line in order[:MAX_SERIES] if line in series}
    rest = [series[line] for line in order[MAX_SERIES:] if line in series]
    if rest:
        top[names[_REST]] = [sum(values) for values in zip(*rest, strict=True)]
    return top


# Served tokens as the engine's fair scheduler counts them (a virtual token counter: an
# output token costs twice a prompt token, after Sheng et al., OSDI 2024).
PROMPT_TOKEN_COST = 1
OUTPUT_TOKEN_COST = 2


@dataclass(frozen=True)
class FairnessRow:
    """One tenant's service over a range, against what its plan entitles it to among the
    tenants of its tier that were served in the range (fair sharing is within a tier)."""

    tenant: Tenant
    tier: str
    weight: float
    served: int  # prompt tokens + 2 × completion tokens
    served_percent: float  # of its tier's served tokens
    entitled_percent: float  # its weight over its tier's served tenants' weights
    ttft_p50: float | None


def fairness_rows(*, date_range: DateRange) -> list[FairnessRow]:
    """Each tenant served in the range, by tier (highest priority first), then by service:
    the roll-ups up to the handover, the records after it, as the rest of the page."""
    start, end = date_range.bounds
    handover = handover_of(start, end, None)
    by_tenant: dict[int, Totals] = defaultdict(Totals)
    for row in rollups_before(_all_tenants, "day", start, handover):
        by_tenant[row.tenant_id].add_rollup(row)
    for record in raw_records(_all_tenants, handover, end, None):
        by_tenant[record["tenant_id"]].add_record(record)
    tenants = Tenant.objects.select_related("plan").in_bulk(list(by_tenant))
    served = {
        tenant_id: PROMPT_TOKEN_COST * totals.prompt_tokens
        + OUTPUT_TOKEN_COST * totals.completion_tokens
        for tenant_id, totals in by_tenant.items()
    }
    by_tier: dict[int, list[int]] = defaultdict(list)
    for tenant_id, tenant in tenants.items():
        by_tier[tenant_priority(tenant=tenant)].append(tenant_id)
    result = []
    for priority in sorted(by_tier):
        members = by_tier[priority]
        tier_served = sum(served[t] for t in members) or 1
        tier_weight = sum(tenant_share(tenant=tenants[t]) for t in members)
        for tenant_id in sorted(members, key=lambda t: -served[t]):
            tenant = tenants[tenant_id]
            weight = tenant_share(tenant=tenant)
            result.append(
                FairnessRow(
                    tenant=tenant,
                    tier=tenant.plan.get_service_tier_display(),
                    weight=weight,
                    served=served[tenant_id],
                    served_percent=100 * served[tenant_id] / tier_served,
                    entitled_percent=100 * weight / tier_weight,
                    ttft_p50=by_tenant[tenant_id].percentile("ttft", 0.5),
                )
            )
    return result


def _all_tenants(queryset):
    return queryset
