"""Console pages: thin views over ``console.selectors`` (reads) and the tenants and serving
services (writes). Tenant pages need owner/admin, or staff who may view tenants; the platform
page needs such staff; each change, the role or the admin's permission for it
(``console.permissions``).

A view parses the request, makes one service call per action (which holds the rules) and
renders or redirects with a message. An id that names nothing the user may touch is a 404.
"""

import csv
import secrets
from functools import wraps

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_POST

from console import batches_selectors, charts, forms, permissions, selectors, usage
from serving import services as serving_services
from serving.models import ModelDeployment
from tenants import invitations, services
from tenants.models import ApiKey, Invitation, Membership, Tenant
from tenants.selectors import tenant_api_keys, tenant_memberships

REFRESH_SECONDS = 3  # while a model loads or a process restarts, the platform page follows it


def _range_form(request: HttpRequest) -> forms.DateRangeForm:
    return forms.DateRangeForm(request.GET, today=timezone.now().date())


def _refuse(
    request: HttpRequest,
    *filter_forms: forms.DateRangeForm | forms.EndUserForm | forms.AuditFilterForm,
) -> int:
    """Show why a filter was refused (the page shows it unset: the default range, every end
    user); the status."""
    errors = [message for form in filter_forms for message in form.error_messages()]
    for message in errors:
        messages.error(request, message)
    return 400 if errors else 200


def tenant_page(view):
    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, slug: str, *args, **kwargs) -> HttpResponse:
        tenant = permissions.console_tenant(user=request.user, slug=slug)
        return view(request, tenant, *args, **kwargs)

    return wrapper


def platform_page(view):
    """Staff only (others go to the admin's sign-in), and of them those who may view every
    tenant (the others get a 403)."""

    @staff_member_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if not permissions.sees_every_tenant(request.user):
            raise PermissionDenied("Your account may not view the platform's tenants.")
        return view(request, *args, **kwargs)

    return wrapper


@login_required
def home(request: HttpRequest) -> HttpResponse:
    if permissions.sees_every_tenant(request.user):
        return redirect("console:platform")
    tenant = permissions.console_home_tenant(user=request.user)
    if tenant is None:
        raise PermissionDenied("The console is for a tenant's owners and admins.")
    return redirect("console:dashboard", slug=tenant.slug)


def _context(request: HttpRequest, tenant: Tenant | None, **extra) -> dict:
    return {
        "tenant": tenant,
        "tenants": permissions.console_tenants(user=request.user),
        "role": permissions.console_role(user=request.user, tenant=tenant) if tenant else "",
        "can": permissions.allowed(user=request.user, tenant=tenant),
        "sees_platform": permissions.sees_every_tenant(request.user),
        "sees_platform_audit": permissions.may(
            user=request.user, tenant=None, change="read_audit_log"
        ),
        **extra,
    }


def _shown(
    request: HttpRequest, date_range: selectors.DateRange
) -> tuple[selectors.DateRange, str]:
    """The range the page shows and per what (``?period=hour|day``): per hour, the last
    ``MAX_HOURLY_DAYS`` days of a longer range, and the page says so."""
    granularity = usage.granularity_of(date_range, request.GET.get("period"))
    shown = usage.range_shown(date_range, granularity)
    if shown != date_range:
        messages.info(
            request,
            f"Per hour shows {usage.MAX_HOURLY_DAYS} days at most: "
            f"{shown.start.isoformat()} to {shown.end.isoformat()}.",
        )
    return shown, granularity


def _usage_charts(report: usage.UsageReport) -> dict[str, str]:
    labels = report.labels
    return {
        "tokens_chart": charts.stacked_bars(labels, report.tokens_by, "tokens"),
        "requests_chart": charts.stacked_bars(labels, report.requests_by, "requests"),
        "rates_chart": charts.lines(labels, report.rates(), "%"),
        "ttft_chart": charts.lines(labels, report.percentiles("ttft"), "ms"),
        "tpot_chart": charts.lines(labels, report.percentiles("tpot"), "ms"),
        "latency_chart": charts.lines(labels, report.percentiles("latency"), "ms"),
    }


@tenant_page
def dashboard(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    range_form, end_user_form = _range_form(request), forms.EndUserForm(request.GET)
    status = _refuse(request, range_form, end_user_form)
    end_user = end_user_form.end_user_or_none()
    date_range, granularity = _shown(request, range_form.date_range())
    group_by = request.GET.get("group", "model")
    if group_by not in ("model", "key", "source"):
        group_by = "model"
    report = usage.usage_report(
        date_range=date_range,
        tenant=tenant,
        group_by=group_by,
        granularity=granularity,
        end_user=end_user,
    )
    return render(
        request,
        "console/dashboard.html",
        _context(
            request,
            tenant,
            date_range=date_range,
            group_by=group_by,
            granularity=granularity,
            end_user=end_user,
            summary=report,
            **_usage_charts(report),
            quota_rows=selectors.quota_rows(tenant=tenant),
            batch_usage=batches_selectors.batch_usage(
                date_range=date_range, tenant=tenant, end_user=end_user
            ),
        ),
        status=status,
    )


@tenant_page
def usage_csv(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    range_form, end_user_form = _range_form(request), forms.EndUserForm(request.GET)
    if range_form.errors or end_user_form.errors:
        messages = range_form.error_messages() + end_user_form.error_messages()
        return HttpResponseBadRequest("\n".join(messages), content_type="text/plain")
    date_range, end_user = range_form.date_range(), end_user_form.end_user_or_none()
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    filename = f"usage-{tenant.slug}-{date_range.start}-{date_range.end}.csv"
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response.write("\ufeff")  # a byte-order mark: Excel reads UTF-8 (a key's name) as such
    writer = csv.writer(response)
    writer.writerow(selectors.USAGE_CSV_HEADER)
    rows = usage.usage_csv_rows(date_range=date_range, tenant=tenant, end_user=end_user)
    writer.writerows([_spreadsheet_cell(cell) for cell in row] for row in rows)
    return response


# what a spreadsheet reads as the start of a formula (OWASP's CSV injection)
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _spreadsheet_cell(cell: object) -> object:
    """A text cell a spreadsheet would run as a formula (a key's name is the tenant's to
    choose), kept text by a leading quote; other cells as they are."""
    if isinstance(cell, str) and cell.startswith(_FORMULA_STARTS):
        return "'" + cell
    return cell


@tenant_page
def keys(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    """The tenant's keys; a new key's secret is shown on the answer to its creation only,
    which no cache keeps (``Cache-Control: no-store``). The creation form carries a one-time
    token: the browser's "reload" sends it again, and that made a second key."""
    new_key, form, status = None, forms.ApiKeyCreateForm(), 200
    action = request.POST.get("action") if request.method == "POST" else None
    if action == "create":
        permissions.require(user=request.user, tenant=tenant, change="create_key")
        form = forms.ApiKeyCreateForm(request.POST)
        if not _spend_form_token(request, request.POST.get("form_token", "")):
            messages.error(request, "That key was created already (its secret is shown only once).")
            return redirect("console:keys", slug=tenant.slug)
        if form.is_valid():
            api_key, new_key = services.api_key_issue(
                tenant=tenant,
                name=form.cleaned_data["name"],
                created_by=request.user,
                expires_in_days=form.cleaned_data["expires_in_days"],
            )
            form = forms.ApiKeyCreateForm()
            messages.success(request, f"Created the key {api_key.display_prefix}: copy it below.")
        else:
            status = 400
    elif action == "revoke":
        permissions.require(user=request.user, tenant=tenant, change="revoke_key")
        key_id = forms.object_id(request.POST.get("key_id"))
        try:
            api_key = services.api_key_revoke_by_id(
                tenant=tenant, api_key_id=key_id, actor=request.user
            )
        except ApiKey.DoesNotExist:
            raise Http404("No such key") from None
        messages.success(request, f"Revoked {api_key.display_prefix}.")
        return redirect("console:keys", slug=tenant.slug)
    response = render(
        request,
        "console/keys.html",
        _context(
            request,
            tenant,
            keys=tenant_api_keys(tenant=tenant),
            new_key=new_key,
            form=form,
            form_token=secrets.token_urlsafe(16),
        ),
        status=status,
    )
    add_never_cache_headers(response)
    return response


# how many creation forms' tokens a session remembers as spent
SPENT_FORM_TOKENS = 20
SPENT_FORM_TOKENS_KEY = "console_spent_form_tokens"


def _spend_form_token(request: HttpRequest, token: str) -> bool:
    """Mark a form's one-time token spent; False when it was already (a form sent again)."""
    spent = request.session.get(SPENT_FORM_TOKENS_KEY, [])
    if token and token in spent:
        return False
    if token:
        request.session[SPENT_FORM_TOKENS_KEY] = [*spent, token][-SPENT_FORM_TOKENS:]
    return True


@tenant_page
def members(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    """The tenant's members and open invitations. A new invitation's link is shown on the
    answer to its making only, which no cache keeps (as a new key's secret); its form
    carries a one-time token, so that a reload makes no second invitation."""
    new_link, form, status = None, forms.InvitationCreateForm(), 200
    if request.method == "POST":
        permissions.require(user=request.user, tenant=tenant, change="manage_members")
        action = request.POST.get("action")
        try:
            if action == "invite":
                form = forms.InvitationCreateForm(request.POST)
                if not _spend_form_token(request, request.POST.get("form_token", "")):
                    messages.error(
                        request, "That invitation was made already (its link is shown once)."
                    )
                    return redirect("console:members", slug=tenant.slug)
                if form.is_valid():
                    new_link = _invite(request, tenant, form)
                    form = forms.InvitationCreateForm()
                else:
                    status = 400
            else:
                _change_members(request, tenant, action)
                return redirect("console:members", slug=tenant.slug)
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
            return redirect("console:members", slug=tenant.slug)
        except (Membership.DoesNotExist, Invitation.DoesNotExist):
            raise Http404("No such member or invitation") from None
    giveable = _giveable_roles(request, tenant)
    response = render(
        request,
        "console/members.html",
        _context(
            request,
            tenant,
            memberships=tenant_memberships(tenant=tenant),
            invitations=invitations.tenant_invitations_open(tenant=tenant),
            roles=Membership.Role.choices,
            giveable_roles=giveable,
            giveable_values=[value for value, _ in giveable],
            form=form,
            form_token=secrets.token_urlsafe(16),
            new_link=new_link,
        ),
        status=status,
    )
    add_never_cache_headers(response)
    return response


def _giveable_roles(request: HttpRequest, tenant: Tenant) -> list[tuple[str, str]]:
    """The roles this user may invite to (and revoke invitations to): an admin's are not
    an owner's."""
    giveable = []
    for value, label in Membership.Role.choices:
        try:
            services.role_give_check(tenant=tenant, actor=request.user, role=value)
        except ValidationError:
            continue
        giveable.append((value, label))
    return giveable


def _invite(request: HttpRequest, tenant: Tenant, form: forms.InvitationCreateForm) -> str:
    invitation, code = invitations.invitation_create(
        tenant=tenant,
        role=form.cleaned_data["role"],
        actor=request.user,
        expires_in_days=form.cleaned_data["expires_in_days"],
        note=form.cleaned_data["note"],
    )
    messages.success(
        request,
        f"Made an invitation to join as {invitation.get_role_display().lower()}: copy its link "
        "below and send it to the person you invite.",
    )
    return request.build_absolute_uri(reverse("console:join-link", args=[code]))


def _change_members(request: HttpRequest, tenant: Tenant, action: str | None) -> None:
    """Who may change whom is decided by the tenants services (also for the admin)."""
    role = request.POST.get("role", Membership.Role.MEMBER)
    membership_id = forms.object_id(request.POST.get("membership_id"))
    if action == "role":
        membership = services.membership_change_role_by_id(
            tenant=tenant, membership_id=membership_id, role=role, actor=request.user
        )
        messages.success(request, f"{membership.user.get_username()} is now {membership.role}.")
    elif action == "remove":
        services.membership_remove_by_id(
            tenant=tenant, membership_id=membership_id, actor=request.user
        )
        messages.success(request, f"The member was removed from {tenant.name}.")
    elif action == "revoke_invitation":
        invitation_id = forms.object_id(request.POST.get("invitation_id"))
        invitations.invitation_revoke_by_id(
            tenant=tenant, invitation_id=invitation_id, actor=request.user
        )
        messages.success(request, "The invitation was revoked: its link no longer works.")
    else:
        raise ValidationError("Unknown action.")


@platform_page
def platform(request: HttpRequest) -> HttpResponse:
    range_form = _range_form(request)
    status = _refuse(request, range_form)
    date_range, granularity = _shown(request, range_form.date_range())
    report = usage.usage_report(date_range=date_range, group_by="tenant", granularity=granularity)
    by_model = usage.usage_report(date_range=date_range, group_by="model", granularity="day")
    tenant_rows = selectors.tenant_rows()
    deployments = selectors.deployments_list()
    processes = selectors.supervised_processes()
    is_changing = (
        selectors.deployments_changing(deployments=deployments)
        or any(d.health == ModelDeployment.Health.UNKNOWN for d in deployments if d.is_enabled)
        or not all(process.is_running for process in processes)
    )
    return render(
        request,
        "console/platform.html",
        _context(
            request,
            None,
            date_range=date_range,
            granularity=granularity,
            summary=report,
            **_usage_charts(report),
            tenant_rows=tenant_rows,
            model_load=by_model.rows,
            batch_usage=batches_selectors.batch_usage(date_range=date_range),
            fairness=usage.fairness_rows(date_range=date_range),
            deployments=deployments,
            processes=processes,
            refresh_seconds=REFRESH_SECONDS if is_changing else None,
        ),
        status=status,
    )


@platform_page
@require_POST
def deployment_action(request: HttpRequest) -> HttpResponse:
    action = request.POST.get("action")
    change = "register_deployment" if action == "register" else "control_deployment"
    permissions.require(user=request.user, tenant=None, change=change)
    if action == "register" and selectors.deployment_exists(name=request.POST.get("name", "")):
        # registering a name that is taken rewrites that deployment: a change of it
        permissions.require(user=request.user, tenant=None, change="control_deployment")
    deployment_id = forms.object_id(request.POST.get("deployment_id"))
    try:
        if action == "register":
            endpoints = request.POST.get("endpoints", "").split()
            deployment = serving_services.deployment_register(
                name=request.POST.get("name", "").strip(), endpoints=endpoints, actor=request.user
            )
            messages.success(request, f"Registered {deployment.name}: checking its replicas…")
        elif action in ("load", "unload"):
            endpoint = request.POST.get("endpoint", "")
            serving_services.deployment_control_request(
                deployment_id=deployment_id,
                endpoint=endpoint,
                action=action,
                model=request.POST.get("model"),
                actor=request.user,
            )
            messages.success(request, f"{action.title()} requested on {endpoint}.")
        elif action in ("enable", "disable"):
            deployment = serving_services.deployment_set_enabled(
                deployment_id=deployment_id, is_enabled=action == "enable", actor=request.user
            )
            messages.success(request, f"{deployment.name} is {action}d.")
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    except serving_services.ControlNotQueued as exc:
        messages.error(request, str(exc))
    except ModelDeployment.DoesNotExist:
        raise Http404("No such deployment") from None
    return redirect("console:platform")
