"""Signing in is throttled: failed passwords are counted per account and address, per account
and per address, and past a limit the page refuses (the chat's with a 429), a right password
too, until the window ends. Nothing limited how many passwords a stranger could try."""

import time

import pytest
from django.core.cache import cache
from django.urls import reverse

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery"


@pytest.fixture(autouse=True)
def fresh_counts():
    cache.clear()
    yield
    cache.clear()


def _sign_in(client, password: str, address: str = "203.0.113.5", username: str = "alice"):
    return client.post(
        reverse("login"),
        {"username": username, "password": password, "next": "/chat/"},
        REMOTE_ADDR=address,
    )


def _is_signed_in(client) -> bool:
    return "_auth_user_id" in client.session


def test_five_wrong_passwords_from_one_address_lock_that_address_out(client, user):
    for _ in range(5):
        response = _sign_in(client, "wrong")
        assert response.status_code == 200
        assert "Please enter a correct username and password" in response.content.decode()

    refused = _sign_in(client, PASSWORD)

    assert refused.status_code == 429 and not _is_signed_in(client)
    assert 0 < int(refused["Retry-After"]) <= 900
    assert "Too many failed sign-ins: try again in 15 minutes." in refused.content.decode()
    # the owner, from elsewhere, still signs in
    assert _sign_in(client, PASSWORD, address="198.51.100.7").status_code == 302
    assert _is_signed_in(client)


def test_a_right_password_clears_its_addresss_failures(client, user):
    for _ in range(4):
        _sign_in(client, "wrong")
    assert _sign_in(client, PASSWORD).status_code == 302
    client.logout()
    for _ in range(4):
        _sign_in(client, "wrong")
    assert _sign_in(client, PASSWORD).status_code == 302


def test_guessing_one_account_from_many_addresses_meets_its_own_limit(client, user):
    for n in range(20):
        _sign_in(client, "wrong", address=f"198.51.100.{n}")
    assert _sign_in(client, PASSWORD, address="192.0.2.1").status_code == 429


def test_an_ipv6_host_cannot_guess_from_a_new_address_each_time(client, user):
    """A host holds a whole /64: rotating its addresses skipped the limits per address."""
    for n in range(5):
        _sign_in(client, "wrong", address=f"2001:db8:1:2::{n + 1:x}")

    assert _sign_in(client, PASSWORD, address="2001:db8:1:2:ffff::9").status_code == 429
    assert _sign_in(client, PASSWORD, address="2001:db8:1:3::1").status_code == 302


def test_one_address_guessing_many_accounts_meets_its_limit(client, user):
    for n in range(50):
        _sign_in(client, "wrong", username=f"someone-{n}")
    assert _sign_in(client, PASSWORD).status_code == 429
    assert _sign_in(client, PASSWORD, address="198.51.100.7").status_code == 302


def test_the_lock_ends_with_its_window(client, user, settings):
    settings.SIGN_IN_WINDOW_SECONDS = 1
    for _ in range(5):
        _sign_in(client, "wrong")
    assert _sign_in(client, PASSWORD).status_code == 429
    time.sleep(1.2)
    assert _sign_in(client, PASSWORD).status_code == 302


def test_the_admins_sign_in_is_throttled_too(client, admin_user):
    url = reverse("admin:login")
    for _ in range(5):
        client.post(url, {"username": "admin", "password": "wrong"}, REMOTE_ADDR="203.0.113.5")
    response = client.post(
        url, {"username": "admin", "password": "password"}, REMOTE_ADDR="203.0.113.5"
    )
    assert "Too many failed sign-ins" in response.content.decode()
    assert not _is_signed_in(client)


def test_sign_ins_and_wrong_passwords_are_in_the_audit_log(client, user):
    from tenants.models import AuditEvent

    _sign_in(client, "wrong", address="203.0.113.5")
    _sign_in(client, PASSWORD, address="198.51.100.7")
    for _ in range(5):
        _sign_in(client, "wrong", address="192.0.2.9")
    _sign_in(client, PASSWORD, address="192.0.2.9")  # refused: no password tried, no event

    events = [
        (e.action, e.actor_name, e.target_name, e.ip_address)
        for e in AuditEvent.objects.filter(action__startswith="user.sign").order_by("id")
    ]
    assert events[:2] == [
        ("user.sign_in_failed", "", "alice", "203.0.113.5"),
        ("user.signed_in", "alice", "alice", "198.51.100.7"),
    ]
    assert events[2:] == [("user.sign_in_failed", "", "alice", "192.0.2.9")] * 5


def test_attempts_at_the_same_moment_stay_within_the_limit(monkeypatch):
    """The counts were checked before the password and raised after it: 40 guesses sent at
    once all passed a check that none had counted in yet."""
    import threading
    from unittest import mock

    from django.test import RequestFactory

    from config.sign_in import SignInForm

    tried, lock, barrier = [], threading.Lock(), threading.Barrier(40)

    def slow_authenticate(request=None, **credentials):  # as slow as a real password hash
        with lock:
            tried.append(credentials["password"])
        time.sleep(0.3)

    def attempt(n: int) -> None:
        request = RequestFactory().post("/accounts/login/", REMOTE_ADDR="203.0.113.5")
        form = SignInForm(request, data={"username": "victim", "password": f"guess-{n}"})
        barrier.wait()
        form.is_valid()

    with (
        mock.patch("django.contrib.auth.forms.authenticate", slow_authenticate),
        mock.patch("config.sign_in.audit_record"),  # no database from these threads
    ):
        threads = [threading.Thread(target=attempt, args=(n,)) for n in range(40)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(tried) == 5  # the limit per account and address


def test_a_right_password_refused_by_the_admin_is_no_failure(client, user):
    """The admin refuses a user who is not staff with Django's "invalid_login": five right
    passwords there locked the user out of the chat."""
    for _ in range(6):
        client.post(reverse("admin:login"), {"username": "alice", "password": PASSWORD})
    assert _sign_in(client, PASSWORD, address="127.0.0.1").status_code == 302


def test_the_password_reset_pages_are_not_served(client):
    """Django's reset pages were served (``django.contrib.auth.urls``) though the platform
    sends no mail: anybody could have any user's address sent reset mails, unthrottled."""
    for path in ("/accounts/password_reset/", "/accounts/reset/done/"):
        assert client.get(path).status_code == 404
        assert client.post(path, {"email": "alice@example.com"}).status_code == 404


def _change(
    client,
    old: str,
    new: str = "a new horse battery",
    address: str = "203.0.113.5",
    page: str = "password_change",
):
    return client.post(
        reverse(page),
        {"old_password": old, "new_password1": new, "new_password2": new},
        REMOTE_ADDR=address,
    )


@pytest.mark.parametrize("page", ["password_change", "admin:password_change"])
def test_a_password_change_is_throttled_as_a_sign_in_and_audited(client, user, page):
    """A stolen session could try every current password on the change page, unthrottled,
    and a change left no event in the audit log."""
    from tenants.audit import HIDDEN_VALUE
    from tenants.models import AuditEvent

    user.is_staff = True  # the admin's page is staff's
    user.save()
    client.force_login(user)
    for _ in range(5):
        wrong = _change(client, "wrong", page=page)
        assert "old password was entered incorrectly" in wrong.content.decode()
    refused = _change(client, PASSWORD, page=page)
    assert "Too many failed sign-ins" in refused.content.decode()
    user.refresh_from_db()
    assert user.check_password(PASSWORD)

    cache.clear()
    assert _change(client, PASSWORD, page=page).status_code == 302
    user.refresh_from_db()
    assert user.check_password("a new horse battery")
    [event] = AuditEvent.objects.filter(action=AuditEvent.Action.USER_UPDATED)
    assert (event.actor, event.target_id) == (user, str(user.pk))
    assert event.changes == {"password": [HIDDEN_VALUE, HIDDEN_VALUE]}
    assert AuditEvent.objects.filter(action=AuditEvent.Action.USER_SIGN_IN_FAILED).count() == 5


def test_the_chat_and_the_console_link_to_the_password_page(client, user, admin_user):
    client.force_login(user)
    assert client.get(reverse("password_change")).status_code == 200
    assert reverse("password_change") in client.get("/chat/", follow=True).content.decode()
    client.force_login(admin_user)
    assert reverse("password_change") in client.get("/console/", follow=True).content.decode()
