"""Accepting an invitation (``tenants.invitations``): its link, ``/console/join/<code>/``,
puts the code in the session and leads on to ``/console/join/``, which asks the person to
sign in (the code never travels in a ``next`` address or a later page's Referer), shows the
tenant and the role, and takes the acceptance."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers
from django.views.decorators.cache import never_cache

from tenants import invitations
from tenants.models import Membership

SESSION_CODE_KEY = "invitation_code"
# a code is a few dozen characters; anything much longer is not one, and is not kept
MAX_CODE_CHARS = 128


@never_cache
def join_link(request: HttpRequest, code: str) -> HttpResponse:
    """The invitation's link: its code kept in the session, and on to the page that shows it."""
    if len(code) <= MAX_CODE_CHARS:
        request.session[SESSION_CODE_KEY] = code
    return redirect("console:join")


@login_required
def join(request: HttpRequest) -> HttpResponse:
    code = request.session.get(SESSION_CODE_KEY, "")
    invitation, problem, status = None, "", 200
    try:
        if request.method == "POST":
            membership = invitations.invitation_accept(code=code, user=request.user)
            request.session.pop(SESSION_CODE_KEY, None)
            messages.success(
                request,
                f"You joined {membership.tenant.name} as {membership.get_role_display().lower()}.",
            )
            if membership.role == Membership.Role.MEMBER:
                return redirect("chat:home")
            return redirect("console:dashboard", slug=membership.tenant.slug)
        invitation = invitations.invitation_by_code(code) if code else None
    except invitations.InvitationInvalid as exc:
        problem, status = str(exc), 400 if request.method == "POST" else 200
    if not code and not problem:
        problem = "To join a tenant, open the invitation link you were sent."
    response = render(
        request,
        "console/join.html",
        {"invitation": invitation, "problem": problem},
        status=status,
    )
    add_never_cache_headers(response)
    return response
