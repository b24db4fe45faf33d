"""The batch runner's lease, cancel and resume rules, with each line's answer made up
(``BatchRun._answer``): no engine is needed to see which lines run, and which answers reach
the output file."""

import asyncio
import json
import threading
import time
from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import OperationalError, connections
from django.utils import timezone

from batches import runner as batch_runner
from batches import services as batch_services
from batches.models import Batch, BatchRequest, File
from batches.selectors import batches_unattended
from batches.storage import file_storage
from tenants import services
from tenants.models import UsageRecord
from tests.batches.conftest import jsonl, request_line, result_lines
from tests.usage_records import usage_record_add

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

ANSWER = batch_runner.BatchRun._answer  # the real one: the world's is made up


@pytest.fixture
def world(file_storage_dir, monkeypatch):
    """A tenant and key, and the custom ids of the lines answered, in order."""
    monkeypatch.setattr(batch_services, "_queue_run", lambda batch_id: None)
    tenant = services.tenant_create(slug="acme")
    api_key, _ = services.api_key_create(tenant=tenant, name="k")
    answered: list[str] = []

    async def made_up_answer(self, request):
        answered.append(request.custom_id)
        return _ok(request)

    monkeypatch.setattr(batch_runner.BatchRun, "_answer", made_up_answer)
    return tenant, api_key, answered


def _ok(request: BatchRequest) -> dict:
    body = {"id": request.request_id, "object": "chat.completion"}
    return {"status_code": 200, "request_id": request.request_id, "body": body}


def _batch(tenant, api_key, n: int = 3) -> Batch:
    upload = SimpleUploadedFile("in.jsonl", jsonl([request_line(f"r{i}") for i in range(n)]))
    file = batch_services.file_create(tenant=tenant, upload=upload, purpose="batch")
    return batch_services.batch_create(
        tenant=tenant,
        api_key=api_key,
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )


def _custom_ids(file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    with file_storage().open(File.objects.get(pk=file_id).storage_name, "rb") as stream:
        return sorted(json.loads(line)["custom_id"] for line in stream.read().splitlines())


def _cancel_with_two_lines_in_flight(world, settings, monkeypatch) -> None:
    """Run a batch of 5 lines, two at a time, whose answers wait; cancel it while two are in
    flight; 2 s (three leases) later, try a second runner (the sweep's); then let the answers
    come. Asserts that the first runner held the batch to its end: the second found it held,
    and the two answers in flight reached the output file."""
    tenant, api_key, answered = world
    settings.BATCH_LEASE_SECONDS = 0.6  # renewed every 0.2 s
    settings.BATCH_MAX_IN_FLIGHT = 2
    release = threading.Event()

    async def long_answer(self, request):
        answered.append(request.custom_id)
        while not release.is_set():
            await asyncio.sleep(0.02)
        return _ok(request)

    monkeypatch.setattr(batch_runner.BatchRun, "_answer", long_answer)
    batch = _batch(tenant, api_key, n=5)
    outcome = {}

    def first_runner():
        try:
            outcome["first"] = batch_runner.batch_run(batch_id=batch.id)
        finally:
            connections.close_all()

    thread = threading.Thread(target=first_runner)
    thread.start()
    try:
        while len(answered) < 2:
            time.sleep(0.02)
        batch_services.batch_cancel(batch=batch)
        time.sleep(2.0)  # three leases: one not renewed has run out
        unattended = batches_unattended()
        second = batch_runner.batch_run(batch_id=batch.id)
    finally:
        release.set()
        thread.join()

    batch.refresh_from_db()
    assert batch.id not in unattended and second == "held"
    assert outcome["first"] == "cancelled" == batch.status
    assert _custom_ids(batch.output_file_id) == sorted(answered) == ["r0", "r1"]


def test_lines_in_flight_at_a_cancel_finish_under_a_lease_kept(world, settings, monkeypatch):
    """The runner stopped renewing its lease at the cancel while its lines still ran: the
    sweep gave the batch to another runner, which ended it cancelled under them, and their
    answers (already metered) were dropped."""
    _cancel_with_two_lines_in_flight(world, settings, monkeypatch)


def test_a_renewal_that_fails_once_does_not_stop_the_lease(world, settings, monkeypatch):
    """A database error in one renewal ended the heartbeat for good: the lines in flight ran on
    with no lease, the sweep gave the batch to another runner, which ended it under them, and
    their answers (metered) never reached the output file."""
    renew, num_renewals = batch_runner._renew, []

    async def renew_failing_once(*args):
        num_renewals.append(1)
        if len(num_renewals) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return await renew(*args)

    monkeypatch.setattr(batch_runner, "_renew", renew_failing_once)
    _cancel_with_two_lines_in_flight(world, settings, monkeypatch)
    assert len(num_renewals) > 1


def _left_by_a_dead_runner(tenant, api_key, batch: Batch) -> Batch:
    """r0 ran to its end (its usage record written, ok) under a runner that died before
    writing r0's result: r0 is left running, the lease held by nobody alive."""
    batch = batch_services.batch_validate(batch=batch)
    BatchRequest.objects.filter(batch=batch, custom_id="r0").update(
        status=BatchRequest.Status.RUNNING, request_id="chatcmpl-dead0"
    )
    now = timezone.now()
    usage_record_add(
        request_id="chatcmpl-dead0",
        tenant=tenant,
        api_key=api_key,
        model="m",
        source=UsageRecord.Source.BATCH,
        status=UsageRecord.Status.OK,
        started_at=now,
        finished_at=now,
        prompt_tokens=10,
        completion_tokens=4,
    )
    Batch.objects.filter(pk=batch.pk).update(runner="dead", lease_until=now - timedelta(seconds=1))
    return batch


def _end_meanwhile(batch: Batch, ending: str) -> None:
    """The batch's window ends ("expired"), or it is cancelled ("cancelled")."""
    if ending == "expired":
        Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now())
    else:
        batch_services.batch_cancel(batch=batch)


@pytest.mark.parametrize("ending", ["expired", "cancelled"])
def test_a_line_a_dead_runner_metered_gets_its_answer_whatever_the_batch_became(world, ending):
    """It was in flight: it runs to its end again, under the same request id (not charged
    twice), though the batch takes no new line."""
    tenant, api_key, answered = world
    batch = _left_by_a_dead_runner(tenant, api_key, _batch(tenant, api_key))
    _end_meanwhile(batch, ending)

    assert batch_runner.batch_run(batch_id=batch.id) == ending

    batch.refresh_from_db()
    assert answered == ["r0"] and _custom_ids(batch.output_file_id) == ["r0"]
    r0 = result_lines(batch)["r0"]
    assert r0["response"]["request_id"] == "chatcmpl-dead0" and r0["file"] == "output"


def test_a_line_a_dead_runner_metered_runs_first_then_the_rest(world):
    tenant, api_key, answered = world
    batch = _left_by_a_dead_runner(tenant, api_key, _batch(tenant, api_key, n=4))

    assert batch_runner.batch_run(batch_id=batch.id) == "completed"

    batch.refresh_from_db()
    assert answered == ["r0", "r1", "r2", "r3"]
    assert _custom_ids(batch.output_file_id) == ["r0", "r1", "r2", "r3"]
    assert UsageRecord.objects.filter(request_id="chatcmpl-dead0").count() == 1


def test_a_line_whose_run_left_no_record_is_not_run_after_a_cancel(world):
    """Nothing was metered: the cancel stands for it as for every line not yet started."""
    tenant, api_key, answered = world
    batch = batch_services.batch_validate(batch=_batch(tenant, api_key))
    BatchRequest.objects.filter(batch=batch, custom_id="r0").update(
        status=BatchRequest.Status.RUNNING, request_id="chatcmpl-unmetered"
    )
    Batch.objects.filter(pk=batch.pk).update(runner="dead", lease_until=timezone.now())
    batch_services.batch_cancel(batch=batch)

    assert batch_runner.batch_run(batch_id=batch.id) == "cancelled"
    assert answered == []


def test_the_sweep_adds_no_copy_of_a_runner_still_waiting_for_a_worker(world, monkeypatch):
    """While the batch workers were busy, every sweep (each minute) queued one more runner
    for each batch waiting for one."""
    from batches import tasks

    tenant, api_key, _ = world
    queued: list[str] = []
    monkeypatch.setattr(tasks.run_batch, "delay", queued.append)
    batch = _batch(tenant, api_key)  # its task lost: the sweep queues one

    assert tasks.sweep_batches() == [batch.id]
    assert tasks.sweep_batches() == []  # that runner waits for a worker
    Batch.objects.filter(pk=batch.pk).update(queued_at=timezone.now() - timedelta(minutes=11))
    assert tasks.sweep_batches() == [batch.id]  # waited too long: taken for lost

    Batch.objects.filter(pk=batch.pk).update(runner="dead", lease_until=timezone.now())
    batch_services.batch_claim(batch_id=batch.id, runner="r", lease_seconds=0)
    assert tasks.sweep_batches() == [batch.id]  # a runner claimed it and died: at once
    assert queued == [batch.id] * 3


@pytest.mark.parametrize("ending", ["expired", "cancelled"])
def test_a_line_owed_its_answer_is_tried_again_after_a_refusal(
    world, settings, monkeypatch, ending
):
    """Its batch took no new lines: the refused line was unclaimed (cancelled) or answered
    with the refusal (past the window), and the answer paid for was never given."""
    from serving.runs import RunError

    tenant, api_key, answered = world
    settings.BATCH_LEASE_SECONDS = 0.6  # the lease is renewed every 0.2 s: the cancel is seen
    tries = []

    async def refused_once(self, request):
        tries.append(request.custom_id)
        if len(tries) == 1:
            raise RunError("engine_unavailable", "no ready replica", retry_after=0.5)
        answered.append(request.custom_id)
        return _ok(request)

    monkeypatch.setattr(batch_runner.BatchRun, "_answer", refused_once)
    batch = _left_by_a_dead_runner(tenant, api_key, _batch(tenant, api_key))
    _end_meanwhile(batch, ending)

    assert batch_runner.batch_run(batch_id=batch.id) == ending

    batch.refresh_from_db()
    assert tries == ["r0", "r0"] and _custom_ids(batch.output_file_id) == ["r0"]


def test_a_runner_is_marked_queued_before_a_worker_can_claim_it(world):
    """Marked after ``delay`` returned, a runner that a worker had claimed meanwhile (and that
    then died) looked queued for ten minutes: its batch waited that long to be resumed."""
    tenant, api_key, _ = world
    batch = _batch(tenant, api_key)

    def claimed_at_once(batch_id: str) -> None:
        batch_services.batch_claim(batch_id=batch_id, runner="r", lease_seconds=0)

    batch_services.batch_queue_run(batch_id=batch.id, queue=claimed_at_once)
    assert Batch.objects.get(pk=batch.pk).queued_at is None
    assert batches_unattended() == [batch.id]  # its runner's lease is over: resumed at once

    def broker_down(batch_id: str) -> None:
        raise ConnectionError("broker down")

    with pytest.raises(ConnectionError):
        batch_services.batch_queue_run(batch_id=batch.id, queue=broker_down)
    assert Batch.objects.get(pk=batch.pk).queued_at is None  # not queued: the sweep retries


def test_an_owed_line_whose_rerun_failed_after_admission_keeps_its_paid_request_id(
    world, monkeypatch
):
    """The rerun of a line a dead runner had metered whole was admitted and then lost (its
    record dropped as a second record of the paid id): the next try ran under a new id,
    metered again, so the tenant paid twice for one answer."""
    from serving.runs import RunError

    tenant, api_key, answered = world
    tries: list[str] = []

    async def lost_once_after_admission(self, request):
        tries.append(request.request_id)
        if len(tries) == 1:
            lost = RunError("engine_unavailable", "lost", retry_after=0)
            lost.request_id = request.request_id  # admitted: the run's record was written
            raise lost
        answered.append(request.custom_id)
        return _ok(request)

    monkeypatch.setattr(batch_runner.BatchRun, "_answer", lost_once_after_admission)
    batch = _left_by_a_dead_runner(tenant, api_key, _batch(tenant, api_key, n=1))

    assert batch_runner.batch_run(batch_id=batch.id) == "completed"

    assert tries == ["chatcmpl-dead0", "chatcmpl-dead0"]
    r0 = result_lines(batch)["r0"]
    assert r0["response"]["request_id"] == "chatcmpl-dead0" and r0["file"] == "output"


def test_a_line_that_fails_the_platform_is_a_500_and_the_rest_of_the_batch_runs(world, monkeypatch):
    """A failure of the platform's own with one line (not the database's or the cache's)
    ended the pass: the next pass met it again, and the batch ran, and billed, its lines in
    flight anew on every pass until it expired."""
    tenant, api_key, answered = world

    async def fails_on_r1(self, request):
        if request.custom_id == "r1":
            raise KeyError("a bug with this line")
        answered.append(request.custom_id)
        return _ok(request)

    monkeypatch.setattr(batch_runner.BatchRun, "_answer", fails_on_r1)
    batch = _batch(tenant, api_key, n=3)

    assert batch_runner.batch_run(batch_id=batch.id) == "completed"

    r1 = result_lines(batch)["r1"]
    assert r1["file"] == "error"
    response = r1["response"]
    assert response["status_code"] == 500
    assert response["body"]["error"]["code"] == "server_error"
    assert sorted(answered) == ["r0", "r2"]


def test_lines_refused_for_a_while_as_the_window_ends_expire_unrun(world, monkeypatch):
    """A line refused for a while (a rate limit, no ready replica) that its window leaves no
    time to try again was answered with that moment's 429 or 503, and the batch completed
    with every line failed; OpenAI reports such lines batch_expired."""
    from serving.runs import RunError

    tenant, api_key, answered = world

    async def busy(self, request):
        raise RunError("rate_limit_exceeded", "busy", retry_after=10)

    monkeypatch.setattr(batch_runner.BatchRun, "_answer", busy)
    batch = _batch(tenant, api_key, n=2)
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() + timedelta(seconds=2))

    assert batch_runner.batch_run(batch_id=batch.id) == "in_progress"  # within its window
    assert not BatchRequest.objects.filter(batch=batch, status="failed").exists()
    time.sleep(2.5)
    assert batch_runner.batch_run(batch_id=batch.id) == "expired"

    batch.refresh_from_db()
    with file_storage().open(batch.error_file.storage_name, "rb") as stream:
        errors = [json.loads(line) for line in stream.read().splitlines()]
    assert [e["error"]["code"] for e in errors] == ["batch_expired", "batch_expired"]
    assert batch.output_file_id is None


def test_an_owed_lines_tries_in_one_pass_run_under_engine_ids_of_their_own(world, monkeypatch):
    """An owed line keeps its paid request id across tries; its engine requests did too, and
    the engine refused the next try's while the last one still ran there ("already in
    use"), which is no refusal that passes: the line got a wrong final answer."""
    from gateway.errors import ApiError
    from serving.runs import RunError
    from serving.services import deployment_register
    from tests.batches.conftest import MODEL_NAME

    tenant, api_key, answered = world
    deployment_register(name=MODEL_NAME, endpoints=["ipc:///tmp/nobody-here.sock"])
    engine_ids: list[list[str]] = []

    class RecordingRun:
        def __init__(self, spec, caller) -> None:
            self.spec = spec
            engine_ids.append([request.request_id for request in spec.requests])

        async def start(self) -> None:
            if len(engine_ids) == 1:  # admitted, then the engine was lost
                lost = RunError("engine_unavailable", "lost", retry_after=0)
                lost.request_id = self.spec.request_id
                raise lost
            raise ApiError(400, "enough")  # the second try ends the line

    monkeypatch.setattr(batch_runner.BatchRun, "_answer", ANSWER)
    monkeypatch.setattr(batch_runner, "Run", RecordingRun)
    batch = _left_by_a_dead_runner(tenant, api_key, _batch(tenant, api_key, n=1))

    batch_runner.batch_run(batch_id=batch.id)

    assert engine_ids == [["chatcmpl-dead0-0"], ["chatcmpl-dead0-0.1"]]


def test_a_runner_whose_lease_ran_out_while_it_validated_leaves_the_batch_to_its_new_runner(
    world, monkeypatch
):
    """Validating a large file can outlast the lease: the sweep's runner took the batch and
    started its lines, and the first, resuming, made them pending again, so both ran them."""
    tenant, api_key, answered = world
    batch = _batch(tenant, api_key)
    validate = batch_services.batch_validate

    def validate_slowly(*, batch):
        validated = validate(batch=batch)  # meanwhile another runner took the lapsed lease
        Batch.objects.filter(pk=batch.pk).update(
            runner="other", lease_until=timezone.now() + timedelta(seconds=60)
        )
        BatchRequest.objects.filter(batch=batch, custom_id="r0").update(
            status=BatchRequest.Status.RUNNING, request_id="chatcmpl-other0"
        )
        return validated

    monkeypatch.setattr(batch_services, "batch_validate", validate_slowly)

    assert batch_runner.batch_run(batch_id=batch.id) == "held"

    assert answered == []
    r0 = BatchRequest.objects.get(batch=batch, custom_id="r0")
    assert (r0.status, r0.request_id) == (BatchRequest.Status.RUNNING, "chatcmpl-other0")
    assert Batch.objects.get(pk=batch.pk).runner == "other"
