"""Settling requests in groups: each still gets exactly one record and its slot back, a burst
costs a few transactions instead of one each, and one request's failure stays its own."""

import asyncio
import threading
from datetime import UTC, datetime
from decimal import Decimal

import msgspec
import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.db import OperationalError, connections

from serving import settlement, usage_spool
from serving.metering import metered
from tenants import quotas, services
from tenants.models import ApiKey, Plan, UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def keys(async_db):
    cache.clear()
    plan = Plan.objects.create(slug="open", name="Open")
    tenant = services.tenant_create(slug="acme", plan=plan, max_concurrent_requests=100)
    other = services.tenant_create(slug="globex", plan=plan)
    yield services.api_key_create(tenant=tenant, name="k")[0], other
    cache.clear()


@pytest.fixture
def groups(monkeypatch):
    """The size of each group settled, in order."""
    sizes: list[int] = []
    settle_group = settlement._settle_group

    async def counted(group):
        sizes.append(len(group))
        return await settle_group(group)

    monkeypatch.setattr(settlement, "_settle_group", counted)
    return sizes


async def _run(api_key, request_id: str, tokens: int) -> None:
    async with metered(
        request_id=request_id,
        tenant=api_key.tenant,
        api_key=api_key,
        model="m",
        source=UsageRecord.Source.API,
        estimated_tokens=100,
    ) as meter:
        await asyncio.sleep(0)
        meter.prompt_tokens, meter.completion_tokens = 5, tokens


def _settlement(api_key, request_id: str, tenant=None, tokens: int = 7):
    now = datetime.now(UTC)
    ticket = quotas.admission_acquire(tenant=api_key.tenant, api_key=api_key, estimated_tokens=50)
    return settlement.Settlement(
        ticket=ticket,
        actual_tokens=tokens,
        record={
            "request_id": request_id,
            "tenant": tenant or api_key.tenant,
            "api_key": api_key,
            "model": "m",
            "source": UsageRecord.Source.API,
            "status": UsageRecord.Status.OK,
            "started_at": now,
            "finished_at": now,
            "completion_tokens": tokens,
        },
    )


def _concurrent(api_key) -> int:
    return quotas.quota_usage(tenant=api_key.tenant, api_key=api_key).concurrent_requests


async def test_requests_that_end_together_share_a_transaction(keys, groups):
    api_key, _ = keys
    await asyncio.gather(*(_run(api_key, f"req-{n}", tokens=n) for n in range(40)))

    records = await sync_to_async(list)(UsageRecord.objects.order_by("completion_tokens"))
    assert [(r.request_id, r.completion_tokens, r.prompt_tokens) for r in records] == [
        (f"req-{n}", n, 5) for n in range(40)
    ]
    assert sum(groups) == 40 and len(groups) <= 3  # 40 ended together: not 40 transactions
    assert await sync_to_async(_concurrent)(api_key) == 0


async def test_a_lone_request_is_settled_before_it_returns(keys, groups):
    api_key, _ = keys
    await _run(api_key, "alone", tokens=3)
    assert groups == [1]  # settled on its own, without waiting for company
    record = await UsageRecord.objects.aget(request_id="alone")
    assert record.completion_tokens == 3 and record.api_key_id == api_key.pk


async def test_one_bad_record_fails_alone(keys, groups):
    api_key, other_tenant = keys
    good = [await sync_to_async(_settlement)(api_key, f"good-{n}") for n in range(3)]
    bad = await sync_to_async(_settlement)(api_key, "bad", tenant=other_tenant)

    outcomes = await asyncio.gather(
        *(settlement.settle(s) for s in [good[0], bad, *good[1:]]), return_exceptions=True
    )

    assert outcomes[0] is None and outcomes[2] is None and outcomes[3] is None
    assert isinstance(outcomes[1], ValidationError)
    ids = await sync_to_async(set)(UsageRecord.objects.values_list("request_id", flat=True))
    assert ids == {"good-0", "good-1", "good-2"}
    assert await sync_to_async(_concurrent)(api_key) == 0  # the bad one's slot came back too


async def test_a_request_id_settled_twice_keeps_its_first_record(keys, groups):
    api_key, _ = keys
    api_key.tenant.tokens_per_minute = 10_000
    await api_key.tenant.asave()
    first = await sync_to_async(_settlement)(api_key, "twice", tokens=1)
    again = await sync_to_async(_settlement)(api_key, "twice", tokens=2)
    await asyncio.gather(settlement.settle(first), settlement.settle(again))
    # the counter counts what the record says, once
    usage = await sync_to_async(quotas.quota_usage)(tenant=api_key.tenant)
    assert usage.tokens_this_minute == 1
    later = await sync_to_async(_settlement)(api_key, "twice", tokens=3)
    await settlement.settle(later)

    records = await sync_to_async(list)(UsageRecord.objects.filter(request_id="twice"))
    assert [r.completion_tokens for r in records] == [1]


async def test_a_batch_line_run_again_under_its_id_is_charged_once(async_db):
    """A runner died after the line's record was written, before its result was: the next
    runner runs the line again under the same request id. The record stands and the second is
    dropped; the month's counter was charged twice, and refused the tenant early."""
    await sync_to_async(cache.clear)()
    plan = await Plan.objects.acreate(slug="b", name="B", monthly_token_budget=1_000_000)
    tenant = await sync_to_async(services.tenant_create)(slug="acme", plan=plan)
    api_key = (await sync_to_async(services.api_key_create)(tenant=tenant, name="k"))[0]

    async def run_line() -> None:
        async with metered(
            request_id="batch_req_1",
            tenant=tenant,
            api_key=api_key,
            model="m",
            source=UsageRecord.Source.BATCH,
            estimated_tokens=500,
            counts_per_minute=False,
        ) as meter:
            await asyncio.sleep(0)
            meter.prompt_tokens, meter.completion_tokens = 20, 80

    await run_line()
    await run_line()
    usage = await sync_to_async(quotas.quota_usage)(tenant=tenant)
    assert usage.month_tokens == 100 and await UsageRecord.objects.acount() == 1
    await sync_to_async(cache.clear)()


@pytest.fixture
def spool(settings, tmp_path):
    settings.USAGE_SPOOL_DIR = tmp_path / "usage-spool"
    return settings.USAGE_SPOOL_DIR


async def test_records_the_database_cannot_take_are_kept_and_saved_once_it_answers(
    budgeted_key, groups, monkeypatch, spool
):
    """The database out of reach as requests ended: their records were lost (served, never
    billed). They are kept on disk, the requests end well, and the month counts them."""
    api_key = budgeted_key
    save = services.usage_records_save

    def unavailable(records):
        raise OperationalError("the database went away")

    monkeypatch.setattr(services, "usage_records_save", unavailable)
    await asyncio.gather(*(_run(api_key, f"kept-{n}", tokens=n) for n in range(5)))

    assert await sync_to_async(_concurrent)(api_key) == 0 and sum(groups) == 5
    assert await UsageRecord.objects.acount() == 0
    assert await sync_to_async(_month_tokens)(api_key.tenant) == 5 * 5 + sum(range(5))
    kept = list(spool.glob("*.jsonl"))
    assert kept and all(path.stat().st_mode & 0o077 == 0 for path in kept)  # owner-only

    monkeypatch.setattr(services, "usage_records_save", save)  # the database is back
    assert await sync_to_async(usage_spool.spool_replay)() == 5

    records = await sync_to_async(list)(UsageRecord.objects.order_by("completion_tokens"))
    assert [(r.request_id, r.completion_tokens, r.api_key_id) for r in records] == [
        (f"kept-{n}", n, api_key.pk) for n in range(5)
    ]
    assert not list(spool.iterdir())


async def test_where_the_disk_refuses_them_too_each_request_hears_it(
    keys, groups, monkeypatch, spool
):
    api_key, _ = keys

    def unavailable(records):
        raise OperationalError("the database went away")

    def disk_full(records):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(services, "usage_records_save", unavailable)
    monkeypatch.setattr(usage_spool, "spool_write", disk_full)
    outcomes = await asyncio.gather(
        *(_run(api_key, f"lost-{n}", tokens=1) for n in range(5)), return_exceptions=True
    )

    assert all(isinstance(outcome, OperationalError) for outcome in outcomes)
    assert await sync_to_async(_concurrent)(api_key) == 0
    assert await sync_to_async(_month_tokens)(api_key.tenant) == 0


def test_a_replay_skips_what_was_saved_and_drops_what_has_no_tenant(keys, spool, settings):
    """The commit that failed to answer may have gone through (its records stand once); a
    tenant deleted meanwhile takes its records with it. Both leave the rest saved, and a
    replayed record is new to the usage roll-ups."""
    api_key, other = keys
    gone = services.tenant_create(slug="gone")
    gone_key, _ = services.api_key_create(tenant=gone, name="k")
    records = [
        services.usage_record_build(**_settlement(api_key, "saved-already").record),
        services.usage_record_build(**_settlement(gone_key, "tenant-gone").record),
        services.usage_record_build(**_settlement(api_key, "new", tokens=3).record),
    ]
    created_at = records[2].created_at
    services.usage_records_save([records[0]])
    usage_spool.spool_write(records)
    gone.delete()

    assert usage_spool.spool_replay() == 3

    saved = dict(UsageRecord.objects.values_list("request_id", "completion_tokens"))
    assert saved == {"saved-already": 7, "new": 3}
    assert UsageRecord.objects.get(request_id="new").created_at > created_at
    assert not list(spool.iterdir())


def test_a_replay_keeps_what_a_record_was_billed_at(keys, spool):
    """A kept batch line is billed at the plan it ran under, whatever the plan at replay; a
    file kept before records carried their billing is billed at the plan of now (without
    it, each of its records was dropped as if its tenant were gone)."""
    api_key, _ = keys
    plan = api_key.tenant.plan
    plan.batch_price_factor = Decimal("0.50")
    plan.save()
    batch_line = {**_settlement(api_key, "batch", tokens=9).record, "source": "batch"}
    usage_spool.spool_write([services.usage_record_build(**batch_line)])
    old = services.usage_record_build(**{**batch_line, "request_id": "old"})
    old_file = usage_spool.spool_write([old])
    rows = [msgspec.json.decode(line) for line in old_file.read_bytes().splitlines()]
    old_file.write_bytes(b"".join(
        msgspec.json.encode({k: v for k, v in row.items() if k != "billed_tokens"}) + b"\n"
        for row in rows
    ))  # fmt: skip
    plan.batch_price_factor = Decimal("0.25")
    plan.save()

    assert usage_spool.spool_replay() == 2

    billed = dict(UsageRecord.objects.values_list("request_id", "billed_tokens"))
    assert billed == {"batch": Decimal("4.50"), "old": Decimal("2.25")}


def test_a_replay_with_the_database_still_away_keeps_the_file(keys, spool, monkeypatch):
    api_key, _ = keys
    usage_spool.spool_write([services.usage_record_build(**_settlement(api_key, "r").record)])

    def unavailable(records):
        raise OperationalError("the database went away")

    monkeypatch.setattr(services, "usage_records_save", unavailable)
    with pytest.raises(OperationalError):
        usage_spool.spool_replay()
    assert len(list(spool.glob("*.jsonl"))) == 1


async def test_a_request_whose_counters_could_not_be_corrected_still_ends_well(
    keys, groups, monkeypatch
):
    """The cache was unreachable as the request settled: its record was written, yet the
    error was the request's, and a whole answer was a 500 (a chat reply saved as failed).
    The counters heal on their own (leases run out, month reservations are settled again),
    and the log tells."""
    api_key, _ = keys

    def unreachable(**kwargs) -> None:
        raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(quotas, "admission_free", unreachable)
    monkeypatch.setattr(quotas, "admission_settle_month", unreachable)
    await _run(api_key, "settled", tokens=3)

    record = await UsageRecord.objects.aget(request_id="settled")
    assert record.completion_tokens == 3


async def _eventually(check, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await sync_to_async(check)():
        assert asyncio.get_running_loop().time() < deadline, "never happened"
        await asyncio.sleep(0.02)


async def test_a_request_cancelled_during_its_admission_holds_no_slot(keys):
    """Cancelled (its client left) while the admission is still on the worker thread: the
    admission made there afterwards must not outlive the request."""
    api_key, _ = keys
    on_thread, go_on = threading.Event(), threading.Event()

    def precondition() -> None:  # runs on the worker thread just before the admission
        on_thread.set()
        go_on.wait(10)

    async def request() -> None:
        async with metered(
            request_id="req-cancelled",
            tenant=api_key.tenant,
            api_key=api_key,
            model="m",
            source=UsageRecord.Source.API,
            estimated_tokens=100,
            precondition=precondition,
        ):
            raise AssertionError("a cancelled request never runs")

    task = asyncio.create_task(request())
    assert await asyncio.to_thread(on_thread.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    go_on.set()  # the worker thread now admits the request that is gone

    await _eventually(lambda: _concurrent(api_key) == 0 and UsageRecord.objects.exists())
    record = await UsageRecord.objects.aget()
    assert (record.request_id, record.status, record.error_code) == (
        "req-cancelled",
        UsageRecord.Status.CANCELLED,
        "cancelled",
    )
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)


def _month_tokens(tenant) -> int:
    return quotas.quota_usage(tenant=tenant).month_tokens


def _settle_now(pending: settlement.Settlement) -> None:
    asyncio.run(settlement.settle(pending))


def _thread(target, *args) -> threading.Thread:
    def run() -> None:
        try:
            target(*args)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _rebuilding(tenant) -> threading.Thread:
    """The next admission of the tenant, which finds its month counter gone and rebuilds it
    from the usage records (it holds nothing: 0 tokens)."""
    return _thread(lambda: quotas.admission_acquire(tenant=tenant, estimated_tokens=0))


@pytest.fixture
def budgeted_key(async_db):
    cache.clear()
    plan = Plan.objects.create(slug="metered", name="Metered", monthly_token_budget=1_000_000)
    tenant = services.tenant_create(slug="acme", plan=plan)
    yield services.api_key_create(tenant=tenant, name="k")[0]
    cache.clear()


def _pausing(monkeypatch, name: str, *, after: bool) -> tuple[threading.Event, threading.Event]:
    """``quotas.<name>`` made to stop before (or after) its work until told to go on; the
    events (reached, go on)."""
    original = getattr(quotas, name)
    reached, go_on = threading.Event(), threading.Event()

    def pause() -> None:
        reached.set()
        go_on.wait(10)

    def paused(**kwargs):
        if not after:
            pause()
        result = original(**kwargs)
        if after:
            pause()
        return result

    monkeypatch.setattr(quotas, name, paused)
    return reached, go_on


def test_a_request_settling_while_its_month_counter_is_rebuilt_counts_once_if_read_before(
    budgeted_key, monkeypatch
):
    """The cache lost the month's counter mid-request (a Redis restart). The next admission
    rebuilds it from the usage records; the request settles after that read, before the
    counter is back. Its tokens were in neither: the counter under-counted the month."""
    api_key = budgeted_key
    running = _settlement(api_key, "in-flight", tokens=7)
    cache.clear()
    read, go_on = _pausing(monkeypatch, "month_tokens_used", after=True)
    rebuilding = _rebuilding(api_key.tenant)
    assert read.wait(10)
    settling = _thread(_settle_now, running)
    settling.join(1)  # give it the chance to settle within the window, as it could
    go_on.set()
    rebuilding.join(10)
    settling.join(10)

    assert UsageRecord.objects.get(request_id="in-flight").completion_tokens == 7
    assert _month_tokens(api_key.tenant) == 7


def test_a_request_settling_while_its_month_counter_is_rebuilt_counts_once_if_read_after(
    budgeted_key, monkeypatch
):
    """The same, the other way round: the request's record is written, the rebuild reads it,
    and then the request corrects a counter it no longer holds a reservation on."""
    api_key = budgeted_key
    running = _settlement(api_key, "in-flight", tokens=7)
    cache.clear()
    releasing, go_on = _pausing(monkeypatch, "admission_settle_month", after=False)
    settling = _thread(_settle_now, running)
    assert releasing.wait(10)
    rebuilding = _rebuilding(api_key.tenant)
    rebuilding.join(1)
    go_on.set()
    settling.join(10)
    rebuilding.join(10)

    assert UsageRecord.objects.get(request_id="in-flight").completion_tokens == 7
    assert _month_tokens(api_key.tenant) == 7


async def test_a_group_whose_connection_died_mid_transaction_is_written_on_a_new_one(
    keys, groups, monkeypatch
):
    """The database dropped the settling thread's connection (a restart, a failover, an idle
    timeout): the records were lost and the requests answered 500."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("terminates a PostgreSQL connection")
    api_key, _ = keys
    save, dropped = services.usage_records_save, []

    def save_on_a_dropped_connection(records) -> None:
        if not dropped:
            dropped.append(True)
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        save(records)

    monkeypatch.setattr(services, "usage_records_save", save_on_a_dropped_connection)
    await asyncio.gather(*(_run(api_key, f"req-{n}", tokens=n) for n in range(5)))

    records = await sync_to_async(list)(UsageRecord.objects.order_by("completion_tokens"))
    assert [(r.request_id, r.completion_tokens) for r in records] == [
        (f"req-{n}", n) for n in range(5)
    ]
    assert dropped and await sync_to_async(_concurrent)(api_key) == 0


async def test_a_request_whose_key_or_user_was_deleted_as_it_ran_is_still_metered(keys, groups):
    """The record names a key (or user) deleted while the request ran: PostgreSQL refused it
    (the foreign key), and the request went unmetered. It now stands without the name, as
    the records written before the deletion do (SET_NULL), and its tokens are counted."""
    from django.contrib.auth import get_user_model

    api_key, _ = keys
    doomed_key = (await sync_to_async(services.api_key_create)(tenant=api_key.tenant, name="d"))[0]
    user = await sync_to_async(get_user_model().objects.create_user)("bob", password="x" * 12)
    by_key = await sync_to_async(_settlement)(doomed_key, "by-deleted-key", tokens=4)
    by_user = await sync_to_async(_settlement)(api_key, "by-deleted-user", tokens=6)
    by_user.record.update(api_key=None, user=user, source=UsageRecord.Source.CHAT)
    kept = await sync_to_async(_settlement)(api_key, "kept", tokens=1)
    # by another process: the request's own objects keep their ids
    await ApiKey.objects.filter(pk=doomed_key.pk).adelete()
    await get_user_model().objects.filter(pk=user.pk).adelete()

    outcomes = await asyncio.gather(*(settlement.settle(s) for s in (by_key, kept, by_user)))

    assert outcomes == [None, None, None]
    records = {r.request_id: r async for r in UsageRecord.objects.all()}
    assert records["by-deleted-key"].api_key_id is None
    assert records["by-deleted-key"].completion_tokens == 4
    assert records["by-deleted-user"].user_id is None
    assert records["by-deleted-user"].completion_tokens == 6
    assert records["kept"].api_key_id == api_key.pk
    usage = await sync_to_async(quotas.quota_usage)(tenant=api_key.tenant)
    assert usage.month_tokens == 11
    assert await sync_to_async(_concurrent)(api_key) == 0


def test_a_replay_skips_a_file_an_overlapping_replay_took(keys, spool, monkeypatch):
    api_key, _ = keys
    kept = usage_spool.spool_write(
        [services.usage_record_build(**_settlement(api_key, "kept").record)]
    )
    taken = spool / f"0-taken{usage_spool.SUFFIX}"  # listed, then saved by the other run
    monkeypatch.setattr(usage_spool, "spool_dir", lambda: _Listing(spool, [taken, kept]))

    assert usage_spool.spool_replay() == 1
    assert UsageRecord.objects.filter(request_id="kept").exists() and not kept.exists()


class _Listing:
    """A spool directory whose listing is given."""

    def __init__(self, path, listed) -> None:
        self.path, self.listed = path, listed

    def glob(self, pattern):
        return list(self.listed)
