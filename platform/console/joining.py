"""Accepting an invitation (``tenants.invitations``): its link, ``/console/join/<code>/``,
keeps the code's hash in the session (never the code: sessions are stored in the clear) for
an hour and leads on to ``/console/join/``, which asks the person to sign in (the code never
travels in a ``next`` address, a later page's Referer or the access log, see
``config.access_log``), shows the tenant and the role, and takes the acceptance of the
invitation it showed, whatever link was opened since."""

import time

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers
from django.views.decorators.cache import never_cache

from console import forms
from tenants import invitations
from tenants.models import Membership

SESSION_KEY = "invitation"
# how long an opened link waits in the session for its sign-in and acceptance
KEPT_SECONDS = 3600
# a code is a few dozen characters; anything much longer is not one
MAX_CODE_CHARS = 128


@never_cache
def join_link(request: HttpRequest, code: str) -> HttpResponse:
    """The invitation's link: its code's hash kept in the session (replacing any other's),
    and on to the page that shows it."""
    hashed = invitations.code_hash(code) if len(code) <= MAX_CODE_CHARS else ""
    request.session[SESSION_KEY] = {"hash": hashed, "at": time.time()}
    return redirect("console:join")


def _opened_hash(request: HttpRequest) -> str | None:
    """The hash of the link this session opened within the hour ("" for a link that was no
    code); None where none was."""
    opened = request.session.get(SESSION_KEY)
    if not isinstance(opened, dict) or time.time() - opened.get("at", 0) > KEPT_SECONDS:
        return None
    return opened.get("hash", "")


@login_required
def join(request: HttpRequest) -> HttpResponse:
    hashed = _opened_hash(request)
    invitation, problem, status = None, "", 200
    try:
        if hashed is None:
            problem = "To join a tenant, open the invitation link you were sent."
        elif request.method == "POST":
            shown = forms.object_id(request.POST.get("invitation_id"))
            if shown is None:
                raise invitations.InvitationInvalid("Accept an invitation from its page.")
            membership = invitations.invitation_accept_by_hash(
                code_hash=hashed, user=request.user, invitation_id=shown
            )
            request.session.pop(SESSION_KEY, None)
            messages.success(
                request,
                f"You joined {membership.tenant.name} as {membership.get_role_display().lower()}.",
            )
            if membership.role == Membership.Role.MEMBER:
                return redirect("chat:home")
            return redirect("console:dashboard", slug=membership.tenant.slug)
        else:
            invitation = invitations.invitation_by_hash(hashed)
    except invitations.InvitationInvalid as exc:
        problem = str(exc)
    if problem and request.method == "POST":
        status = 400
    response = render(
        request, "console/join.html", {"invitation": invitation, "problem": problem}, status=status
    )
    add_never_cache_headers(response)
    return response
