"""Signing in, with failed attempts throttled: the chat's sign-in page and the admin's.

Failed sign-ins are counted per account and address, per account, and per address, each in a
window of ``SIGN_IN_WINDOW_SECONDS`` (fixed, from its first attempt), in the cache (Redis in
production: every web process sees the same counts). An attempt is counted before its
password is checked, and given back if the password was right. Once a count reaches its
limit, signing in that way is refused, a right password too, until the window ends: the page
says when, and the chat's answers 429. A success clears its account and address's count.
The per-account limit is the wider one, so that a stranger failing on purpose from one
address does not lock the account's owner out; guessing from many addresses still meets it.

Each sign-in, and each wrong password, is an event in the platform's audit log, with its
address (a refused attempt is not: no password was tried).

The page that changes a signed-in user's password checks the current one the same way (a
stolen session tries no more passwords there than at the sign-in), and a change is an event.
"""

import contextlib
import hashlib
import ipaddress
import math
import time

from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm, AdminPasswordChangeForm
from django.contrib.auth.forms import AuthenticationForm, PasswordChangeForm
from django.contrib.auth.views import LoginView, PasswordChangeView
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse

from tenants.audit import HIDDEN_VALUE, audit_record, client_ip
from tenants.models import AuditEvent

THROTTLED = "throttled"


class SignInThrottled(ValidationError):
    def __init__(self, retry_after: int) -> None:
        minutes = max(1, math.ceil(retry_after / 60))
        super().__init__(
            f"Too many failed sign-ins: try again in {minutes} minute{'s' * (minutes > 1)}.",
            code=THROTTLED,
        )
        self.retry_after = retry_after


# an IPv6 host (or its customer line) is given a whole /64: counted per address, each guess
# could come from an address of its own
IPV6_PREFIX = 64


def address_bucket(address: str) -> str:
    """What failures are counted by for ``address``: an IPv4 address itself (also written as
    IPv6), an IPv6 address's /64 network."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/{IPV6_PREFIX}", strict=False))
    return str(ip)


def _counters(username: str, address: str | None) -> dict[str, tuple[str, int]]:
    """The counters one attempt counts in, by kind: each one's cache key and limit."""
    account = hashlib.sha256(username.casefold().encode()).hexdigest()[:32]
    address = None if address is None else address_bucket(address)
    counters = {"account": (f"sign-in:account:{account}", settings.SIGN_IN_FAILURES_PER_ACCOUNT)}
    if address is not None:
        counters["pair"] = (f"sign-in:pair:{account}:{address}", settings.SIGN_IN_FAILURES_PER_PAIR)
        counters["address"] = (f"sign-in:address:{address}", settings.SIGN_IN_FAILURES_PER_ADDRESS)
    return counters


def sign_in_begin(*, username: str, address: str | None) -> None:
    """Count an attempt in each of its counters before its password is checked, so that
    attempts made at the same moment cannot all pass a check that none had counted in yet;
    raise ``SignInThrottled`` (the attempt given back) when one is past its limit."""
    counters = list(_counters(username, address).values())
    counts = [_count(key) for key, _ in counters]
    over = [key for (key, limit), count in zip(counters, counts, strict=True) if count > limit]
    if over:
        _give_back([key for key, _ in counters])
        now = time.time()
        untils = cache.get_many([f"{key}:until" for key in over])
        raise SignInThrottled(max(1, math.ceil(max(untils.values(), default=now + 1) - now)))


def sign_in_end(*, username: str, address: str | None, was_password_right: bool) -> None:
    """A wrong password stays counted. A right one is given back, and clears its account's
    failures from its address (those from elsewhere, and its address's with other accounts,
    run to their window's end)."""
    if not was_password_right:
        return
    counters = _counters(username, address)
    _give_back([key for kind, (key, _) in counters.items() if kind != "pair"])
    if "pair" in counters:
        key = counters["pair"][0]
        cache.delete_many([key, f"{key}:until"])


def _count(key: str) -> int:
    window = settings.SIGN_IN_WINDOW_SECONDS
    if cache.add(key, 0, timeout=window):  # the window starts at its first attempt
        cache.set(f"{key}:until", time.time() + window, timeout=window)
    try:
        return cache.incr(key)
    except ValueError:  # the window ended between the two
        cache.add(key, 1, timeout=window)
        return 1


def _give_back(keys: list[str]) -> None:
    for key in keys:
        with contextlib.suppress(ValueError):  # its window ended meanwhile
            cache.decr(key)


class ThrottledSignIn:
    """An authentication form's ``clean``, throttled (a mix-in before Django's form)."""

    request: HttpRequest | None
    user_cache: object | None

    def clean(self) -> dict:
        username = self.cleaned_data.get("username") or ""
        address = client_ip(self.request.META) if self.request is not None else None
        sign_in_begin(username=username, address=address)
        try:
            cleaned = super().clean()
        except ValidationError:
            # the password was right where a user was found: the admin's refusal of one who
            # is not staff (also "invalid_login"), an inactive account, are no failed guess
            is_right = self.user_cache is not None
            sign_in_end(username=username, address=address, was_password_right=is_right)
            if not is_right:
                audit_record(
                    action=AuditEvent.Action.USER_SIGN_IN_FAILED,
                    actor=None,
                    target_name=username,
                )
            raise
        sign_in_end(username=username, address=address, was_password_right=True)
        user = self.get_user()
        audit_record(action=AuditEvent.Action.USER_SIGNED_IN, actor=user, target=user)
        return cleaned


class SignInForm(ThrottledSignIn, AuthenticationForm):
    pass


class AdminSignInForm(ThrottledSignIn, AdminAuthenticationForm):
    pass


class SignInView(LoginView):
    """Django's sign-in page; a throttled attempt is a 429 with ``Retry-After``."""

    authentication_form = SignInForm

    def form_invalid(self, form: SignInForm) -> HttpResponse:
        response = super().form_invalid(form)
        throttled = [e for e in form.non_field_errors().as_data() if e.code == THROTTLED]
        if throttled:
            response.status_code = 429
            response["Retry-After"] = str(throttled[0].retry_after)
        return response


class ThrottledPasswordCheck:
    """A password change form's check of the current password, throttled as a sign-in (a
    mix-in before Django's form)."""

    user: object

    def __init__(self, user, *args, address: str | None = None, **kwargs) -> None:
        super().__init__(user, *args, **kwargs)
        self.address = address

    def clean_old_password(self) -> str:
        username = self.user.get_username()
        sign_in_begin(username=username, address=self.address)
        try:
            old_password = super().clean_old_password()
        except ValidationError:
            sign_in_end(username=username, address=self.address, was_password_right=False)
            audit_record(
                action=AuditEvent.Action.USER_SIGN_IN_FAILED, actor=None, target_name=username
            )
            raise
        sign_in_end(username=username, address=self.address, was_password_right=True)
        return old_password


class ThrottledPasswordChangeForm(ThrottledPasswordCheck, PasswordChangeForm):
    pass


class ThrottledAdminPasswordChangeForm(ThrottledPasswordCheck, AdminPasswordChangeForm):
    pass


class AuditedPasswordChangeView(PasswordChangeView):
    """Django's password change page: throttled, and each change in the audit log."""

    form_class = ThrottledPasswordChangeForm

    def get_form_kwargs(self) -> dict:
        return {**super().get_form_kwargs(), "address": client_ip(self.request.META)}

    def form_valid(self, form: ThrottledPasswordChangeForm) -> HttpResponse:
        response = super().form_valid(form)
        audit_record(
            action=AuditEvent.Action.USER_UPDATED,
            actor=self.request.user,
            target=self.request.user,
            changes={"password": [HIDDEN_VALUE, HIDDEN_VALUE]},
        )
        return response


def admin_password_change(request: HttpRequest, extra_context: dict | None = None):
    """The admin's own password page (``AdminSite.password_change``, in the admin's look),
    throttled and audited as the platform's: a stolen staff session could try every current
    password there instead."""
    from django.contrib import admin
    from django.urls import reverse

    site = admin.site
    request.current_app = site.name
    return AuditedPasswordChangeView.as_view(
        form_class=ThrottledAdminPasswordChangeForm,
        success_url=reverse("admin:password_change_done", current_app=site.name),
        extra_context={**site.each_context(request), **(extra_context or {})},
    )(request)
