"""The dashboards' usage: roll-ups for the past, raw records for what the roll-up task has
not reached, refusals from their hourly counts; per hour or per day; percentiles from
histograms; charts with whole-number axes for counts."""

from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse

from console import batches_selectors, charts, usage
from console.selectors import DateRange
from tenants import rollups, services
from tenants.models import UsageRecord
from tenants.refusals import refusal_record
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 20, 15, 30, tzinfo=UTC)
TODAY = DateRange(NOW.date(), NOW.date())


@pytest.fixture
def key(tenant):
    return services.api_key_create(tenant=tenant, name="prod")[0]


def _record(key, started_at, n: int, *, status: str = "ok", ttft: float = 40.0) -> None:
    usage_record_add(
        request_id=f"r-{n}",
        tenant=key.tenant,
        api_key=key,
        model="demo-chat",
        source=UsageRecord.Source.API,
        status=status,
        started_at=started_at,
        finished_at=started_at + timedelta(seconds=1),
        prompt_tokens=10,
        completion_tokens=5,
        time_to_first_token_ms=ttft,
        latency_ms=ttft + 400,
    )


def _report(tenant, **kwargs) -> usage.UsageReport:
    return usage.usage_report(date_range=TODAY, tenant=tenant, now=NOW, **kwargs)


def test_a_request_shows_before_any_roll_up_and_counts_once_after(key, tenant):
    _record(key, NOW - timedelta(hours=3), 1)
    _record(key, NOW - timedelta(seconds=1), 2)
    assert _report(tenant).total.requests == 2  # nothing rolled up yet: all live

    rollups.rollup_pending(now=NOW)
    _record(key, NOW - timedelta(minutes=1, seconds=5), 3)  # after the roll-up ran
    report = _report(tenant, granularity="hour")

    assert report.rolled_up_until == NOW.replace(minute=0)
    assert report.total.requests == 3 and report.total.tokens == 3 * 15
    by_hour = {
        start.hour: period.requests
        for start, period in zip(report.starts, report.by_period, strict=True)
    }
    assert by_hour[12] == 1 and by_hour[15] == 2 and sum(by_hour.values()) == 3
    daily = _report(tenant, granularity="day")
    assert [period.requests for period in daily.by_period] == [3]


def test_a_request_that_ends_after_a_roll_up_of_the_hour_it_began_in_shows_at_once(key, tenant):
    """Hours before the roll-up's were read from the roll-ups alone: a request that began in
    one and ended after the roll-up ran (a long stream) was missing from the dashboard, the
    CSV and the batch figures until the next roll-up."""
    _record(key, NOW - timedelta(hours=1), 1)  # 14:30, rolled up below
    rollups.rollup_pending(now=NOW)
    UsageRecord.objects.update(created_at=NOW - timedelta(minutes=30))  # before the run
    _record(key, NOW - timedelta(minutes=30, seconds=10), 2)  # began 14:59:50, ends now

    report = _report(tenant, granularity="hour")
    rows = usage.usage_csv_rows(date_range=TODAY, tenant=tenant)
    batch = batches_selectors.batch_usage(date_range=TODAY, tenant=tenant)

    assert report.total.requests == 2 and report.total.tokens == 2 * 15
    assert sum(row[4] for row in rows if isinstance(row[4], int)) == 2
    assert batch.other_tokens == 2 * 15
    assert _report(tenant, granularity="day").total.requests == 2


def test_hours_and_days_and_their_labels(key, tenant):
    _record(key, NOW, 1)
    hourly = _report(tenant, granularity="hour")
    assert len(hourly.starts) == 24 and hourly.labels[0] == "Nov 20 00:00"
    assert hourly.labels[15] == "15:00" and hourly.requests_by == {
        "demo-chat": [0.0] * 15 + [1.0] + [0.0] * 8
    }
    week = DateRange(NOW.date() - timedelta(days=usage.MAX_HOURLY_DAYS - 1), NOW.date())
    assert len(usage.usage_report(date_range=week, granularity="hour").starts) == 7 * 24
    three_weeks = DateRange(NOW.date() - timedelta(days=20), NOW.date())
    assert len(usage.usage_report(date_range=three_weeks, granularity="day").starts) == 21
    with pytest.raises(ValueError):  # 504 bars: a page shows the last week of it
        usage.usage_report(date_range=three_weeks, granularity="hour")
    assert usage.range_shown(three_weeks, "hour") == week
    assert usage.range_shown(three_weeks, "day") == three_weeks


def test_a_range_shown_per_hour_is_its_last_week_on_every_figure(client, key, tenant, user):
    """Per hour, the page showed the range asked for (two weeks) and counted only its last
    week in the totals."""
    now = datetime.now(UTC)
    services.membership_set(tenant=tenant, user=user, role="admin", actor=None)
    for n, days_ago in enumerate((10, 0)):
        _record(key, now - timedelta(days=days_ago, minutes=1), n)
    client.force_login(user)
    url = reverse("console:dashboard", args=[tenant.slug])
    first = (now - timedelta(days=13)).date()

    by_day = client.get(url, {"start": first.isoformat(), "period": "day"})
    by_hour = client.get(url, {"start": first.isoformat(), "period": "hour"})

    assert by_day.context["summary"].total.requests == 2
    assert by_day.context["date_range"].start == first
    week = by_hour.context["date_range"]
    assert (week.start, week.end) == ((now - timedelta(days=6)).date(), now.date())
    assert by_hour.context["summary"].total.requests == 1
    page = by_hour.content.decode()
    assert f'value="{week.start.isoformat()}"' in page
    assert f"Per hour shows 7 days at most: {week.start.isoformat()}" in page


def test_errors_and_refusals_are_rates_of_every_request_sent(key, tenant):
    _record(key, NOW, 1)
    _record(key, NOW, 2, status="error")
    _record(key, NOW, 3, status="rejected")  # refused by the engine: a usage record
    for _ in range(5):
        refusal_record(tenant_id=tenant.pk, api_key_id=key.pk, source="api",
                       code="rate_limit_exceeded", model="demo-chat", at=NOW)  # fmt: skip
    total = _report(tenant).total

    assert (total.requests, total.refused, total.attempts) == (3, 5, 8)
    assert total.error_rate == pytest.approx(1 / 8)
    assert total.refusal_rate == pytest.approx(6 / 8)
    assert _report(tenant, granularity="hour").rates()["refused"][15] == pytest.approx(75)


def test_percentiles_over_time_are_interpolated_not_bucket_bounds(key, tenant):
    for n, ttft in enumerate([60, 70, 80, 90], start=1):  # all in the (50, 100] bucket
        _record(key, NOW, n, ttft=ttft)
    p50 = _report(tenant, granularity="hour").percentiles("ttft")["p50"]
    assert p50[15] == pytest.approx(75) and p50[14] is None


def test_count_axes_have_whole_ticks_and_large_numbers_are_readable():
    assert charts.axis_ticks(3, is_integer=True) == [0, 1, 2, 3]
    assert charts.axis_ticks(1, is_integer=True) == [0, 1]
    assert all(tick == int(tick) for tick in charts.axis_ticks(7, is_integer=True))
    assert charts.axis_ticks(0.9) == [0, 0.25, 0.5, 0.75, 1.0]
    assert charts.axis_ticks(12_345)[-1] >= 12_345
    assert charts.exact_number(1234567) == "1,234,567"
    svg = charts.stacked_bars(["a", "b"], {"m": [1.0, 2.0]}, "requests")
    assert ">0.5<" not in svg and ">1.5<" not in svg


def test_the_dashboard_says_as_of_when_and_formats_numbers(client, django_user_model, tenant):
    owner = django_user_model.objects.create_user("owner", password="pw-owner-123")
    services.membership_set(tenant=tenant, user=owner, role="owner", actor=None)
    key = services.api_key_create(tenant=tenant, name="prod")[0]
    now = datetime.now(UTC)
    usage_record_add(
        request_id="big", tenant=tenant, api_key=key, model="demo-chat", source="api",
        status="ok", started_at=now, finished_at=now, prompt_tokens=12_000, completion_tokens=345,
    )  # fmt: skip
    client.force_login(owner)
    page = client.get(reverse("console:dashboard", args=[tenant.slug])).content.decode()
    assert ">12,345<" in page  # tokens, live: nothing was rolled up
    # the batch card's numbers too (they read "12345" beside "2,138")
    assert '>12,345</div><div class="label">API and chat tokens' in page
    assert "requests turned away before they ran" in page  # not a list read as a breakdown
    assert "As of " in page and "nothing rolled up yet" in page
    assert 'name="period"' in page and "Tokens per day" in page  # 14 days by default
    url = reverse("console:dashboard", args=[tenant.slug])
    assert "Tokens per hour" in client.get(url, {"period": "hour"}).content.decode()


def _end_user_record(key, request_id, end_user, started_at, prompt, completion, **fields):
    usage_record_add(
        request_id=request_id, tenant=key.tenant, api_key=key, model="demo-chat",
        status=fields.pop("status", "ok"), source=fields.pop("source", "api"),
        started_at=started_at, finished_at=started_at,
        prompt_tokens=prompt, completion_tokens=completion, end_user=end_user, **fields,
    )  # fmt: skip


def test_an_end_user_s_usage_is_read_from_its_records_only(key, tenant, other_tenant):
    other_key = services.api_key_create(tenant=other_tenant, name="prod")[0]
    _end_user_record(key, "a-old", "alice", NOW - timedelta(hours=5), 100, 11)
    _end_user_record(key, "a-new", "alice", NOW, 100, 11, source="batch")
    _end_user_record(key, "b", "bob", NOW - timedelta(hours=5), 500, 55)
    _end_user_record(other_key, "g", "alice", NOW, 700, 77)
    refusal_record(tenant_id=tenant.pk, api_key_id=key.pk, source="api",
                   code="rate_limit_exceeded", model="demo-chat", at=NOW)  # fmt: skip
    rollups.rollup_pending(now=NOW)  # the hour of a-old and b is rolled up, without end users

    alice = _report(tenant, end_user="alice", granularity="hour")
    assert (alice.total.requests, alice.total.tokens, alice.total.refused) == (2, 222, 0)
    assert alice.end_user == "alice" and [p.tokens for p in alice.by_period][10:16] == [
        111, 0, 0, 0, 0, 111
    ]  # fmt: skip
    assert _report(tenant).total.tokens == 222 + 555
    assert _report(tenant, end_user="carol").total.requests == 0
    batch = batches_selectors.batch_usage(date_range=TODAY, tenant=tenant, end_user="alice")
    assert (batch.batch_requests, batch.batch_tokens, batch.other_tokens) == (1, 111, 111)


def test_the_dashboard_filters_by_end_user(client, django_user_model, key, tenant, other_tenant):
    owner = django_user_model.objects.create_user("owner", password="pw-owner-123")
    services.membership_set(tenant=tenant, user=owner, role="owner", actor=None)
    other_key = services.api_key_create(tenant=other_tenant, name="prod")[0]
    now = datetime.now(UTC)
    _end_user_record(key, "a-old", "alice", now - timedelta(days=2), 1000, 111)
    _end_user_record(key, "a-new", "alice", now, 1000, 111)
    _end_user_record(key, "b", "bob", now - timedelta(days=2), 5000, 55)
    _end_user_record(other_key, "g", "alice", now, 7000, 777)
    rollups.rollup_pending()
    client.force_login(owner)
    url = reverse("console:dashboard", args=[tenant.slug])

    everyone = client.get(url).content.decode()
    assert 'name="end_user"' in everyone and ">7,277<" in everyone
    assert "filtered by end user" not in everyone
    filtered = client.get(url, {"end_user": "alice"})
    page = filtered.content.decode()
    assert ">2,222<" in page and 'value="alice"' in page  # acme's alice only
    # the usage is alice's (the quota rows, the tenant's standing, are not filtered)
    assert filtered.context["summary"].total.tokens == 2222
    assert ">9,999<" not in page and "5,055" not in page
    assert "filtered by end user: read from request records" in page
    response = client.get(url, {"end_user": "x" * 257})
    assert response.status_code == 400 and ">7,277<" in response.content.decode()
    other = reverse("console:dashboard", args=[other_tenant.slug])
    assert client.get(other, {"end_user": "alice"}).status_code == 404


def _csv(client, tenant, **params) -> list[list[str]]:
    response = client.get(reverse("console:usage-csv", args=[tenant.slug]), params)
    assert response.status_code == 200 and response["Content-Type"] == "text/csv; charset=utf-8"
    lines = response.content.decode("utf-8-sig").strip().splitlines()
    assert lines[0].startswith("date,model,source,api_key,requests")
    return [line.split(",") for line in lines[1:]]


def test_the_csv_has_what_is_not_rolled_up_yet_and_filters_by_end_user(
    client, django_user_model, key, tenant, other_tenant
):
    owner = django_user_model.objects.create_user("owner", password="pw-owner-123")
    services.membership_set(tenant=tenant, user=owner, role="owner", actor=None)
    other_key = services.api_key_create(tenant=other_tenant, name="prod")[0]
    now = datetime.now(UTC)
    two_days_ago = now - timedelta(days=2)
    _end_user_record(key, "a-old", "alice", two_days_ago, 1000, 111)
    _end_user_record(key, "b", "bob", two_days_ago, 5000, 55, status="error")
    rollups.rollup_pending()  # two days ago is rolled up; what follows is not
    _end_user_record(key, "a-new", "alice", now, 1000, 111)
    _end_user_record(key, "a-batch", "alice", now, 10, 1, source="batch")
    _end_user_record(other_key, "g", "alice", now, 7000, 777)
    client.force_login(owner)

    rows = _csv(client, tenant)
    by_day = {(row[0], row[2]): row for row in rows}
    old, today = two_days_ago.date().isoformat(), now.date().isoformat()
    prefix = key.display_prefix  # two keys of one name stay apart
    assert by_day[(old, "api")][3:] == ["prod", "2", "6000", "166", "0", "1", prefix]
    assert by_day[(today, "api")][3:] == ["prod", "1", "1000", "111", "0", "0", prefix]
    assert by_day[(today, "batch")][4:7] == ["1", "10", "1"]
    assert len(rows) == 3  # other_tenant's alice is not acme's

    alice = _csv(client, tenant, end_user="alice")
    assert sorted((row[0], row[2], row[4], row[6]) for row in alice) == [
        (old, "api", "1", "111"), (today, "api", "1", "111"), (today, "batch", "1", "1"),
    ]  # fmt: skip
    assert _csv(client, tenant, end_user="carol") == []
    url = reverse("console:usage-csv", args=[tenant.slug])
    assert client.get(url, {"end_user": "x" * 257}).status_code == 400
    page = client.get(reverse("console:dashboard", args=[tenant.slug]), {"end_user": "alice"})
    assert "end_user=alice" in page.content.decode()  # the export link keeps the filter


def _key_record(tenant, api_key, request_id: str, completion: int, **fields) -> None:
    usage_record_add(
        request_id=request_id,
        tenant=tenant,
        api_key=api_key,
        model="demo-chat",
        source=fields.pop("source", UsageRecord.Source.API),
        status="ok",
        started_at=NOW - timedelta(minutes=1),
        finished_at=NOW,
        prompt_tokens=0,
        completion_tokens=completion,
        **fields,
    )


def test_usage_by_key_keeps_keys_of_the_same_name_apart(tenant, user):
    """Two keys issued without a name are both "unnamed", and a key may be called "chat": each
    is a line of its own, told apart by its prefix, and the chat's usage stays the chat's."""
    first = services.api_key_create(tenant=tenant, name="unnamed")[0]
    second = services.api_key_create(tenant=tenant, name="unnamed")[0]
    chat_named = services.api_key_create(tenant=tenant, name="chat")[0]
    _key_record(tenant, first, "a", 1000)
    _key_record(tenant, second, "b", 10)
    _key_record(tenant, chat_named, "c", 7)
    _key_record(tenant, None, "d", 3, source=UsageRecord.Source.CHAT, user=user)

    report = _report(tenant, group_by="key")

    assert {label: totals.completion_tokens for label, totals in report.by_label.items()} == {
        f"unnamed ({first.display_prefix})": 1000,
        f"unnamed ({second.display_prefix})": 10,
        f"chat ({chat_named.display_prefix})": 7,
        "chat (no API key)": 3,
    }
    assert set(report.tokens_by) == set(report.by_label)


def test_a_key_named_other_is_not_lost_in_the_rest(tenant):
    names = ["other", *(f"k{n}" for n in range(usage.MAX_SERIES))]
    keys = {name: services.api_key_create(tenant=tenant, name=name)[0] for name in names}
    for n, name in enumerate(names):
        _key_record(tenant, keys[name], f"r{n}", 1000 if name == "other" else 10 - n)

    report = _report(tenant, group_by="key")

    tokens = {label: totals.completion_tokens for label, totals in report.by_label.items()}
    assert sum(tokens.values()) == 1000 + sum(10 - n for n in range(1, len(names)))
    assert tokens[f"other ({keys['other'].display_prefix})"] == 1000
    assert tokens["other (the rest)"] == 10 - len(names) + 1
    assert sum(sum(series) for series in report.tokens_by.values()) == sum(tokens.values())


def test_a_latency_axis_past_a_second_is_in_seconds():
    """Its ticks read "1kms", "1.5kms", "2kms"."""
    svg = charts.lines(["a", "b"], {"p50": [400.0, 1500.0]}, "ms")
    assert "kms" not in svg
    assert all(f">{tick}<" in svg for tick in ("0s", "0.5s", "1s", "1.5s"))
    short = charts.lines(["a"], {"p50": [400.0]}, "ms")
    assert ">400ms<" in short and ">0ms<" in short


def test_a_moment_reads_as_how_long_ago_it_was():
    """The platform page's "Checked" read "0 minutes" for a check just made."""
    from console.templatetags.console_format import ago

    now = datetime.now(UTC)
    assert ago(now - timedelta(seconds=10)) == "just now"
    assert ago(now - timedelta(minutes=5)) == "5\xa0minutes ago"
    assert ago(None) == "never"
