"""The reliability suite: the whole platform as a user runs it (`manage.py runplatform` on
PostgreSQL and Redis, three Daphne processes, an engine on a tiny model, Celery), put through
faults and hostile input, with one row per check and PASS or FAIL.

    .venv/bin/python bench/reliability.py [--quick] [--parts 1,2,5] [--deadline SECONDS]

1. load with faults: streaming and non-streaming requests from 4 tenants at 64 concurrent,
   30% cut by the client at a random moment: one usage record per admitted request, its
   tokens the engine's, cut requests metered as cancelled, no slot left held, no 5xx.
2. exact admission across processes: 200 requests in one burst against 20 per minute,
   spread over 3 Daphne processes sharing Redis: exactly 20 admitted, 180 refused with 429.
3. engine `kill -9` mid-stream: every open stream ends with an `engine_unavailable` error
   event within 2 s, slots released, records written; the restarted engine serves again.
   (Parts 3 and 4 run last: they break what the others need.)
4. web process `kill -9` with streams open: the engine's running requests return to 0 and
   no concurrency slot stays held after the restart (within the slot lease, 90 s).
5. schema fuzzing: schemathesis on /v1/openapi.json (every operation, positive and
   negative cases), then hostile bodies of our own (bench/probes.py): no 5xx, no dropped
   connection, OpenAI's error object on every 4xx, and a normal request served afterwards.
6. WebSocket fuzzing: malformed frames on the chat socket (bench/ws_probes.py), each refused
   with an error frame or a close with a code, no crash, and a normal reply afterwards.
7. tenant isolation: tenant A's key, owner, admin and member against tenant B's
   conversations, usage, keys, members and deployments, through the API, the console and
   the chat: every attempt denied and nothing of B's changed.

Loopback only. It creates (and drops first) its own database (`llm_platform_reliability` on
the server of DATABASE_URL, default postgres://postgres:postgres@127.0.0.1:5432) and flushes
its own Redis database (/15 on the server of REDIS_URL, default redis://127.0.0.1:6379).
Every part runs under its own time limit and the whole run under a global deadline; what it
started is stopped by pid at the end, whatever happens. Exit code: 0 when every check
passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime as dt
import json
import os
import platform as host_platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from inspect import signature
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]

from bench import probes, ws_probes  # noqa: E402

PYTHON = sys.executable
MODEL_NAME = "tiny"
SECRET_MODEL = "secret-b"  # a deployment only tenant B's plan allows
DB_NAME = "llm_platform_reliability"
REDIS_DB = 15
MAX_MODEL_LEN = 4096
LONG_TOKENS = 4000  # a stream that is still running when a process is killed
SEED = 20240601
REQUEST_TIMEOUT = 120.0

# --- results --------------------------------------------------------------------------------


@dataclass
class Row:
    part: str
    check: str
    figures: str
    ok: bool | None  # None: not run (skipped or stopped early)


ROWS: list[Row] = []


def row(part: str, check: str, figures: str, ok: bool | None) -> None:
    ROWS.append(Row(part, check, figures, ok))
    verdict = {True: "PASS", False: "FAIL", None: "----"}[ok]
    print(f"  [{verdict}] {part} {check}: {figures}", flush=True)


def table() -> str:
    lines = [
        "| part | check | measured | result |",
        "|---|---|---|---|",
    ]
    for r in sorted(ROWS, key=lambda r: r.part):
        verdict = {True: "PASS", False: "**FAIL**", None: "not run"}[r.ok]
        lines.append(f"| {r.part} | {r.check} | {r.figures} | {verdict} |")
    return "\n".join(lines)


class PartTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise ``PartTimeout`` in the main thread after ``seconds`` (a blocked socket read or
    an event loop's select is interrupted too)."""

    def expire(signum, frame):
        raise PartTimeout(f"over its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- environment ----------------------------------------------------------------------------


def own_urls() -> tuple[str, str]:
    """This suite's database and Redis URLs: the servers of DATABASE_URL and REDIS_URL (or
    the local defaults), with its own database name and Redis database number."""
    database = urllib.parse.urlsplit(
        os.environ.get("DATABASE_URL") or "postgres://postgres:postgres@127.0.0.1:5432/x"
    )
    redis = urllib.parse.urlsplit(os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0")
    return (
        urllib.parse.urlunsplit(database._replace(path=f"/{DB_NAME}")),
        urllib.parse.urlunsplit(redis._replace(path=f"/{REDIS_DB}")),
    )


def create_database(database_url: str) -> None:
    import psycopg

    parts = urllib.parse.urlsplit(database_url)
    admin = urllib.parse.urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')
        connection.execute(f'CREATE DATABASE "{DB_NAME}"')


def flush_redis(redis_url: str) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()


def build_model(path: Path) -> None:
    """The test suite's tiny random Llama (it never emits EOS by chance: ``ignore_eos`` makes
    every count exact), with a context long enough for streams that outlive a kill."""
    code = (
        "import sys; from tests.inference_engine.conftest import save_model; "
        f"save_model(sys.argv[1], 'llama', max_position_embeddings={MAX_MODEL_LEN})"
    )
    subprocess.run(
        [PYTHON, "-c", code, str(path)],
        cwd=ROOT,
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the platform ---------------------------------------------------------------------------


class Platform:
    """`manage.py runplatform` in a process of its own, logging to ``VAR_DIR/platform.log``."""

    def __init__(self, var_dir: Path, env: dict[str, str], port: int) -> None:
        self.var_dir, self.env, self.port = var_dir, env, port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = var_dir / "platform.log"
        self.process: subprocess.Popen | None = None
        self.endpoint = f"ipc://{var_dir / 'engine.sock'}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [PYTHON, "manage.py", "runplatform", "--port", str(self.port), "--no-demo"],
            cwd=ROOT,
            env=self.env,
            stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float) -> float:
        """Seconds until /health/ready answers 200."""
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"runplatform exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base}/health/ready", timeout=5) as answer:
                    if answer.status == 200:
                        return time.monotonic() - began
            except (OSError, urllib.error.HTTPError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.base}/health/ready not ready after {timeout:.0f} s")

    def warm(self, key: str, timeout: float = 90) -> None:
        """Until 12 requests in a row succeed: each Daphne process finds the engine ready
        on its own (a fresh one refuses with 503 until its pool has heard from it)."""
        body = generation_body(probes.COMPLETIONS_PATH, 1, False)

        async def streak() -> bool:
            for _ in range(12):
                answer = await probes.post_json(
                    self.base, probes.COMPLETIONS_PATH, key, body, timeout=30
                )
                if answer.status != 200:
                    return False
            return True

        if wait_for(lambda: asyncio.run(streak()), timeout) is None:
            raise RuntimeError(f"the platform did not serve 12 requests in a row in {timeout} s")

    def status(self) -> dict:
        try:
            return json.loads((self.var_dir / "supervisor.json").read_text())
        except (OSError, ValueError):
            return {}

    def pid_of(self, name: str) -> int | None:
        return (self.status().get(name) or {}).get("pid")

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_since(self, offset: int) -> str:
        with self.log_path.open("rb") as log_file:
            log_file.seek(offset)
            return log_file.read().decode("utf-8", "replace")

    def descendants(self) -> list[int]:
        if self.process is None:
            return []
        parents: dict[int, int] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        found, frontier = [], [self.process.pid]
        while frontier:
            parent = frontier.pop()
            children = [pid for pid, ppid in parents.items() if ppid == parent]
            found += children
            frontier += children
        return found

    def stop(self) -> None:
        if self.process is None:
            return
        children = self.descendants()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in children + self.descendants():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def server_errors_in(log_text: str) -> list[str]:
    """Lines of a platform log that show a server error: a 5xx in Daphne's access log, an
    unhandled exception, a traceback."""
    pattern = re.compile(
        r'"\s(5\d\d)\s|Internal Server Error|Traceback \(most recent|Exception inside application'
    )
    return [line for line in log_text.splitlines() if pattern.search(line)]


# --- the world: plans, tenants, keys, users ---------------------------------------------------


@dataclass
class World:
    load_keys: list[tuple[str, str]]  # (tenant slug, raw key) of the 4 load tenants
    burst_key: str
    fault_key: str
    webkill_key: str
    fuzz_key: str
    tenant_ids: dict[str, int]
    users: dict[str, int]  # username -> id
    # tenant B's objects (tenant A: load-1, tenant B: load-2)
    b_key_id: int = 0
    b_key_raw: str = ""
    b_membership_id: int = 0
    b_conversation_id: int = 0
    b_message_id: int = 0
    secret_deployment_id: int = 0
    a_key_raw: str = ""
    a_conversation_id: int = 0


def create_world(endpoint: str) -> World:
    from django.contrib.auth import get_user_model

    from chat import services as chat_services
    from serving.services import deployment_register
    from tenants import services
    from tenants.models import Membership, Plan

    deployment_register(name=MODEL_NAME, endpoints=[endpoint])
    secret = deployment_register(name=SECRET_MODEL, endpoints=[endpoint])
    # a concurrency limit far above the load, so that every admitted request holds a slot
    # (without a limit nothing is counted) and none is refused for it
    roomy = {"max_concurrent_requests": 10_000, "tokens_per_minute": 10**9}
    plan_a = Plan.objects.create(slug="load", name="Load", allowed_models=[MODEL_NAME], **roomy)
    plan_b = Plan.objects.create(
        slug="load-b", name="Load B", allowed_models=[MODEL_NAME, SECRET_MODEL], **roomy
    )
    burst_plan = Plan.objects.create(
        slug="burst", name="Burst", requests_per_minute=20, allowed_models=[MODEL_NAME]
    )
    tenants, keys = {}, {}
    for slug, plan in (
        ("load-1", plan_a),
        ("load-2", plan_b),
        ("load-3", plan_a),
        ("load-4", plan_a),
        ("burst", burst_plan),
        ("faults", plan_a),
        ("webkill", plan_a),
        ("fuzz", plan_a),
    ):
        tenants[slug] = services.tenant_create(slug=slug, plan=plan)
        keys[slug] = services.api_key_create(tenant=tenants[slug], name=f"{slug}-key")
    users = {}
    user_model = get_user_model()
    # set up by the platform itself, not by a person (the audited services take an actor)
    no_actor = {"actor": None} if "actor" in signature(services.membership_set).parameters else {}
    for username, slug, role in (
        ("a-owner", "load-1", Membership.Role.OWNER),
        ("a-admin", "load-1", Membership.Role.ADMIN),
        ("a-member", "load-1", Membership.Role.MEMBER),
        ("b-owner", "load-2", Membership.Role.OWNER),
        ("ws-user", "fuzz", Membership.Role.MEMBER),
    ):
        user = user_model.objects.create_user(username, password=f"{username}-password-1")
        services.membership_set(tenant=tenants[slug], user=user, role=role, **no_actor)
        users[username] = user.pk
    b_owner = user_model.objects.get(pk=users["b-owner"])
    conversation = chat_services.conversation_create(
        user=b_owner, tenant=tenants["load-2"], model=MODEL_NAME, title="B's secret plans"
    )
    message = chat_services.message_send(conversation=conversation, content="B only")
    a_owner = user_model.objects.get(pk=users["a-owner"])
    own = chat_services.conversation_create(
        user=a_owner, tenant=tenants["load-1"], model=MODEL_NAME
    )
    return World(
        load_keys=[(slug, keys[slug][1]) for slug in ("load-1", "load-2", "load-3", "load-4")],
        burst_key=keys["burst"][1],
        fault_key=keys["faults"][1],
        webkill_key=keys["webkill"][1],
        fuzz_key=keys["fuzz"][1],
        tenant_ids={slug: tenant.pk for slug, tenant in tenants.items()},
        users=users,
        b_key_id=keys["load-2"][0].pk,
        b_key_raw=keys["load-2"][1],
        b_membership_id=Membership.objects.get(user=b_owner, tenant=tenants["load-2"]).pk,
        b_conversation_id=conversation.pk,
        b_message_id=message.pk,
        secret_deployment_id=secret.pk,
        a_key_raw=keys["load-1"][1],
        a_conversation_id=own.pk,
    )


def concurrent_slots(slug: str) -> int:
    from tenants.models import Tenant
    from tenants.quotas import quota_usage

    return quota_usage(tenant=Tenant.objects.get(slug=slug)).concurrent_requests


def wait_for(predicate: Callable[[], bool], timeout: float, step: float = 0.5) -> float | None:
    """Seconds until ``predicate()`` held, None if it never did within ``timeout``."""
    began = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - began
        if time.monotonic() - began > timeout:
            return None
        time.sleep(step)


def engine_stats(endpoint: str):
    from inference_engine.client import AsyncEngineClient

    async def ask():
        client = AsyncEngineClient(endpoint)
        try:
            return await client.stats(timeout=5)
        finally:
            client.close()

    return asyncio.run(ask())


def session_cookie(username: str, **session: object) -> str:
    """A logged-in session for ``username`` (Django's test client writes it to the
    database), with extra session values, as a Cookie header value."""
    from django.contrib.auth import get_user_model
    from django.contrib.sessions.backends.db import SessionStore
    from django.test import Client

    client = Client()
    client.force_login(get_user_model().objects.get(username=username))
    key = client.cookies["sessionid"].value
    if session:
        store = SessionStore(session_key=key)
        store.update(session)
        store.save()
    return f"sessionid={key}"


# --- one streamed or whole request, cut or not -----------------------------------------------


@dataclass
class Outcome:
    tenant: str
    path: str
    stream: bool
    max_tokens: int
    cut_after: float | None
    status: int | None = None
    request_id: str | None = None
    usage: dict | None = None
    finished: bool = False  # the whole response arrived ([DONE], or the whole JSON body)
    is_cut: bool = False  # the client closed the connection before it was finished
    dropped: str = ""  # the server ended it early (not our cut)
    error_codes: list[str] = field(default_factory=list)  # error events inside a stream
    num_token_events: int = 0
    client_port: int = 0
    started: float = 0.0
    first_token_at: float | None = None
    ended: float = 0.0


def generation_body(path: str, max_tokens: int, stream: bool, temperature: float = 0.0) -> bytes:
    body: dict = {
        "model": MODEL_NAME,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": temperature,
    }
    if path == probes.CHAT_PATH:
        body["messages"] = [{"role": "user", "content": "one two three four"}]
    else:
        body["prompt"] = "the quick brown fox"
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return json.dumps(body).encode()


async def generate(
    base: str,
    key: str,
    outcome: Outcome,
    *,
    body: bytes | None = None,
    on_token: Callable[[Outcome], None] | None = None,
    stop: asyncio.Event | None = None,
) -> Outcome:
    """Run one request on its own connection (Connection: close, so the kernel may hand it
    to any Daphne process), cutting it after ``outcome.cut_after`` seconds or once ``stop``
    is set."""
    host, port = probes.split_base(base)
    body = body or generation_body(outcome.path, outcome.max_tokens, outcome.stream)
    head = probes.request_head(
        "POST",
        outcome.path,
        f"{host}:{port}",
        {
            "Authorization": f"Bearer {key}",
            "Content-Type": "application/json",
            "Content-Length": str(len(body)),
            "Connection": "close",
        },
    )
    outcome.started = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        outcome.dropped = f"connect: {exc!r}"
        outcome.ended = time.monotonic()
        return outcome
    outcome.client_port = writer.get_extra_info("sockname")[1]
    writer.write(head + body)

    async def consume() -> None:
        outcome.status, headers = await probes.read_head(reader)
        outcome.request_id = headers.get("x-request-id")
        pieces = []
        pending = b""
        async for piece in probes.iter_body(reader, headers):
            pieces.append(piece)
            if not outcome.stream or outcome.status != 200:
                continue
            pending += piece
            *events, pending = pending.split(b"\n\n")
            for event in events:
                _on_event(outcome, event, on_token)
        if outcome.stream and outcome.status == 200:
            outcome.finished = outcome.finished and not outcome.error_codes
        else:
            text = b"".join(pieces)
            if outcome.status == 200:
                outcome.usage = json.loads(text)["usage"]
                outcome.finished = True
            else:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    outcome.error_codes.append(json.loads(text)["error"]["code"])

    task = asyncio.ensure_future(consume())
    waiters = {task}
    if stop is not None:
        waiters.add(asyncio.ensure_future(stop.wait()))
    timeout = outcome.cut_after if outcome.cut_after is not None else REQUEST_TIMEOUT
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            if outcome.cut_after is not None or (stop is not None and stop.is_set()):
                outcome.is_cut = True
            else:
                outcome.dropped = "timeout"
        else:
            exc = task.exception()
            if isinstance(exc, asyncio.IncompleteReadError | ConnectionError):
                outcome.dropped = type(exc).__name__
            elif exc is not None:
                outcome.dropped = repr(exc)
    finally:
        for waiter in waiters:
            waiter.cancel()
        with contextlib.suppress(BaseException):
            await task
        writer.transport.abort()  # a cut is a reset, as a killed client's would be
        outcome.ended = time.monotonic()
    return outcome


def _on_event(outcome: Outcome, event: bytes, on_token) -> None:
    if not event.startswith(b"data: "):
        return
    data = event[6:]
    if data == b"[DONE]":
        outcome.finished = True
        return
    payload = json.loads(data)
    if "error" in payload:
        outcome.error_codes.append(payload["error"].get("code") or "")
        return
    if payload.get("usage"):
        outcome.usage = payload["usage"]
    for choice in payload.get("choices", []):
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            outcome.num_token_events += 1
            if outcome.first_token_at is None:
                outcome.first_token_at = time.monotonic()
                if on_token is not None:
                    on_token(outcome)


# --- 1. load with faults --------------------------------------------------------------------


def part_load(plat: Platform, world: World, quick: bool) -> None:
    from tenants.models import UsageRecord

    total = 300 if quick else 2000
    concurrency, cut_share = 64, 0.3
    rng = random.Random(SEED)
    engine_before = engine_stats(plat.endpoint)
    offset = plat.log_size()
    specs = []
    for i in range(total):
        slug, key = world.load_keys[i % 4]
        outcome = Outcome(
            tenant=slug,
            path=rng.choice((probes.CHAT_PATH, probes.COMPLETIONS_PATH)),
            stream=rng.random() < 0.5,
            max_tokens=rng.randint(8, 64),
            cut_after=rng.random() if rng.random() < cut_share else None,  # a share of ~1 s
        )
        specs.append((key, outcome))

    async def run() -> list[Outcome]:
        gate = asyncio.Semaphore(concurrency)
        durations: list[float] = []

        async def one(key: str, outcome: Outcome) -> Outcome:
            async with gate:
                if outcome.cut_after is not None:  # a random moment of a typical request
                    typical = statistics.median(durations[-200:]) if durations else 1.0
                    outcome.cut_after *= typical
                await generate(plat.base, key, outcome)
                if outcome.finished:
                    durations.append(outcome.ended - outcome.started)
                return outcome

        return await asyncio.gather(*(one(key, outcome) for key, outcome in specs))

    began = time.monotonic()
    outcomes = asyncio.run(run())
    seconds = time.monotonic() - began
    slugs = [slug for slug, _ in world.load_keys]
    records_of = lambda: UsageRecord.objects.filter(tenant__slug__in=slugs)  # noqa: E731
    # records are written as each request settles: wait until their number holds still
    last = [-1, time.monotonic()]

    def settled() -> bool:
        count = records_of().count()
        if count != last[0]:
            last[:] = [count, time.monotonic()]
        quiet = time.monotonic() - last[1] > 3
        return quiet and all(concurrent_slots(slug) == 0 for slug in slugs)

    wait_for(settled, 60)
    engine_after = engine_stats(plat.endpoint)
    records = {r.request_id: r for r in records_of()}
    statuses = collections.Counter(o.status for o in outcomes)
    num_cut = sum(o.is_cut for o in outcomes)
    print(f"  {total} requests in {seconds:.1f} s; statuses {dict(statuses)}; cut {num_cut}")

    server_errors = [o for o in outcomes if o.status is not None and o.status >= 500]
    dropped = [o for o in outcomes if o.dropped]
    stream_errors = [o for o in outcomes if o.error_codes and o.status == 200]
    log_errors = server_errors_in(plat.log_since(offset))
    row(
        "1",
        "no 5xx, no dropped connection",
        f"{len(server_errors)} 5xx of {total}; {len(dropped)} dropped; {len(stream_errors)} "
        f"streams with an error event; {len(log_errors)} server-error log lines",
        not server_errors and not dropped and not stream_errors and not log_errors,
    )
    for line in log_errors[:3]:
        print(f"    log: {line[:200]}")

    admitted = [o for o in outcomes if o.status == 200 and o.request_id]
    known_ids = {o.request_id for o in admitted}
    missing = [o for o in admitted if o.request_id not in records]
    unknown = [r for rid, r in records.items() if rid not in known_ids]
    blind_cuts = sum(o.is_cut and o.status is None for o in outcomes)
    row(
        "1",
        "one usage record per admitted request",
        f"{len(records)} records; {len(admitted)} admitted seen by the client, {len(missing)} "
        f"of them without a record; {len(unknown)} records of requests cut before their "
        f"answer (of {blind_cuts} such cuts)",
        not missing and len(unknown) <= blind_cuts,
    )

    completed = [o for o in admitted if o.finished and not o.is_cut]
    wrong_tokens = [
        o
        for o in completed
        if o.request_id in records
        and (
            records[o.request_id].status != "ok"
            or not o.usage
            or records[o.request_id].completion_tokens != o.usage["completion_tokens"]
            or records[o.request_id].prompt_tokens != o.usage["prompt_tokens"]
            or o.usage["completion_tokens"] != o.max_tokens
        )
    ]
    row(
        "1",
        "completed: record = response usage = max_tokens",
        f"{len(completed) - len(wrong_tokens)}/{len(completed)} equal",
        not wrong_tokens,
    )
    for o in wrong_tokens[:3]:
        r = records[o.request_id]
        print(
            f"    {o.request_id}: record {r.status} {r.prompt_tokens}+{r.completion_tokens}, "
            f"response {o.usage}"
        )

    cut_records = [
        records[o.request_id] for o in outcomes if o.is_cut and o.request_id in records
    ] + unknown
    max_tokens_of = {o.request_id: o.max_tokens for o in outcomes if o.request_id}
    ok_but_short = [
        r
        for r in cut_records
        if r.status == "ok" and r.completion_tokens < max_tokens_of.get(r.request_id, 4)
    ]
    cut_statuses = collections.Counter(r.status for r in cut_records)
    row(
        "1",
        "cut requests metered 'cancelled' (or 'ok' only when whole)",
        f"{len(cut_records)} cut with a record: {dict(cut_statuses)}; {len(ok_but_short)} "
        "'ok' with fewer tokens than asked",
        not ok_but_short,
    )

    engine_tokens = engine_after.generation_tokens_total - engine_before.generation_tokens_total
    metered = sum(r.completion_tokens for r in records.values())
    row(
        "1",
        "metered tokens = the engine's count",
        f"engine generated {engine_tokens}, records hold {metered} "
        f"(difference {engine_tokens - metered})",
        engine_tokens == metered,
    )

    held = {slug: concurrent_slots(slug) for slug in slugs}
    row("1", "no concurrency slot held afterwards", f"slots held {held}", not any(held.values()))


# --- 2. exact admission across processes ----------------------------------------------------


def part_burst(plat: Platform, world: World, quick: bool) -> None:
    from tenants.models import Tenant
    from tenants.quotas import quota_usage

    total = 200
    while time.time() % 60 > 50:  # the burst stays inside one minute of the sliding window
        time.sleep(0.5)
    body = generation_body(probes.COMPLETIONS_PATH, 1, False)

    async def burst() -> list[probes.Answer]:
        return await asyncio.gather(
            *(
                probes.post_json(
                    plat.base,
                    probes.COMPLETIONS_PATH,
                    world.burst_key,
                    body,
                    timeout=REQUEST_TIMEOUT,
                )
                for _ in range(total)
            )
        )

    began = time.monotonic()
    answers = asyncio.run(burst())
    seconds = time.monotonic() - began
    statuses = collections.Counter(a.status for a in answers)
    refusals = [a for a in answers if a.status == 429]
    proper = [a for a in refusals if a.is_openai_error and "retry-after" in a.headers]
    counted = quota_usage(tenant=Tenant.objects.get(slug="burst")).requests_this_minute
    row(
        "2",
        "exactly 20 of 200 admitted across 3 processes",
        f"{statuses.get(200, 0)} x 200, {statuses.get(429, 0)} x 429, others "
        f"{ {k: v for k, v in statuses.items() if k not in (200, 429)} } in {seconds:.1f} s; "
        f"{len(proper)}/{len(refusals)} 429s with the error object and Retry-After; "
        f"counter {counted:.0f}",
        statuses.get(200) == 20 and statuses.get(429) == 180 and len(proper) == len(refusals),
    )


# --- 3. engine kill -9 mid-stream ------------------------------------------------------------


def open_long_streams(
    plat: Platform, key: str, count: int, first_tokens_within: float
) -> tuple[asyncio.AbstractEventLoop, list[Outcome], list[asyncio.Future], asyncio.Event]:
    """Start ``count`` long streams on a loop of our own and run it until each has had its
    first token; the caller goes on running the loop."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    outcomes = [
        Outcome(
            tenant="", path=probes.CHAT_PATH, stream=True, max_tokens=LONG_TOKENS, cut_after=None
        )
        for _ in range(count)
    ]

    async def start() -> list[asyncio.Future]:
        tasks = [asyncio.ensure_future(generate(plat.base, key, o, stop=stop)) for o in outcomes]
        deadline = time.monotonic() + first_tokens_within
        while time.monotonic() < deadline:
            if all(o.first_token_at or o.ended for o in outcomes):
                break
            await asyncio.sleep(0.05)
        return tasks

    tasks = loop.run_until_complete(start())
    if not all(o.first_token_at and not o.ended for o in outcomes):
        seen = collections.Counter(
            f"{o.status} {o.error_codes or o.dropped or ''}".strip() for o in outcomes
        )
        print(f"    not every stream is streaming: {dict(seen)}")
    return loop, outcomes, tasks, stop


def part_engine_kill(plat: Platform, world: World, quick: bool) -> None:
    from tenants.models import UsageRecord

    count = 8 if quick else 16
    pid = plat.pid_of("engine")
    restarts_before = (plat.status().get("engine") or {}).get("restarts", 0)
    loop, outcomes, tasks, stop = open_long_streams(plat, world.fault_key, count, 60)
    streaming = [o for o in outcomes if o.first_token_at and not o.ended]
    slots_before = concurrent_slots("faults")
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        loop.run_until_complete(asyncio.wait(tasks, timeout=30))
        stop.set()
        loop.run_until_complete(asyncio.wait(tasks, timeout=10))
    finally:
        loop.close()
    ends = [o.ended - killed_at for o in streaming if o.ended]
    good = [o for o in streaming if o.error_codes == ["engine_unavailable"] and not o.is_cut]
    last_end = max(ends) if ends else float("inf")
    codes = collections.Counter(
        ",".join(o.error_codes) or (o.dropped or ("cut" if o.is_cut else "finished"))
        for o in streaming
    )
    row(
        "3",
        "open streams end with engine_unavailable within 2 s",
        f"{len(good)}/{len(streaming)} streams ({count} opened) ended with it; endings "
        f"{dict(codes)}; last ended {last_end:.2f} s after the kill",
        len(streaming) == count and len(good) == len(streaming) and last_end <= 2.0,
    )

    held = wait_for(lambda: concurrent_slots("faults") == 0, 15)
    row(
        "3",
        "slots released",
        f"{slots_before} held at the kill; "
        + (
            f"all free {held:.1f} s later"
            if held is not None
            else f"{concurrent_slots('faults')} still held after 15 s"
        ),
        held is not None and slots_before == len(streaming),
    )

    ids = [o.request_id for o in streaming if o.request_id]
    wait_for(lambda: UsageRecord.objects.filter(request_id__in=ids).count() == len(ids), 15)
    records = list(UsageRecord.objects.filter(request_id__in=ids))
    kinds = collections.Counter(f"{r.status}/{r.error_code}" for r in records)
    with_tokens = sum(r.completion_tokens > 0 for r in records)
    row(
        "3",
        "usage records written",
        f"{len(records)}/{len(ids)} records: {dict(kinds)}; {with_tokens} with their tokens",
        len(records) == len(ids) and all(r.status == "error" for r in records),
    )

    body = generation_body(probes.COMPLETIONS_PATH, 2, False)

    def serves() -> bool:
        answer = asyncio.run(
            probes.post_json(plat.base, probes.COMPLETIONS_PATH, world.fault_key, body, timeout=10)
        )
        return answer.status == 200

    served_after = wait_for(serves, 180)
    status = plat.status().get("engine") or {}
    restarted = status.get("restarts", 0) - restarts_before
    row(
        "3",
        "the supervisor restarts the engine; a new request succeeds",
        f"restarts +{restarted}, new pid {status.get('pid')}; first success "
        + (
            f"{time.monotonic() - killed_at:.1f} s after the kill"
            if served_after is not None
            else "never (180 s)"
        ),
        served_after is not None and restarted >= 1,
    )


# --- 4. web process kill -9 with streams open --------------------------------------------------


def part_web_kill(plat: Platform, world: World, quick: bool) -> None:
    count = 12 if quick else 24
    names = [name for name in plat.status() if name.startswith("daphne")]
    loop, outcomes, tasks, stop = open_long_streams(plat, world.webkill_key, count, 60)
    streaming = [o for o in outcomes if o.first_token_at and not o.ended]
    running_before = engine_stats(plat.endpoint).num_requests_running
    slots_before = concurrent_slots("webkill")
    # the victim: the Daphne process that holds the most of the open streams
    pids = {plat.pid_of(name): name for name in names}
    owners = socket_owners(plat.port, list(pids))
    held_by = collections.Counter(pids[owners[o.client_port]] for o in streaming
                                  if o.client_port in owners)  # fmt: skip
    victim = held_by.most_common(1)[0][0] if held_by else names[0]
    restarts_before = (plat.status().get(victim) or {}).get("restarts", 0)
    orphans = [o for o in streaming if pids.get(owners.get(o.client_port)) == victim]
    budget_left = sum(LONG_TOKENS - o.num_token_events for o in orphans)
    generated_before = engine_stats(plat.endpoint).generation_tokens_total
    killed_at = time.monotonic()
    os.kill(plat.pid_of(victim), signal.SIGKILL)
    try:
        loop.run_until_complete(asyncio.sleep(1.0))
        broken = [o for o in streaming if o.ended and not o.finished]
        stop.set()  # the client leaves the other streams: their processes abort them
        loop.run_until_complete(asyncio.wait(tasks, timeout=20))
    finally:
        loop.close()

    # both conditions are watched from the kill on: the engine idle, and the slots free
    since: dict[str, float] = {}
    generated_after = 0
    limit = 150.0
    while time.monotonic() - killed_at < limit and len(since) < 2:
        with contextlib.suppress(Exception):  # the engine may be busy; ask again
            stats = engine_stats(plat.endpoint)
            if "idle" not in since and stats.num_requests_running + stats.num_requests_waiting == 0:
                since["idle"] = time.monotonic() - killed_at
                generated_after = stats.generation_tokens_total - generated_before
        if "slots" not in since and concurrent_slots("webkill") == 0:
            since["slots"] = time.monotonic() - killed_at
        time.sleep(1.0)
    idle = since.get("idle")
    ran_out = generated_after >= 0.9 * budget_left
    row(
        "4",
        "engine's running requests return to 0",
        f"streams per process {dict(held_by)}; killed {victim} ({len(broken)} streams broke); "
        f"{running_before} running ({slots_before} slots held) before, 0 "
        + (f"{idle:.0f} s after the kill" if idle is not None else f"never ({limit:.0f} s)")
        + f"; {generated_after} tokens generated after the kill (the orphans had "
        f"{budget_left} left: {'run to their end' if ran_out else 'cut short'})",
        idle is not None,
    )
    restarted = (plat.status().get(victim) or {}).get("restarts", 0) > restarts_before
    slots = since.get("slots")
    row(
        "4",
        "no slot held after the restart (within 90 s)",
        ("restarted" if restarted else "NOT restarted")
        + "; slots "
        + (
            f"free {slots:.0f} s after the kill"
            if slots is not None
            else f"{concurrent_slots('webkill')} still held {limit:.0f} s after the kill"
        ),
        slots is not None and slots <= 90 and restarted and slots_before == len(streaming),
    )
    plat.wait_ready(120)


def socket_owners(server_port: int, pids: list[int]) -> dict[int, int]:
    """Client port -> pid of the process holding the server's end of that connection
    (Linux: /proc/net/tcp and each process's socket descriptors)."""
    client_of_inode = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == server_port:
            client_of_inode[fields[9]] = int(fields[2].split(":")[1], 16)
    owners = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in client_of_inode:
                        owners[client_of_inode[target[8:-1]]] = pid
    return owners


# --- 5. schema fuzzing ----------------------------------------------------------------------


def part_schema_fuzz(plat: Platform, world: World, quick: bool) -> None:
    import requests

    offset = plat.log_size()
    num_cases = 300 if quick else 1200
    min_cases = 250 if quick else 1000  # operations with few distinct cases run out early
    report = probes.schema_fuzz(plat.base, world.fuzz_key, num_cases)
    total = report.cases
    server, dropped, shapeless = report.server_errors, report.dropped, report.no_error_object
    row(
        "5",
        "schemathesis: every operation, positive and negative",
        f"{total} cases; {len(server)} 5xx, {len(dropped)} dropped, {len(shapeless)} 4xx "
        f"without OpenAI's error object; statuses {dict(report.statuses)}",
        total >= min_cases and not server and not dropped and not shapeless,
    )
    for name, examples in (("5xx", server), ("dropped", dropped), ("shape", shapeless)):
        for example in examples[:3]:
            print(f"    {name}: {example[:300]}")

    document = requests.get(f"{plat.base}/v1/openapi.json", timeout=30).json()
    hostile = (
        probes.hostile_bodies(document, MODEL_NAME)
        + probes.random_bodies(SEED, 100 if quick else 400)
        + probes.odd_requests(MODEL_NAME)
        + probes.big_bodies(MODEL_NAME)
    )

    async def send_all() -> list[tuple[probes.Probe, probes.Answer]]:
        return [(p, await probes.send_probe(plat.base, world.fuzz_key, p)) for p in hostile]

    results = asyncio.run(send_all())
    bad = [(p, probes.judge(p, a)) for p, a in results if probes.judge(p, a)]
    by_category = collections.Counter(p.category for p, _ in bad)
    statuses = collections.Counter(a.status for _, a in results)
    row(
        "5",
        "hostile bodies (nesting, huge numbers, wrong types, bad UTF-8, 50 MB, ...)",
        f"{len(results)} probes, statuses {dict(statuses)}; {len(bad)} not a clean 4xx: "
        f"{dict(by_category) or 'none'}",
        not bad,
    )
    for probe, why in bad[:8]:
        print(f"    {probe.category}: {probe.path} {probe.name[:60]} -> {why}")

    answer = asyncio.run(
        probes.post_json(
            plat.base, probes.CHAT_PATH, world.fuzz_key, generation_body(probes.CHAT_PATH, 4, False)
        )
    )
    log_errors = server_errors_in(plat.log_since(offset))
    row(
        "5",
        "still serves; no server error in the logs",
        f"normal request {answer.status}; {len(log_errors)} server-error log lines",
        answer.status == 200 and not log_errors,
    )
    for line in log_errors[:5]:
        print(f"    log: {line[:200]}")


# --- 6. WebSocket fuzzing -------------------------------------------------------------------


def part_ws_fuzz(plat: Platform, world: World, quick: bool) -> None:
    from django.contrib.auth import get_user_model

    from chat import services as chat_services
    from tenants.models import Tenant

    offset = plat.log_size()
    count = 300 if quick else 1000
    user = get_user_model().objects.get(username="ws-user")
    tenant = Tenant.objects.get(slug="fuzz")
    conversation = chat_services.conversation_create(user=user, tenant=tenant, model=MODEL_NAME)
    chat_services.conversation_configure(conversation=conversation, max_tokens=4)
    fresh = chat_services.conversation_create(user=user, tenant=tenant, model=MODEL_NAME)
    chat_services.conversation_configure(conversation=fresh, max_tokens=4)
    headers = {"Cookie": session_cookie("ws-user"), "Origin": plat.base}
    frames = ws_probes.hostile_frames(SEED, count, foreign_message_id=world.b_message_id)
    report = asyncio.run(
        ws_probes.ws_fuzz(plat.base, f"/ws/chat/{conversation.pk}/", headers, frames)
    )
    foreign_close = asyncio.run(
        ws_probes.ws_close_code(plat.base, f"/ws/chat/{world.b_conversation_id}/", headers)
    )
    row(
        "6",
        "malformed frames refused (error frame or close with a code)",
        f"{report.refused}/{len(frames)} ({report.error_frames} error frames, {report.closes} "
        f"closes {dict(report.close_codes)}); accepted {len(report.accepted)}; "
        f"another tenant's conversation: close {foreign_close}",
        report.refused == len(frames) and foreign_close == 4403,
    )
    for line in report.accepted[:5]:
        print(f"    accepted: {line}")
    row(
        "6",
        "no crash: sockets keep being accepted",
        f"{len(report.crashes)} crashes (1011 / connection lost / silence); "
        f"{report.connects} connects, {report.refused_connects} refused",
        not report.crashes and not report.refused_connects,
    )
    for line in report.crashes[:5]:
        print(f"    crash: {line}")
    reply = asyncio.run(ws_probes.ws_reply(plat.base, f"/ws/chat/{fresh.pk}/", headers))
    log_errors = server_errors_in(plat.log_since(offset))
    row(
        "6",
        "a normal reply afterwards; no server error in the logs",
        f"reply: {reply}; {len(log_errors)} server-error log lines",
        reply == "done" and not log_errors,
    )
    for line in log_errors[:5]:
        print(f"    log: {line[:200]}")


# --- 7. tenant isolation --------------------------------------------------------------------


@dataclass
class Attempt:
    actor: str
    what: str
    method: str
    path: str
    form: dict | None = None
    key: str | None = None
    body: bytes | None = None
    # what counts as denied: statuses, or a redirect to a login page
    denied: tuple[int, ...] = (403, 404)
    login_redirect_ok: bool = False


def isolation_attempts(world: World) -> list[Attempt]:
    b, a = "load-2", "load-1"
    secret_chat = json.dumps(
        {"model": SECRET_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    forged = (
        world.b_key_raw[: len(world.b_key_raw) // 2] + world.a_key_raw[len(world.a_key_raw) // 2 :]
    )
    attempts = [
        Attempt(
            "A key",
            "B-only model detail",
            "GET",
            f"/v1/models/{SECRET_MODEL}",
            key=world.a_key_raw,
            denied=(404,),
        ),
        Attempt(
            "A key",
            "chat on B-only model",
            "POST",
            probes.CHAT_PATH,
            key=world.a_key_raw,
            body=secret_chat,
            denied=(403, 404),
        ),
        Attempt(
            "forged key",
            "B's prefix, A's secret",
            "POST",
            probes.CHAT_PATH,
            key=forged,
            body=secret_chat,
            denied=(401,),
        ),
    ]
    for actor in ("a-owner", "a-admin", "a-member"):
        attempts += [
            Attempt(actor, "B's dashboard", "GET", f"/console/t/{b}/"),
            Attempt(actor, "B's usage CSV", "GET", f"/console/t/{b}/usage.csv"),
            Attempt(actor, "B's keys", "GET", f"/console/t/{b}/keys/"),
            Attempt(actor, "B's members", "GET", f"/console/t/{b}/members/"),
            Attempt(
                actor,
                "create a key in B",
                "POST",
                f"/console/t/{b}/keys/",
                form={"action": "create", "name": "intruder"},
            ),
            Attempt(
                actor,
                "revoke B's key via A",
                "POST",
                f"/console/t/{a}/keys/",
                form={"action": "revoke", "key_id": world.b_key_id},
            ),
            Attempt(
                actor,
                "remove B's owner via A",
                "POST",
                f"/console/t/{a}/members/",
                form={"action": "remove", "membership_id": world.b_membership_id},
            ),
            Attempt(
                actor,
                "demote B's owner via A",
                "POST",
                f"/console/t/{a}/members/",
                form={"action": "role", "membership_id": world.b_membership_id, "role": "member"},
            ),
            Attempt(
                actor,
                "add self to B",
                "POST",
                f"/console/t/{b}/members/",
                form={"action": "add", "username": actor, "role": "owner"},
            ),
            Attempt(
                actor,
                "platform console (deployments)",
                "GET",
                "/console/platform/",
                login_redirect_ok=True,
            ),
            Attempt(
                actor,
                "disable B's deployment",
                "POST",
                "/console/platform/deployments/",
                form={"action": "disable", "deployment_id": world.secret_deployment_id},
                login_redirect_ok=True,
            ),
            Attempt(
                actor, "admin: B's keys", "GET", "/admin/tenants/apikey/", login_redirect_ok=True
            ),
            Attempt(actor, "B's conversation page", "GET", f"/chat/{world.b_conversation_id}/"),
            Attempt(
                actor,
                "rename B's conversation",
                "POST",
                f"/chat/{world.b_conversation_id}/rename/",
                form={"title": "pwned"},
            ),
            Attempt(
                actor,
                "delete B's conversation",
                "POST",
                f"/chat/{world.b_conversation_id}/delete/",
                form={},
            ),
        ]
    return attempts


def part_isolation(plat: Platform, world: World, quick: bool) -> None:
    from chat.models import Conversation
    from serving.models import ModelDeployment
    from tenants.models import ApiKey, Membership, Tenant

    reused = (ROOT / "tests" / "test_isolation.py").exists()
    cookies = {actor: session_cookie(actor) for actor in ("a-owner", "a-admin", "a-member")}
    attempts = isolation_attempts(world)
    # the same requests on A's own objects must work, or a denial above proves nothing
    # (a CSRF or login failure would look like one)
    controls = [
        Attempt("a-owner", "own dashboard", "GET", "/console/t/load-1/", denied=(200,)),
        Attempt("a-admin", "own keys", "GET", "/console/t/load-1/keys/", denied=(200,)),
        Attempt(
            "a-owner",
            "rename own conversation",
            "POST",
            f"/chat/{world.a_conversation_id}/rename/",
            form={"title": "mine"},
            denied=(302,),
        ),
        Attempt(
            "a-member",
            "own conversation page",
            "GET",
            f"/chat/{world.a_conversation_id}/",
            denied=(404,),
        ),
        Attempt(
            "A key",
            "own model",
            "GET",
            f"/v1/models/{MODEL_NAME}",
            key=world.a_key_raw,
            denied=(200,),
        ),
    ]

    async def run() -> list[tuple[Attempt, probes.Answer]]:
        answers = []
        host, port = probes.split_base(plat.base)
        for attempt in controls + attempts:
            headers: dict[str, str | bytes] = {"Connection": "close"}
            body = attempt.body or b""
            if attempt.key is not None:
                headers["Authorization"] = f"Bearer {attempt.key}"
                headers["Content-Type"] = "application/json"
            else:
                headers["Cookie"] = f"{cookies[attempt.actor]}; csrftoken={CSRF}"
                headers["X-CSRFToken"] = CSRF
            if attempt.form is not None:
                body = urllib.parse.urlencode(attempt.form).encode()
                headers["Content-Type"] = "application/x-www-form-urlencoded"
            if attempt.method == "POST":
                headers["Content-Length"] = str(len(body))
            head = probes.request_head(attempt.method, attempt.path, f"{host}:{port}", headers)
            answers.append((attempt, await probes.exchange(host, port, head, body)))
        return answers

    answered = asyncio.run(run())
    control_results, results = answered[: len(controls)], answered[len(controls) :]
    broken_controls = [
        f"{attempt.actor}: {attempt.what} -> {answer.status} (expected {attempt.denied[0]})"
        for attempt, answer in control_results
        if answer.status not in attempt.denied
    ]
    leaks = []
    for attempt, answer in results:
        location = answer.headers.get("location", "")
        to_login = answer.status == 302 and "login" in location
        if not (answer.status in attempt.denied or (attempt.login_redirect_ok and to_login)):
            leaks.append(f"{attempt.actor}: {attempt.what} -> {answer.status} {location}")

    b_key = ApiKey.objects.get(pk=world.b_key_id)
    changed = []
    if b_key.revoked_at is not None:
        changed.append("B's key revoked")
    if not Membership.objects.filter(pk=world.b_membership_id, role="owner").exists():
        changed.append("B's owner removed or demoted")
    if ApiKey.objects.filter(tenant__slug="load-2", name="intruder").exists():
        changed.append("a key created in B")
    b = Tenant.objects.get(slug="load-2")
    if Membership.objects.filter(tenant=b).exclude(user__username="b-owner").exists():
        changed.append("someone joined B")
    conversation = Conversation.objects.filter(pk=world.b_conversation_id).first()
    if conversation is None or conversation.title != "B's secret plans":
        changed.append("B's conversation renamed or deleted")
    if not ModelDeployment.objects.get(pk=world.secret_deployment_id).is_enabled:
        changed.append("B's deployment disabled")

    models = asyncio.run(_models_listed(plat.base, world.a_key_raw))
    if SECRET_MODEL in models:
        leaks.append(f"A's /v1/models lists {SECRET_MODEL}")
    csv_answer = asyncio.run(_get(plat.base, "/console/t/load-1/usage.csv", cookies["a-owner"]))
    if b"load-2-key" in csv_answer.body:
        leaks.append("A's usage CSV shows B's key")
    b_socket = f"/ws/chat/{world.b_conversation_id}/"
    ws = asyncio.run(
        ws_probes.ws_close_code(
            plat.base, b_socket, {"Cookie": cookies["a-owner"], "Origin": plat.base}
        )
    )
    forged = session_cookie("a-owner", chat_tenant_id=world.tenant_ids["load-2"])
    ws_forged = asyncio.run(
        ws_probes.ws_close_code(plat.base, b_socket, {"Cookie": forged, "Origin": plat.base})
    )
    for label, code in (("socket", ws), ("socket, session naming B", ws_forged)):
        if code != 4403:
            leaks.append(f"a-owner: B's conversation {label} -> {code}")
    total = len(results) + 5
    row(
        "7",
        "A's key, owner, admin, member vs B's objects: all denied",
        f"{total - len(leaks)}/{total} attempts denied (API, console, admin, chat pages and "
        f"sockets); controls on A's own objects {len(controls) - len(broken_controls)}/"
        f"{len(controls)} as expected",
        not leaks and not broken_controls,
    )
    for line in leaks[:10]:
        print(f"    leak: {line}")
    for line in broken_controls:
        print(f"    control: {line}")
    row("7", "nothing of B's changed", "; ".join(changed) or "unchanged", not changed)
    if reused:
        try:
            isolation_matrix(plat)
        except Exception as exc:  # noqa: BLE001 - its internals are another file's to change
            row(
                "7", "tests/test_isolation.py's matrix, live", f"could not run: {exc!r}"[:200], None
            )


CSRF = "reliabilitycsrf0123456789abcdefg"  # Django's 32-character CSRF secret, any will do


async def _request(
    base: str,
    method: str,
    path: str,
    *,
    cookie: str | None = None,
    key: str | None = None,
    form: dict | None = None,
    body: bytes = b"",
) -> probes.Answer:
    """One page or API request as a browser (session cookie, CSRF token) or an API client."""
    host, port = probes.split_base(base)
    headers: dict[str, str | bytes] = {"Connection": "close"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if form is not None or cookie is not None:  # a browser, signed in or not
        headers["Cookie"] = "; ".join(filter(None, [cookie, f"csrftoken={CSRF}"]))
        headers["X-CSRFToken"] = CSRF
    if form is not None:
        body = urllib.parse.urlencode(form).encode()
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    elif body:
        headers["Content-Type"] = "application/json"
    if method == "POST":
        headers["Content-Length"] = str(len(body))
    head = probes.request_head(method, path, f"{host}:{port}", headers)
    return await probes.exchange(host, port, head, body)


def isolation_matrix(plat: Platform) -> None:
    """tests/test_isolation.py's matrix, reused on the live platform: its world built in this
    suite's database, each of its page and API probes sent over HTTP by each of its actors,
    judged by its own check; its socket refusals and foreign frames on real sockets."""
    import pytest
    from django.contrib.auth import get_user_model

    from serving.models import ModelDeployment
    from tests import test_isolation as matrix

    world = matrix._build_world(get_user_model())
    cookies = {actor: session_cookie(world.users[actor].username) for actor in ("member", "admin")}
    failures: list[str] = []
    known: dict[str, list[str]] = {}  # what tests/test_isolation.py marks xfail -> actors
    count = 0
    for entry in matrix.PAGES + matrix.API:
        is_known = isinstance(entry, type(pytest.param(None)))
        probe = entry.values[0] if is_known else entry
        for actor in matrix.ACTORS:
            count += 1
            path = probe.url(world, actor)
            data = probe.data(world) if probe.method == "POST" else None
            is_api = path.startswith(("/v1", "/health"))
            answer = asyncio.run(
                _request(
                    plat.base,
                    probe.method,
                    path,
                    cookie=cookies.get(actor),
                    key=world.alpha_raw_key if actor == "key" else None,
                    form=None if is_api else data,
                    body=json.dumps(data).encode() if is_api and data is not None else b"",
                )
            )
            body = answer.body.decode("utf-8", "replace")
            try:
                matrix._check(probe, actor, answer.status, answer.headers.get("location", ""), body)
                assert probe.unchanged(world), f"{probe.name} changed bravo's data"
            except AssertionError as exc:
                if is_known:
                    why = re.sub(r" to alpha's \w+$", "", str(exc).splitlines()[0])[:90]
                    known.setdefault(f"{why} (HTTP {answer.status})", []).append(actor)
                else:
                    failures.append(f"{actor}: {probe.name} -> {answer.status} ({str(exc)[:120]})")
    frames = {name: frame(world) for name, frame in matrix.FRAMES.items()}

    async def sockets() -> None:
        nonlocal count
        for actor, code in (("key", 4401), ("member", 4403), ("admin", 4403)):
            count += 1
            headers = {"Origin": plat.base}
            if actor in cookies:
                headers["Cookie"] = cookies[actor]
            path = f"/ws/chat/{world.bravo_conversation.pk}/"
            got = await ws_probes.ws_close_code(plat.base, path, headers)
            if got != code:
                failures.append(f"{actor}: bravo's socket -> {got}, expected {code}")
        for actor in ("member", "admin"):
            for name, frame in frames.items():
                count += 1
                headers = {"Origin": plat.base, "Cookie": cookies[actor]}
                path = f"/ws/chat/{world.own_conversations[actor].pk}/"
                status, socket_ = await ws_probes.WebSocket.connect(plat.base, path, headers)
                if socket_ is None:
                    failures.append(f"{actor}: own socket refused ({status})")
                    continue
                await socket_.send_text(json.dumps(frame))
                answer = (await socket_.receive(timeout=20)).frame() or {}
                await socket_.close()
                if (answer.get("type"), answer.get("code")) != ("error", "invalid_request"):
                    failures.append(f"{actor}: {name} -> {answer}")

    try:
        asyncio.run(sockets())
    finally:  # its deployments point at no engine: they would keep /health/ready at 503
        ModelDeployment.objects.filter(name__in=["shared-model", matrix.BRAVO_MODEL]).update(
            is_enabled=False
        )
    row(
        "7",
        "tests/test_isolation.py's matrix, live",
        f"{count - len(failures) - sum(map(len, known.values()))}/{count} requests and frames "
        f"as the matrix expects, {len(failures)} not"
        + (f", {sum(map(len, known.values()))} known leaks (below)" if known else ""),
        not failures,
    )
    if known:
        row(
            "7",
            "known leaks (xfail in tests/test_isolation.py)",
            "; ".join(f"{why}, to {', '.join(actors)}" for why, actors in known.items()),
            False,
        )
    for line in failures[:10]:
        print(f"    matrix: {line}")


async def _get(base: str, path: str, cookie: str) -> probes.Answer:
    host, port = probes.split_base(base)
    head = probes.request_head(
        "GET", path, f"{host}:{port}", {"Cookie": cookie, "Connection": "close"}
    )
    return await probes.exchange(host, port, head)


async def _models_listed(base: str, key: str) -> list[str]:
    host, port = probes.split_base(base)
    head = probes.request_head(
        "GET",
        "/v1/models",
        f"{host}:{port}",
        {"Authorization": f"Bearer {key}", "Connection": "close"},
    )
    answer = await probes.exchange(host, port, head)
    return [model["id"] for model in json.loads(answer.body)["data"]]


# --- the run ----------------------------------------------------------------------------------

PARTS: dict[str, tuple[str, Callable, float, float]] = {
    # number: (name, function, limit in seconds --quick, limit in full)
    "1": ("load with faults", part_load, 300, 900),
    "2": ("exact admission across processes", part_burst, 120, 120),
    "5": ("schema fuzzing", part_schema_fuzz, 420, 900),
    "6": ("WebSocket fuzzing", part_ws_fuzz, 240, 480),
    "7": ("tenant isolation", part_isolation, 120, 120),
    "3": ("engine kill -9 mid-stream", part_engine_kill, 300, 300),
    "4": ("web process kill -9", part_web_kill, 330, 330),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, cases, frames")
    parser.add_argument("--parts", default="1,2,3,4,5,6,7", help="which parts, e.g. 1,5")
    parser.add_argument("--deadline", type=float, help="seconds for the whole run")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = parser.parse_args()
    wanted = {part.strip() for part in args.parts.split(",")}
    began = time.monotonic()
    deadline = began + (args.deadline or (1500 if args.quick else 3600))

    database_url, redis_url = own_urls()
    work = Path(tempfile.mkdtemp(prefix="reliability-"))
    var_dir = work / "var"
    var_dir.mkdir()
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT)]),
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DATABASE_URL": database_url,
        "DATABASE_POOL_MAX_SIZE": "8",
        "REDIS_URL": redis_url,
        "SECRET_KEY": "reliability-suite-only-0123456789-abcdefghijklmnopqrstuvwxyz",
        "DEBUG": "0",
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "SECURE_COOKIES": "0",
        "VAR_DIR": str(var_dir),
        "MODEL_PATH": str(work / "model"),
        "SERVED_MODEL_NAME": MODEL_NAME,
        "ENGINE_ARGS": f"--dtype float32 --max-model-len {MAX_MODEL_LEN} --num-kv-blocks 8192",
        "WEB_PROCESSES": "3",
        "CELERY_WORKER_ARGS": "--concurrency 1",
        "LOG_LEVEL": "INFO",
    }
    os.environ.update(env)
    plat = Platform(var_dir, env, port)

    def stop_on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop_on_signal)
    log(f"work folder {work}; database {database_url}; redis {redis_url}")
    try:
        with time_limit(min(600, deadline - time.monotonic())):
            create_database(database_url)
            flush_redis(redis_url)
            build_model(work / "model")
            import django

            django.setup()
            from django.core.management import call_command

            call_command("migrate", interactive=False, verbosity=0)
            world = create_world(plat.endpoint)
            plat.start()
            ready = plat.wait_ready(300)
            log(f"platform ready in {ready:.1f} s at {plat.base} (3 Daphne processes)")
        for number, (name, function, quick_limit, full_limit) in PARTS.items():
            if number not in wanted:
                continue
            left = deadline - time.monotonic()
            limit = min(quick_limit if args.quick else full_limit, left)
            if limit < 30:
                row(number, name, "not started: the global deadline is near", None)
                continue
            log(f"part {number}: {name} (limit {limit:.0f} s)")
            num_rows = len(ROWS)
            try:
                with time_limit(limit):
                    plat.wait_ready(120)
                    plat.warm(world.fuzz_key)
                    function(plat, world, args.quick)
            except Exception as exc:  # noqa: BLE001 - a part's failure is a row, not the end
                row(number, name, f"stopped: {exc!r}"[:300], False)
            if len(ROWS) == num_rows:
                row(number, name, "no result", False)
    except KeyboardInterrupt as exc:
        row("-", "run", f"interrupted: {exc}", None)
    except Exception as exc:  # noqa: BLE001
        row("-", "setup", f"failed: {exc!r}"[:300], False)
    finally:
        log("stopping the platform")
        plat.stop()
        from django.db import connections

        with contextlib.suppress(Exception):
            connections.close_all()
    seconds = time.monotonic() - began
    print()
    print(
        f"reliability suite, {'--quick' if args.quick else 'full'}, "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {host_platform.machine()}, "
        f"{os.cpu_count()} cores, Python {host_platform.python_version()}, "
        f"{seconds:.0f} s"
    )
    print(table())
    if args.keep:
        print(f"logs: {plat.log_path}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0 if ROWS and all(r.ok for r in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
