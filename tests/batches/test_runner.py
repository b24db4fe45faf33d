"""Batches run end to end: uploaded and created with the official openai SDK against a live
Daphne and engine, run by the Celery task in this process (on the live platform's files), read
back with the SDK."""

import json
from datetime import timedelta
from decimal import Decimal

import httpx
import openai
import pytest
from django.utils import timezone

from batches import services
from batches.models import Batch, BatchRequest
from batches.runner import ENDPOINT_PLANS
from batches.tasks import run_batch, sweep_batches
from config import celery_app
from inference_engine.client import EngineUnavailable
from serving import runs
from tenants.models import UsageRecord
from tests.batches.conftest import jsonl, request_line
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db(transaction=True)


class WorkerDied(BaseException):
    """What a killed worker leaves: nothing after the line it was on."""


@pytest.fixture
def eager():
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = False


def _create(client: openai.OpenAI, lines: list[dict], endpoint: str = "/v1/chat/completions"):
    file = client.files.create(
        file=("requests.jsonl", jsonl(lines), "application/jsonl"), purpose="batch"
    )
    return client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")


def _lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _batch_records(platform) -> list[UsageRecord]:
    return [r for r in platform.records() if r.source == UsageRecord.Source.BATCH]


def _online(platform, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(
        f"{platform.base}{path}",
        json=body,
        headers={"Authorization": f"Bearer {platform.key}"},
        timeout=60,
    )


def _same_answer(batch_body: dict, online_body: dict) -> bool:
    """Equal but for the response's own id and time (and the prefix cache's hits)."""

    def answer(body: dict) -> dict:
        usage = body["usage"]
        return {
            **{k: v for k, v in body.items() if k not in ("id", "created", "usage")},
            "tokens": (usage["prompt_tokens"], usage["completion_tokens"]),
        }

    return answer(batch_body) == answer(online_body)


def _die_after(monkeypatch, num_lines: int) -> None:
    """Make the runner die as it takes line ``num_lines + 1`` (one line in flight)."""
    claim = services.batch_request_claim
    claims = []

    def claim_or_die(**kwargs) -> bool:
        if len(claims) == num_lines:
            raise WorkerDied
        claims.append(kwargs["request_id"])
        return claim(**kwargs)

    monkeypatch.setattr(services, "batch_request_claim", claim_or_die)


def test_a_batch_runs_every_line_once_as_the_online_api_answers_it(platform, shared_files):
    client = platform.client()
    lines = [request_line(f"req-{n}") for n in range(50)]
    created = _create(client, lines)

    assert run_batch(created.id) == "completed"

    batch = client.batches.retrieve(created.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed) == (50, 50)
    assert batch.request_counts.failed == 0 and batch.error_file_id is None
    assert batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    output = _lines_of(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{n}" for n in range(50))
    for line in output:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200
        assert response["request_id"] == response["body"]["id"]
        online = _online(platform, request_line(line["custom_id"])["body"])
        assert _same_answer(response["body"], online.json())
    records = _batch_records(platform)
    assert sorted(r.request_id for r in records) == sorted(
        line["response"]["request_id"] for line in output
    )
    assert {r.status for r in records} == {UsageRecord.Status.OK}
    # billed at the plan's factor as each line ran (the plan the runner loaded with the tenant)
    assert {r.billed_tokens / r.total_tokens for r in records} == {Decimal("0.5")}


def test_a_line_the_api_would_refuse_is_answered_with_its_error(platform, shared_files):
    client = platform.client()
    bad_body = {**request_line("x")["body"], "max_tokens": "many"}
    unknown_model = {**request_line("x")["body"], "model": "no-such-model"}
    # tools the tiny model may call at will, whose calls no format of the API reads
    auto_tools = {
        **request_line("x")["body"],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    }
    lines = [
        request_line("good"),
        request_line("bad-body", body=bad_body),
        request_line("auto-tools", body=auto_tools),
    ]

    assert run_batch(_create(client, lines).id) == "completed"
    # a batch calls one model (as OpenAI's): one for a model nobody serves is answered 404
    assert run_batch(_create(client, [request_line("unknown-model", body=unknown_model)]).id) == (
        "completed"
    )

    unknown, batch = client.batches.list().data[:2]
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)
    assert (unknown.request_counts.completed, unknown.request_counts.failed) == (0, 1)
    assert [line["custom_id"] for line in _lines_of(client, batch.output_file_id)] == ["good"]
    errors = {
        line["custom_id"]: line
        for file_id in (batch.error_file_id, unknown.error_file_id)
        for line in _lines_of(client, file_id)
    }
    cases = (("bad-body", bad_body), ("unknown-model", unknown_model), ("auto-tools", auto_tools))
    for custom_id, body in cases:
        online = _online(platform, body)
        response = errors[custom_id]["response"]
        assert (response["status_code"], response["body"]) == (online.status_code, online.json())
        assert errors[custom_id]["error"] is None
    assert len(_batch_records(platform)) == 1  # the refused lines were never admitted


def test_a_completions_batch_answers_as_v1_completions(platform, shared_files):
    client = platform.client()
    body = {
        "model": request_line("x")["body"]["model"],
        "prompt": "Once",
        "max_tokens": 3,
        "temperature": 0,
    }
    lines = [request_line("c", url="/v1/completions", body=body)]

    assert run_batch(_create(client, lines, endpoint="/v1/completions").id) == "completed"

    [line] = _lines_of(client, client.batches.list().data[0].output_file_id)
    assert line["response"]["body"]["object"] == "text_completion"
    assert _same_answer(line["response"]["body"], _online(platform, body, "/v1/completions").json())


def test_a_completions_line_without_max_tokens_gets_the_apis_default_of_16():
    """A line is parsed as the online API parses its body, defaults included."""
    kind, plan_of = ENDPOINT_PLANS["/v1/completions"]
    plan = plan_of(json.dumps({"model": "m", "prompt": "Once"}).encode())
    assert kind == "completion"
    assert [request.params.max_tokens for request in plan.engine_requests("r")] == [16]


def test_a_batch_cancelled_mid_way_finishes_what_is_in_flight_and_ends_cancelled(
    platform, shared_files, monkeypatch, settings
):
    settings.BATCH_MAX_IN_FLIGHT = 2
    client = platform.client()
    created = _create(client, [request_line(f"req-{n}") for n in range(50)])
    finish = services.batch_request_finish
    finished = []

    def finish_and_cancel_the_fifth(**kwargs) -> None:
        finish(**kwargs)
        finished.append(kwargs["request"].custom_id)
        if len(finished) == 5:
            assert client.batches.cancel(created.id).status == "cancelling"

    monkeypatch.setattr(services, "batch_request_finish", finish_and_cancel_the_fifth)

    assert run_batch(created.id) == "cancelled"

    batch = client.batches.retrieve(created.id)
    assert batch.status == "cancelled" and batch.cancelled_at >= batch.cancelling_at
    # what was claimed before the cancel was committed runs to its end: the line in flight
    # at the fifth finish, and lines claimed while the cancel request itself was under way
    # (the fifth's finish waits for it on a worker thread; the other runs on); nothing after
    assert 5 <= batch.request_counts.completed <= 5 + 2 * settings.BATCH_MAX_IN_FLIGHT
    output = _lines_of(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(finished)
    assert len(_batch_records(platform)) == len(finished)
    assert not BatchRequest.objects.filter(status=BatchRequest.Status.RUNNING).exists()


def test_a_batch_cancelled_before_it_ran_ends_cancelled_with_nothing_run(platform, shared_files):
    client = platform.client()
    created = _create(client, [request_line("a"), request_line("b")])
    assert client.batches.cancel(created.id).status == "cancelled"  # no worker held it

    assert run_batch(created.id) == "held"  # its runner finds it ended

    batch = client.batches.retrieve(created.id)
    assert batch.output_file_id is None and batch.request_counts.completed == 0
    assert _batch_records(platform) == []


def test_a_batch_whose_worker_died_is_resumed_and_runs_every_line_once(
    platform, shared_files, monkeypatch, settings, eager
):
    settings.BATCH_MAX_IN_FLIGHT = 1
    client = platform.client()
    created = _create(client, [request_line(f"req-{n}") for n in range(50)])
    with monkeypatch.context() as patched:
        _die_after(patched, 10)
        with pytest.raises(WorkerDied):
            run_batch(created.id)
    # As a worker killed mid-line leaves it: its lease not given back, lines still running,
    # one of them with its usage record written but not its result.
    # Another was cancelled as its pass failed: its record stands for what it had used, and
    # its next run is an attempt of its own, metered under an id of its own.
    left_running = list(
        BatchRequest.objects.filter(status=BatchRequest.Status.PENDING).order_by("line_number")[:4]
    )
    for n, request in enumerate(left_running):
        request.status, request.request_id = BatchRequest.Status.RUNNING, f"chatcmpl-dead{n}"
        request.save(update_fields=["status", "request_id"])
    now = timezone.now()
    for request_id, status, completion_tokens in (
        ("chatcmpl-dead0", UsageRecord.Status.OK, 4),
        ("chatcmpl-dead3", UsageRecord.Status.CANCELLED, 2),
    ):
        usage_record_add(
            request_id=request_id,
            tenant=platform.tenant,
            api_key=Batch.objects.get(pk=created.id).api_key,
            model="tiny-llama",
            source=UsageRecord.Source.BATCH,
            status=status,
            started_at=now,
            finished_at=now,
            prompt_tokens=10,
            completion_tokens=completion_tokens,
        )
    Batch.objects.filter(pk=created.id).update(runner="dead", lease_until=now)
    assert client.batches.retrieve(created.id).request_counts.completed == 10

    assert sweep_batches() == [created.id]  # the lease ran out: started again

    batch = client.batches.retrieve(created.id)
    assert batch.status == "completed" and batch.request_counts.completed == 50
    output = _lines_of(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{n}" for n in range(50))
    request_ids = [line["response"]["request_id"] for line in output]
    assert {f"chatcmpl-dead{n}" for n in range(3)} <= set(request_ids)
    assert "chatcmpl-dead3" not in request_ids
    assert sorted(r.request_id for r in _batch_records(platform)) == sorted(
        [*request_ids, "chatcmpl-dead3"]
    )
    assert sweep_batches() == []


def test_a_line_tried_again_after_its_admitted_run_failed_is_metered_for_each_try(
    platform, shared_files, monkeypatch, settings, eager
):
    """The engine was lost under the line's first run (admitted, metered as an error): its
    second try ran under the same request id, and its record (the answer's) was dropped as
    a second record of that id."""
    settings.BATCH_MAX_IN_FLIGHT = 1
    monkeypatch.setattr(runs, "NO_REPLICA_RETRY_AFTER_SECONDS", 0)
    first_deltas, failed = runs.Run._first_deltas, []

    async def lost_once(self):
        if not failed:
            failed.append(self.spec.request_id)
            raise EngineUnavailable("the engine went away")
        return await first_deltas(self)

    monkeypatch.setattr(runs.Run, "_first_deltas", lost_once)
    client = platform.client()
    created = _create(client, [request_line("a"), request_line("b")])

    run_batch(created.id)

    batch = client.batches.retrieve(created.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2
    answered = {line["response"]["request_id"] for line in _lines_of(client, batch.output_file_id)}
    records = {r.request_id: (r.status, r.error_code) for r in _batch_records(platform)}
    assert records == {
        failed[0]: ("error", "engine_unavailable"),
        **{request_id: ("ok", "") for request_id in answered},
    }
    assert failed[0] not in answered


def test_a_batch_past_its_window_expires_with_what_finished(
    platform, shared_files, monkeypatch, settings, eager
):
    settings.BATCH_MAX_IN_FLIGHT = 1
    client = platform.client()
    created = _create(client, [request_line("a"), request_line("b"), request_line("c")])
    with monkeypatch.context() as patched:
        _die_after(patched, 1)
        with pytest.raises(WorkerDied):
            run_batch(created.id)
    Batch.objects.filter(pk=created.id).update(expires_at=timezone.now())

    assert sweep_batches() == [created.id]

    batch = client.batches.retrieve(created.id)
    assert batch.status == "expired" and batch.expired_at is not None
    assert [line["custom_id"] for line in _lines_of(client, batch.output_file_id)] == ["a"]
    errors = _lines_of(client, batch.error_file_id)
    assert [(line["custom_id"], line["error"]["code"]) for line in errors] == [
        ("b", "batch_expired"),
        ("c", "batch_expired"),
    ]
    assert len(_batch_records(platform)) == 1


def test_another_runner_leaves_a_held_batch_alone(platform, shared_files):
    created = _create(platform.client(), [request_line("a")])
    Batch.objects.filter(pk=created.id).update(
        runner="alive", lease_until=timezone.now() + timedelta(minutes=1)
    )

    assert run_batch(created.id) == "held"
    assert sweep_batches() == []
    assert Batch.objects.get(pk=created.id).status == Batch.Status.VALIDATING


def test_a_lines_refusals_tried_again_are_not_counted_only_its_last(
    platform, shared_files, monkeypatch, settings
):
    """A line waiting out "no ready replica" was counted as a refusal at every try (every
    5 s, for hours), and the tenant's batch refusal rate read as if nearly all failed. A
    refusal tried again is no refusal; one that ends the line is, once."""
    from tenants.models import RefusalCount

    settings.BATCH_MAX_IN_FLIGHT = 1
    monkeypatch.setattr(runs, "NO_REPLICA_RETRY_AFTER_SECONDS", 0)
    route, refused = runs.Run._route, []

    async def no_replica_three_times(self):
        if len(refused) < 3:
            refused.append(self.spec.request_id)
            raise runs.RunError("engine_unavailable", "no ready replica", retry_after=0)
        return await route(self)

    monkeypatch.setattr(runs.Run, "_route", no_replica_three_times)
    client = platform.client()
    too_long = request_line("long")
    too_long["body"]["max_tokens"] = 10**6  # past the context: refused for good, a 400
    created = _create(client, [request_line("a"), too_long])

    assert run_batch(created.id) == "completed"

    assert len(refused) == 3
    counts = RefusalCount.objects.filter(tenant=platform.tenant, source="batch")
    assert sorted((row.code, row.count) for row in counts) == [("context_length_exceeded", 1)]


def test_a_line_that_asks_to_stream_is_refused_by_name(platform, shared_files):
    """A batch answers each line whole: a line with ``stream: true`` was run as if it had not
    asked, and billed."""
    client = platform.client()
    streaming = request_line("stream")
    streaming["body"]["stream"] = True
    created = _create(client, [request_line("a"), streaming])

    assert run_batch(created.id) == "completed"

    batch = client.batches.retrieve(created.id)
    responses = {
        line["custom_id"]: line["response"]
        for file_id in (batch.output_file_id, batch.error_file_id)
        for line in _lines_of(client, file_id)
    }
    assert responses["a"]["status_code"] == 200
    refusal = responses["stream"]
    assert refusal["status_code"] == 400 and refusal["body"]["error"]["param"] == "stream"
    assert sorted(r.request_id for r in _batch_records(platform)) == [responses["a"]["request_id"]]
