"""The fast half of the reliability suite (bench/reliability.py runs it all, at size, on the
whole platform): schemathesis, hostile bodies and malformed WebSocket frames against a live
Daphne and engine. Every answer is a 4xx with OpenAI's error object (or an error frame, or a
close with a code), never a 5xx, a dropped connection or a crash.

The cases are fixed: hypothesis runs derandomized, and bench/probes.py and
bench/ws_probes.py draw their random inputs from a seeded generator. Probes that fail today
because of known bugs are marked xfail (not strict), so the suite stays green and turns them
green as the fixes land."""

import asyncio
import collections
import http.cookiejar
import json
import re
import urllib.parse
import urllib.request

import pytest

from bench import probes, ws_probes
from serving.services import deployment_register
from tenants import services
from tenants.models import Plan
from tests.gateway.conftest import MODEL_NAME

pytestmark = pytest.mark.django_db(transaction=True)

SEED = 20240601


@pytest.fixture
def live(daphne_server, engine):
    engine.wait_ready()
    plan = Plan.objects.create(slug="open", name="Open", max_concurrent_requests=1000)
    tenant = services.tenant_create(slug="acme", plan=plan)
    _, key = services.api_key_create(tenant=tenant, name="fuzz")
    deployment_register(name=MODEL_NAME, endpoints=[engine.endpoint])
    return daphne_server, key, tenant


def _document(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/v1/openapi.json", timeout=30) as answer:
        return json.loads(answer.read())


def _send_all(base: str, key: str, selected: list[probes.Probe]) -> list[str]:
    """What was wrong with each answer that was not a clean refusal (or a served request)."""

    async def run() -> list[str]:
        wrong = []
        for probe in selected:
            answer = await probes.send_probe(base, key, probe)
            if why := probes.judge(probe, answer):
                wrong.append(f"{probe.path} {probe.name[:60]}: {why}")
        return wrong

    return asyncio.run(run())


def _still_serves(base: str, key: str) -> None:
    body = json.dumps(probes.valid_body(probes.CHAT_PATH, MODEL_NAME)).encode()
    answer = asyncio.run(probes.post_json(base, probes.CHAT_PATH, key, body))
    assert answer.status == 200, answer.body[:300]


def test_schemathesis_finds_no_server_error(live):
    base, key, _ = live
    report = probes.schema_fuzz(base, key, num_cases=160)
    assert report.cases >= 120
    assert not report.server_errors, report.server_errors[:3]
    assert not report.dropped, report.dropped[:3]
    assert not report.no_error_object, report.no_error_object[:3]
    _still_serves(base, key)


@pytest.mark.parametrize(
    "category",
    [
        "wrong_type",
        "deep_nesting",
        "malformed_body",
        "content_type",
        "charset",
        "lone_surrogate",
        "huge_number",
        "invalid_utf8",
    ],
)
def test_hostile_bodies_get_a_4xx_with_the_error_object(live, category):
    base, key, _ = live
    selected = [
        probe
        for probe in probes.hostile_bodies(_document(base), MODEL_NAME)
        if probe.category == category
    ]
    assert selected
    wrong = _send_all(base, key, selected)
    assert not wrong, f"{len(wrong)}/{len(selected)}: {wrong[:5]}"
    _still_serves(base, key)


def test_random_bodies_odd_requests_and_50_mb_bodies_are_refused(live):
    base, key, _ = live
    selected = (
        probes.random_bodies(SEED, 60)
        + probes.odd_requests(MODEL_NAME)
        + probes.big_bodies(MODEL_NAME)
    )
    wrong = _send_all(base, key, selected)
    assert not wrong, f"{len(wrong)}/{len(selected)}: {wrong[:5]}"
    _still_serves(base, key)


@pytest.fixture
def chat_socket(live, django_user_model):
    """A member of the tenant, logged in, with an empty conversation, and another tenant's
    conversation with a message in it."""
    from chat import services as chat_services

    base, _, tenant = live
    user = django_user_model.objects.create_user("fuzzer", password="correct horse battery")
    services.membership_set(tenant=tenant, user=user, role="member", **_no_actor())
    conversation = chat_services.conversation_create(user=user, tenant=tenant, model=MODEL_NAME)
    chat_services.conversation_configure(conversation=conversation, max_tokens=4)
    stranger = django_user_model.objects.create_user("stranger", password="correct horse b")
    other = services.tenant_create(slug="globex", name="Globex", plan=tenant.plan, owner=stranger)
    foreign = chat_services.conversation_create(user=stranger, tenant=other, model=MODEL_NAME)
    message = chat_services.message_send(conversation=foreign, content="not yours")
    headers = {"Cookie": _log_in(base, "fuzzer", "correct horse battery"), "Origin": base}
    return base, headers, conversation.pk, foreign.pk, message.pk


def _log_in(base: str, username: str, password: str) -> str:
    """A session cookie from the live server's own login form (the server signs sessions
    with its own secret key, not this process's)."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    page = opener.open(f"{base}/accounts/login/", timeout=30).read().decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    form = {"csrfmiddlewaretoken": token, "username": username, "password": password}
    request = urllib.request.Request(
        f"{base}/accounts/login/",
        data=urllib.parse.urlencode(form).encode(),
        headers={"Referer": f"{base}/accounts/login/"},
    )
    opener.open(request, timeout=30)
    session = next(cookie.value for cookie in jar if cookie.name == "sessionid")
    return f"sessionid={session}"


def _no_actor() -> dict:
    from inspect import signature

    return {"actor": None} if "actor" in signature(services.membership_set).parameters else {}


def _frames(foreign_message_id: int) -> list[ws_probes.WsProbe]:
    return ws_probes.hostile_frames(SEED, 250, foreign_message_id=foreign_message_id)


async def test_malformed_frames_are_refused_without_a_crash(chat_socket):
    base, headers, conversation_id, foreign_id, foreign_message_id = chat_socket
    frames = [f for f in _frames(foreign_message_id) if f.category != "lone_surrogate"]
    report = await ws_probes.ws_fuzz(base, f"/ws/chat/{conversation_id}/", headers, frames)
    categories = collections.Counter(f.category for f in frames)
    assert not report.crashes, report.crashes[:5]
    assert not report.accepted, report.accepted[:5]
    assert report.refused == len(frames), categories
    assert report.refused_connects == 0
    assert await ws_probes.ws_close_code(base, f"/ws/chat/{foreign_id}/", headers) == 4403
    assert await ws_probes.ws_reply(base, f"/ws/chat/{conversation_id}/", headers) == "done"


async def test_a_lone_surrogate_in_a_message_is_refused(chat_socket):
    base, headers, conversation_id, _, foreign_message_id = chat_socket
    frames = [f for f in _frames(foreign_message_id) if f.category == "lone_surrogate"]
    assert frames
    report = await ws_probes.ws_fuzz(base, f"/ws/chat/{conversation_id}/", headers, frames)
    assert not report.crashes, report.crashes
    assert report.refused == len(frames)
