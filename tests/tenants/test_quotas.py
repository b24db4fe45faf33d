import os
import threading
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from gateway.ratelimits import ratelimit_headers
from tenants import quotas, services
from tenants.models import UsageRecord
from tests.tenants.racers import race_processes
from tests.tenants.racers import tenant_with as _tenant
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db

MINUTE_START = 1_800_000_000.0 - (1_800_000_000.0 % 60)


@pytest.fixture(autouse=True)
def clean_counters():
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def clock(monkeypatch):
    class Clock:
        now = MINUTE_START + 1

    monkeypatch.setattr(quotas, "_now", lambda: Clock.now)
    return Clock


def headers_of(outcome: quotas.AdmissionTicket | quotas.QuotaExceeded) -> dict[str, str]:
    """What the API answers with: the windows as OpenAI's headers."""
    return ratelimit_headers(outcome.windows, getattr(outcome, "retry_after", None))


def _admit(tenant, api_key=None, tokens=10, likely=None):
    return quotas.admission_acquire(
        tenant=tenant, api_key=api_key, estimated_tokens=tokens, likely_tokens=likely
    )


def test_requests_per_minute_admits_up_to_the_limit(clock):
    tenant = _tenant(requests_per_minute=3)
    tickets = [_admit(tenant) for _ in range(3)]

    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant)

    assert refused.value.kind == "requests" and refused.value.scope == "tenant"
    # at the next minute, this one's 3 still weigh in full: 20 s into it, they weigh 2
    assert headers_of(refused.value)["Retry-After"] == "79"
    assert headers_of(refused.value)["x-ratelimit-limit-requests"] == "3"
    assert headers_of(refused.value)["x-ratelimit-remaining-requests"] == "0"
    assert headers_of(refused.value)["x-ratelimit-reset-requests"] == "1m19s"
    assert "requests per minute" in str(refused.value)
    assert headers_of(tickets[0])["x-ratelimit-remaining-requests"] == "2"
    assert headers_of(tickets[2])["x-ratelimit-remaining-requests"] == "0"


def test_the_next_minute_admits_again_as_the_previous_one_slides_out(clock):
    tenant = _tenant(requests_per_minute=10)
    for _ in range(10):
        _admit(tenant)

    clock.now = MINUTE_START + 60 + 30  # half of the previous minute still counts: 5
    for _ in range(5):
        _admit(tenant)
    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant)
    assert 1 <= refused.value.retry_after <= 30

    clock.now = MINUTE_START + 180
    assert headers_of(_admit(tenant))["x-ratelimit-remaining-requests"] == "9"


def test_tokens_are_reserved_then_reconciled(clock):
    tenant = _tenant(tokens_per_minute=1000)
    first = _admit(tenant, tokens=600)
    assert headers_of(first)["x-ratelimit-remaining-tokens"] == "400"

    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant, tokens=600)
    assert refused.value.kind == "tokens"

    quotas.admission_release(ticket=first, actual_tokens=100)
    second = _admit(tenant, tokens=600)
    assert headers_of(second)["x-ratelimit-remaining-tokens"] == "300"


def test_a_request_larger_than_the_token_limit_is_refused_outright(clock):
    tenant = _tenant(tokens_per_minute=100)
    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant, tokens=101)
    assert refused.value.kind == "request_too_large"


def test_concurrency_slots_are_released(clock):
    tenant = _tenant(max_concurrent_requests=2)
    first, _second = _admit(tenant), _admit(tenant)
    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant)
    assert refused.value.kind == "concurrency"

    quotas.admission_release(ticket=first, actual_tokens=10)
    quotas.admission_release(ticket=first, actual_tokens=10)  # idempotent
    _admit(tenant)
    with pytest.raises(quotas.QuotaExceeded):
        _admit(tenant)


def test_a_refusal_rolls_back_every_counter_it_touched(clock):
    tenant = _tenant(requests_per_minute=100, tokens_per_minute=10_000, max_concurrent_requests=1)
    held = _admit(tenant, tokens=100)
    for _ in range(5):
        with pytest.raises(quotas.QuotaExceeded):
            _admit(tenant, tokens=100)

    usage = quotas.quota_usage(tenant=tenant)
    assert usage.requests_this_minute == 1
    assert usage.tokens_this_minute == 100
    assert usage.concurrent_requests == 1
    quotas.admission_release(ticket=held, actual_tokens=40)
    assert quotas.quota_usage(tenant=tenant).tokens_this_minute == 40


def _recorded_earlier(
    api_key, *, prompt_tokens: int, completion_tokens: int, request_id: str = "earlier"
) -> None:
    """A request of the key's that ended a few seconds ago, this month."""
    now = timezone.now()
    usage_record_add(
        request_id=request_id,
        tenant=api_key.tenant,
        api_key=api_key,
        model="demo-chat",
        source=UsageRecord.Source.API,
        status=UsageRecord.Status.OK,
        started_at=now - timedelta(seconds=5),
        finished_at=now,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )


def test_monthly_budget_counts_recorded_usage(clock):
    clock.now = timezone.now().timestamp()
    tenant = _tenant(monthly_token_budget=1000)
    api_key, _ = services.api_key_create(tenant=tenant, name="ci")
    _recorded_earlier(api_key, prompt_tokens=400, completion_tokens=500)

    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant, tokens=200)
    assert refused.value.kind == "monthly_tokens"
    assert refused.value.retry_after > 0
    ticket = _admit(tenant, tokens=100)
    quotas.admission_release(ticket=ticket, actual_tokens=30)
    assert quotas.quota_usage(tenant=tenant).month_tokens == 930


@pytest.mark.parametrize("monthly_token_budget", [None, 10_000])
def test_the_months_tokens_are_the_records_where_no_counter_holds_them(clock, monthly_token_budget):
    """No budget keeps no counter, and a cache restart or a new month drops it: the console's
    "Tokens this month" said 0 then, whatever the records said."""
    clock.now = timezone.now().timestamp()
    tenant = _tenant(monthly_token_budget=monthly_token_budget)
    api_key, _ = services.api_key_create(tenant=tenant, name="ci")
    _recorded_earlier(api_key, prompt_tokens=400, completion_tokens=100)
    assert quotas.quota_usage(tenant=tenant).month_tokens == 500
    assert quotas.quota_usage(tenant=tenant, api_key=api_key).month_tokens == 500


def test_key_limits_apply_on_top_of_the_tenants(clock):
    tenant = _tenant(requests_per_minute=100)
    limited, _ = services.api_key_create(tenant=tenant, name="small", requests_per_minute=2)
    free, _ = services.api_key_create(tenant=tenant, name="big")

    ticket = _admit(tenant, limited)
    assert headers_of(ticket)["x-ratelimit-remaining-requests"] == "1"  # the tighter limit
    _admit(tenant, limited)
    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant, limited)
    assert refused.value.scope == "key"
    assert "this API key" in str(refused.value)
    _admit(tenant, free)
    assert quotas.quota_usage(tenant=tenant).requests_this_minute == 3


def test_a_batch_line_skips_the_per_minute_limits_but_not_the_budget_or_concurrency(clock):
    clock.now = timezone.now().timestamp()
    tenant = _tenant(
        requests_per_minute=1,
        tokens_per_minute=100,
        max_concurrent_requests=2,
        monthly_token_budget=1000,
    )
    online = _admit(tenant, tokens=100)

    def batch_line(tokens: int) -> quotas.AdmissionTicket:
        return quotas.admission_acquire(
            tenant=tenant, estimated_tokens=tokens, counts_per_minute=False
        )

    line = batch_line(500)  # past both per-minute limits, which are already spent
    with pytest.raises(quotas.QuotaExceeded) as concurrency:
        batch_line(10)
    assert concurrency.value.kind == "concurrency"
    quotas.admission_release(ticket=line, actual_tokens=500)
    with pytest.raises(quotas.QuotaExceeded) as budget:
        batch_line(500)  # 100 held online + 500 used + 500 > 1000
    assert budget.value.kind == "monthly_tokens"
    usage = quotas.quota_usage(tenant=tenant)
    assert (usage.requests_this_minute, usage.tokens_this_minute) == (1, 100)  # online only
    assert usage.month_tokens == 600
    quotas.admission_release(ticket=online, actual_tokens=100)


def test_racing_threads_never_over_admit():
    tenant = _tenant(requests_per_minute=20)
    admitted, refused = [], []

    def attempt() -> None:
        try:
            admitted.append(_admit(tenant))
        except quotas.QuotaExceeded:
            refused.append(1)

    threads = [threading.Thread(target=attempt) for _ in range(60)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (len(admitted), len(refused)) == (20, 40)


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL: counters shared")
@pytest.mark.django_db(transaction=True)
def test_processes_sharing_redis_admit_exactly_the_limit(tmp_path):
    tenant = _tenant(requests_per_minute=20)
    counts = race_processes(tenant, tmp_path, num_processes=4, num_threads=50)
    assert sum(counts) == 20


class Injected(Exception):
    """A failure injected midway through an admission."""


def _fail_seeding_the_keys_month(monkeypatch):
    seed = quotas.month_tokens_used

    def failing(*, tenant, api_key, **bounds):
        if api_key is not None:
            raise Injected("the database went away")
        return seed(tenant=tenant, api_key=api_key, **bounds)

    monkeypatch.setattr(quotas, "month_tokens_used", failing)


def _fail_the_keys_token_counter(monkeypatch):
    add = quotas.counter_add

    def failing(key, amount, ttl):
        if key.startswith("quota:key:") and ":tokens:" in key:
            raise Injected("the cache went away")
        return add(key, amount, ttl)

    monkeypatch.setattr(quotas, "counter_add", failing)


def _fail_after_taking_the_keys_slot(monkeypatch):
    """The slot's store takes the slot, then the connection drops before the answer."""
    from tenants import slots

    for store in (slots._LocalStore, slots._RedisStore):
        take = store.acquire

        def failing(self, key, slot_id, limit, lease, take=take):
            admitted = take(self, key, slot_id, limit, lease)
            if "quota:key:" in key:
                raise Injected("the connection dropped")
            return admitted

        monkeypatch.setattr(store, "acquire", failing)


@pytest.mark.parametrize(
    "inject",
    [_fail_seeding_the_keys_month, _fail_the_keys_token_counter, _fail_after_taking_the_keys_slot],
)
def test_any_error_midway_rolls_back_every_counter(clock, monkeypatch, inject):
    tenant = _tenant(
        requests_per_minute=100,
        tokens_per_minute=10_000,
        max_concurrent_requests=2,
        monthly_token_budget=100_000,
    )
    api_key, _ = services.api_key_create(
        tenant=tenant,
        name="ci",
        requests_per_minute=100,
        tokens_per_minute=10_000,
        max_concurrent_requests=1,
        monthly_token_budget=100_000,
    )
    _admit(tenant, tokens=100)  # held: the tenant's counters are not at zero

    def counters():
        return [
            (u.requests_this_minute, u.tokens_this_minute, u.concurrent_requests, u.month_tokens)
            for u in (quotas.quota_usage(tenant=tenant, api_key=key) for key in (None, api_key))
        ]

    before = counters()
    with monkeypatch.context() as patch, pytest.raises(Injected):
        inject(patch)
        _admit(tenant, api_key, tokens=100)

    after = counters()
    # The key's month counter may have been seeded from the (empty) usage records: None -> 0.
    assert after[0] == before[0]
    assert after[1][:3] == before[1][:3] and (after[1][3] or 0) == (before[1][3] or 0)
    # Nothing leaked: the key's one slot and the tenant's second are free.
    _admit(tenant, api_key, tokens=100)
    with pytest.raises(quotas.QuotaExceeded):
        _admit(tenant, tokens=100)


def test_a_request_likely_past_a_limit_is_refused_for_good(tenant):
    tenant.tokens_per_minute = 1000
    tenant.monthly_token_budget = 5000
    tenant.save()
    with pytest.raises(quotas.QuotaExceeded) as refused:
        quotas.admission_acquire(tenant=tenant, estimated_tokens=4000, likely_tokens=1200)
    assert refused.value.is_hopeless and refused.value.kind == "request_too_large"
    with pytest.raises(quotas.QuotaExceeded) as refused:
        quotas.admission_acquire(tenant=tenant, estimated_tokens=9000, likely_tokens=6000)
    assert refused.value.is_hopeless and refused.value.kind == "budget_too_small"
    assert quotas.quota_usage(tenant=tenant).tokens_this_minute == 0


def test_a_request_that_may_exceed_a_per_minute_limit_holds_what_is_left_until_it_settles(
    tenant,
):
    """250 emoji: likely 70 tokens, at most 1,010. It holds what is left of the minute's limit
    (1,000, less the 9 a request used already), the month holds the most, and both settle to
    the real count. It held the whole limit, so after any use in the minute it was refused
    until the minute went by: every chat without max_tokens on a plan whose limit is below the
    model's context."""
    tenant.tokens_per_minute = 1000
    tenant.monthly_token_budget = 100_000
    tenant.save()
    quotas.admission_release(
        ticket=quotas.admission_acquire(tenant=tenant, estimated_tokens=10), actual_tokens=9
    )
    ticket = quotas.admission_acquire(tenant=tenant, estimated_tokens=1010, likely_tokens=70)
    usage = quotas.quota_usage(tenant=tenant)
    assert (usage.tokens_this_minute, usage.month_tokens) == (1000, 1019)
    with pytest.raises(quotas.QuotaExceeded) as refused:
        quotas.admission_acquire(tenant=tenant, estimated_tokens=10, likely_tokens=10)
    assert not refused.value.is_hopeless  # a 429: it fits once the first one settles

    quotas.admission_release(ticket=ticket, actual_tokens=300)
    usage = quotas.quota_usage(tenant=tenant)
    assert (usage.tokens_this_minute, usage.month_tokens) == (309, 309)


def test_a_request_that_may_exceed_what_is_left_is_admitted_while_its_likely_need_fits(tenant):
    tenant.tokens_per_minute = 1000
    tenant.save()
    quotas.admission_release(
        ticket=quotas.admission_acquire(tenant=tenant, estimated_tokens=950), actual_tokens=950
    )
    with pytest.raises(quotas.QuotaExceeded) as refused:
        quotas.admission_acquire(tenant=tenant, estimated_tokens=400, likely_tokens=70)
    assert not refused.value.is_hopeless  # 70 likely, 50 left: a 429
    ticket = quotas.admission_acquire(tenant=tenant, estimated_tokens=400, likely_tokens=40)
    assert quotas.quota_usage(tenant=tenant).tokens_this_minute == 1000  # what was left, held
    quotas.admission_release(ticket=ticket, actual_tokens=120)  # past the limit: owed, not lost
    assert quotas.quota_usage(tenant=tenant).tokens_this_minute == 1070


def _admitted_until_refused(tenant) -> quotas.QuotaExceeded:
    for _ in range(100):
        try:
            _admit(tenant)
        except quotas.QuotaExceeded as refused:
            return refused
    raise AssertionError("never refused")


@pytest.mark.parametrize(("previous_minute", "limit"), [(0, 3), (3, 3), (2, 3), (5, 10), (9, 10)])
@pytest.mark.parametrize("second", [1, 30, 59])
def test_a_client_that_waits_retry_after_is_admitted_and_not_much_sooner(
    clock, previous_minute, limit, second
):
    """Retry-After said "until this minute ends": then this minute's requests still weigh in
    full in the sliding window, and a client that obeyed was refused again."""
    tenant = _tenant(requests_per_minute=limit)
    clock.now = MINUTE_START - 60 + 1
    for _ in range(previous_minute):
        _admit(tenant)
    clock.now = MINUTE_START + second - 0.5
    refused = _admitted_until_refused(tenant)
    retry_after = refused.retry_after
    assert headers_of(refused)["x-ratelimit-reset-requests"] == quotas.format_wait(retry_after)

    clock.now += retry_after - 1.5
    with pytest.raises(quotas.QuotaExceeded):
        _admit(tenant)
    clock.now += 1.5
    _admit(tenant)


def test_a_refusal_reports_the_other_limits_without_the_refused_request(clock):
    """Refused for tokens, the request counts nowhere (its count of requests is taken back):
    the 429 said one request fewer was left than there was."""
    tenant = _tenant(requests_per_minute=10, tokens_per_minute=100)
    quotas.admission_release(ticket=_admit(tenant, tokens=10), actual_tokens=4)

    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant, tokens=97)

    assert refused.value.kind == "tokens"
    assert quotas.quota_usage(tenant=tenant).requests_this_minute == 1
    headers = headers_of(refused.value)
    assert headers["x-ratelimit-remaining-requests"] == "9"
    assert headers["x-ratelimit-remaining-tokens"] == "0"


def test_a_requests_limit_of_zero_refuses_for_good_and_says_so(clock):
    tenant = _tenant(requests_per_minute=0, tokens_per_minute=1000)

    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant)

    assert refused.value.is_hopeless and refused.value.kind == "no_requests"
    assert "requests per minute: the limit is 0" in str(refused.value)
    assert "tokens" not in str(refused.value) and "try again" not in str(refused.value)


def test_a_request_that_may_run_to_the_context_is_admitted_on_a_smaller_monthly_budget(clock):
    """A chat without max_tokens may run to the context (131,072 here): the month held all of
    it, so a tenant with a budget below the context was refused with nothing used, "until
    next month". It holds what is left of the budget, as a minute's limit does."""
    clock.now = timezone.now().timestamp()
    tenant = _tenant(monthly_token_budget=100_000)
    api_key, _ = services.api_key_create(tenant=tenant, name="ci")
    _recorded_earlier(api_key, prompt_tokens=30_000, completion_tokens=0)

    ticket = _admit(tenant, tokens=131_072 + 300, likely=20)

    assert quotas.quota_usage(tenant=tenant).month_tokens == 100_000  # what was left, held
    quotas.admission_release(ticket=ticket, actual_tokens=500)
    assert quotas.quota_usage(tenant=tenant).month_tokens == 30_500


def test_a_monthly_refusal_while_others_hold_the_rest_is_a_short_wait(clock):
    """What requests in flight hold comes back as they settle: a request refused meanwhile
    is told to try again soon, not next month; one refused by what was used, next month."""
    clock.now = timezone.now().timestamp()
    tenant = _tenant(monthly_token_budget=10_000)
    holder = _admit(tenant, tokens=131_072, likely=20)  # holds the whole budget

    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant, tokens=100)
    assert refused.value.kind == "monthly_tokens"
    assert refused.value.retry_after == quotas.MONTH_HELD_RETRY_SECONDS

    quotas.admission_release(ticket=holder, actual_tokens=9_950)
    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant, tokens=100)
    assert refused.value.retry_after > 24 * 3600 or clock.now > _last_day_of_month()
    _admit(tenant, tokens=50)


def _last_day_of_month() -> float:
    now = timezone.now()
    return (now + timedelta(days=1)).month != now.month and now.timestamp()


@pytest.mark.parametrize("change", ["tenant", "plan", "key"])
def test_a_budget_taken_off_and_set_again_counts_what_was_used_meanwhile(
    clock, change, django_capture_on_commit_callbacks
):
    """Without a budget nothing keeps the month's counter: set again, the counter left from
    before admitted the tenant far past its budget (and the console showed its figure)."""
    clock.now = timezone.now().timestamp()
    tenant = _tenant()
    api_key, _ = services.api_key_create(tenant=tenant, name="ci")
    owner = {"tenant": tenant, "plan": tenant.plan, "key": api_key}[change]

    def set_budget(budget: int | None) -> None:
        owner.monthly_token_budget = budget
        with django_capture_on_commit_callbacks(execute=True):
            owner.save()

    set_budget(1000)
    quotas.admission_release(ticket=_admit(tenant, api_key, tokens=100), actual_tokens=100)
    _recorded_earlier(api_key, prompt_tokens=100, completion_tokens=0)
    set_budget(None)
    for n in range(5):
        quotas.admission_release(ticket=_admit(tenant, api_key, tokens=1000), actual_tokens=1000)
        _recorded_earlier(api_key, prompt_tokens=1000, completion_tokens=0, request_id=f"r{n}")
    scope = {"key": api_key}.get(change)
    assert quotas.quota_usage(tenant=tenant, api_key=scope).month_tokens == 5100

    set_budget(1000)
    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant, api_key, tokens=800)
    assert refused.value.kind == "monthly_tokens"
    assert quotas.quota_usage(tenant=tenant, api_key=scope).month_tokens == 5100


@pytest.mark.parametrize("change", ["rename the tenant", "raise its budget", "rename its plan"])
def test_a_save_while_a_request_is_in_flight_lets_no_second_past_the_budget(
    clock, change, django_capture_on_commit_callbacks
):
    """Any save dropped the month's counter; rebuilt from the records, it no longer held what
    the requests in flight had reserved, and a second one of the same size got in."""
    clock.now = timezone.now().timestamp()
    tenant = _tenant(monthly_token_budget=1000)
    in_flight = _admit(tenant, tokens=900)

    with django_capture_on_commit_callbacks(execute=True):
        if change == "rename the tenant":
            tenant.name = "Acme Corp"
            tenant.save()
        elif change == "raise its budget":
            tenant.monthly_token_budget = 1200
            tenant.save()
        else:
            tenant.plan.name = "Unlimited (2026)"
            tenant.plan.save()

    assert quotas.quota_usage(tenant=tenant).month_tokens == 900
    with pytest.raises(quotas.QuotaExceeded):
        _admit(tenant, tokens=900)
    quotas.admission_release(ticket=in_flight, actual_tokens=900)


def test_a_budget_set_again_counts_the_records_and_the_requests_in_flight(
    clock, django_capture_on_commit_callbacks
):
    clock.now = timezone.now().timestamp()
    tenant = _tenant(monthly_token_budget=1000)
    api_key, _ = services.api_key_create(tenant=tenant, name="ci")
    in_flight = _admit(tenant, api_key, tokens=300)  # counted under the budget, running on
    with django_capture_on_commit_callbacks(execute=True):
        tenant.monthly_token_budget = None
        tenant.save()
    _recorded_earlier(api_key, prompt_tokens=500, completion_tokens=0)  # used meanwhile

    with django_capture_on_commit_callbacks(execute=True):
        tenant.monthly_token_budget = 1000
        tenant.save()

    assert quotas.quota_usage(tenant=tenant).month_tokens == 800  # 500 used, 300 held
    with pytest.raises(quotas.QuotaExceeded):
        _admit(tenant, api_key, tokens=250)
    quotas.admission_release(ticket=in_flight, actual_tokens=100)
    assert quotas.quota_usage(tenant=tenant).month_tokens == 600


def test_a_request_refused_in_a_race_for_what_is_left_waits_for_what_it_needs(clock, monkeypatch):
    """Two requests that may need more than is left both read what is left and hold it: the
    one refused was told to wait until its whole hold fit, where its likely need fits
    sooner (and a try then holds what is left again)."""
    tenant = _tenant(tokens_per_minute=1000)
    clock.now = MINUTE_START - 60 + 1
    quotas.admission_release(ticket=_admit(tenant, tokens=900), actual_tokens=900)
    clock.now = MINUTE_START + 1  # last minute's 900 weigh 885, 15 less each second
    _admit(tenant, tokens=400, likely=50)  # holds what is left: 115
    previous_minute = f":tokens:{int(MINUTE_START // 60) - 1}"
    real_get_many = quotas.cache.get_many

    def read_before_the_first_took_it(keys):
        return {k: v for k, v in real_get_many(keys).items() if k.endswith(previous_minute)}

    monkeypatch.setattr(quotas.cache, "get_many", read_before_the_first_took_it)
    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant, tokens=400, likely=50)

    # 885 + 115 held + its 50: 50 over, gone in 50 / 15 s (its 115: 115 over, 7.7 s)
    assert refused.value.retry_after == 4


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.85, "850ms"),
        (12, "12s"),
        (59.2, "1m0s"),
        (90, "1m30s"),
        (3700, "1h1m"),
        (388_895, "4d12h"),
    ],
)
def test_waits_are_written_as_openai_writes_them_up_to_days(seconds, text):
    """A monthly refusal said "Please try again in 388895s" (four and a half days)."""
    assert quotas.format_wait(seconds) == text


def test_a_monthly_refusal_says_its_wait_in_days():
    refused = quotas.QuotaExceeded(
        kind="monthly_tokens", scope="tenant", limit=300, retry_after=388_895, windows={}
    )
    assert refused.args[0].endswith("Please try again in 4d12h.")


def test_a_request_started_as_a_month_ends_is_charged_to_that_month(clock):
    """Started on a month's last second and admitted on the next one, a request was charged
    to the new month's counter while its record (by when it started) is the old month's: the
    new month's budget paid for it, and a rebuild of either counter disagreed with it."""
    from datetime import UTC, datetime

    december = datetime(2030, 12, 1, tzinfo=UTC)
    november = datetime(2030, 11, 1, tzinfo=UTC)
    clock.now = december.timestamp() + 0.5
    tenant = _tenant(monthly_token_budget=1000)
    api_key, _ = services.api_key_create(tenant=tenant, name="ci")
    for started, tokens in ((november, 200), (december, 50)):  # November's counter: its own
        usage_record_add(
            request_id=f"r-{started.month}", tenant=tenant, api_key=api_key, model="m",
            source=UsageRecord.Source.API, status="ok", started_at=started,
            finished_at=started, prompt_tokens=tokens, completion_tokens=0,
        )  # fmt: skip

    ticket = quotas.admission_acquire(
        tenant=tenant, estimated_tokens=100, month_of=december.timestamp() - 0.5
    )
    quotas.admission_release(ticket=ticket, actual_tokens=30)

    assert cache.get(quotas.month_counter_name("tenant", tenant.pk, november)) == 200 + 30
    assert not cache.get(quotas.month_counter_name("tenant", tenant.pk, december))


def test_a_refusal_against_a_month_just_ended_says_to_retry_at_once(clock):
    """A request started on a month's last second is charged to that month: refused there, a
    retry starts in the new month and is charged to it, so the wait is a second, not the
    month to come."""
    from datetime import UTC, datetime

    december = datetime(2030, 12, 1, tzinfo=UTC)
    november = datetime(2030, 11, 1, tzinfo=UTC)
    clock.now = december.timestamp() + 0.5
    tenant = _tenant(monthly_token_budget=1000)
    api_key, _ = services.api_key_create(tenant=tenant, name="ci")
    usage_record_add(
        request_id="r-nov", tenant=tenant, api_key=api_key, model="m",
        source=UsageRecord.Source.API, status="ok", started_at=november,
        finished_at=november, prompt_tokens=990, completion_tokens=0,
    )  # fmt: skip

    with pytest.raises(quotas.QuotaExceeded) as refused:
        quotas.admission_acquire(
            tenant=tenant, estimated_tokens=100, month_of=december.timestamp() - 0.5
        )
    assert refused.value.kind == "monthly_tokens"
    assert refused.value.retry_after == 1

    ticket = quotas.admission_acquire(tenant=tenant, estimated_tokens=100)  # the retry
    quotas.admission_release(ticket=ticket, actual_tokens=100)
