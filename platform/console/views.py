"""Console pages: thin views over ``console.selectors`` (reads) and the tenants and serving
services (writes). Tenant pages need owner/admin (or staff); the platform page needs staff."""

import csv
from functools import wraps

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from console import charts, forms, permissions, selectors
from serving.models import ModelDeployment
from serving.services import deployment_register
from serving.tasks import control_engine
from tenants import quotas, services
from tenants.models import ApiKey, Membership, Tenant
from tenants.selectors import tenant_api_keys, tenant_limits


def _range_form(request: HttpRequest) -> forms.DateRangeForm:
    return forms.DateRangeForm(request.GET, today=timezone.now().date())


def _refuse_range(request: HttpRequest, form: forms.DateRangeForm) -> int:
    """Show why the range was refused (the page shows the default range); the status."""
    for message in form.error_messages():
        messages.error(request, message)
    return 400


def tenant_page(view):
    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, slug: str, *args, **kwargs) -> HttpResponse:
        tenant = permissions.console_tenant(user=request.user, slug=slug)
        return view(request, tenant, *args, **kwargs)

    return wrapper


@login_required
def home(request: HttpRequest) -> HttpResponse:
    tenant = permissions.console_tenants(user=request.user).first()
    if request.user.is_staff:
        return redirect("console:platform")
    if tenant is None:
        raise PermissionDenied("The console is for a tenant's owners and admins.")
    return redirect("console:dashboard", slug=tenant.slug)


def _context(request: HttpRequest, tenant: Tenant | None, **extra) -> dict:
    return {
        "tenant": tenant,
        "tenants": permissions.console_tenants(user=request.user),
        "role": permissions.console_role(user=request.user, tenant=tenant) if tenant else "",
        **extra,
    }


@tenant_page
def dashboard(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    range_form = _range_form(request)
    status = _refuse_range(request, range_form) if range_form.errors else 200
    date_range = range_form.date_range()
    group_by = request.GET.get("group", "model")
    if group_by not in ("model", "key"):
        group_by = "model"
    summary = selectors.usage_summary(date_range=date_range, tenant=tenant, group_by=group_by)
    usage = quotas.quota_usage(tenant=tenant)
    limits = tenant_limits(tenant=tenant)
    quota_rows = [
        ("Requests / minute", usage.requests_this_minute, limits.requests_per_minute),
        ("Tokens / minute", usage.tokens_this_minute, limits.tokens_per_minute),
        ("Concurrent requests", usage.concurrent_requests, limits.max_concurrent_requests),
        ("Tokens this month", usage.month_tokens, limits.monthly_token_budget),
    ]
    return render(
        request,
        "console/dashboard.html",
        _context(
            request,
            tenant,
            date_range=date_range,
            group_by=group_by,
            summary=summary,
            tokens_chart=charts.stacked_bars(summary.days, summary.tokens_by, "tokens"),
            requests_chart=charts.stacked_bars(summary.days, summary.requests_by, "requests"),
            quota_rows=[
                (name, round(used or 0), limit, _share(used, limit))
                for name, used, limit in quota_rows
            ],
        ),
        status=status,
    )


def _share(used: float | None, limit: int | None) -> int | None:
    if not limit:
        return None
    return min(100, round(100 * (used or 0) / limit))


@tenant_page
def usage_csv(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    range_form = _range_form(request)
    if range_form.errors:
        return HttpResponseBadRequest(
            "\n".join(range_form.error_messages()), content_type="text/plain"
        )
    date_range = range_form.date_range()
    response = HttpResponse(content_type="text/csv")
    filename = f"usage-{tenant.slug}-{date_range.start}-{date_range.end}.csv"
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    writer = csv.writer(response)
    writer.writerow(
        ["date", "model", "source", "api_key", "requests", "prompt_tokens",
         "completion_tokens", "cached_tokens", "errors"]
    )  # fmt: skip
    writer.writerows(selectors.usage_csv_rows(date_range=date_range, tenant=tenant))
    return response


@tenant_page
def keys(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    new_key, form, status = None, forms.ApiKeyCreateForm(), 200
    if request.method == "POST":
        action = request.POST.get("action")
        if action == "create":
            form = forms.ApiKeyCreateForm(request.POST)
            if form.is_valid():
                expires_at = services.api_key_expires_at(days=form.cleaned_data["expires_in_days"])
                _, new_key = services.api_key_create(
                    tenant=tenant,
                    name=form.cleaned_data["name"] or "unnamed",
                    created_by=request.user,
                    expires_at=expires_at,
                )
                form = forms.ApiKeyCreateForm()
            else:
                status = 400
        elif action == "revoke":
            key_id = forms.object_id(request.POST.get("key_id"))
            api_key = get_object_or_404(ApiKey, pk=key_id, tenant=tenant)
            services.api_key_revoke(api_key=api_key)
            messages.success(request, f"Revoked {api_key.display_prefix}.")
            return redirect("console:keys", slug=tenant.slug)
    return render(
        request,
        "console/keys.html",
        _context(request, tenant, keys=tenant_api_keys(tenant=tenant), new_key=new_key, form=form),
        status=status,
    )


@tenant_page
def members(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    if request.method == "POST":
        try:
            _change_members(request, tenant)
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
        return redirect("console:members", slug=tenant.slug)
    memberships = Membership.objects.filter(tenant=tenant).select_related("user")
    return render(
        request,
        "console/members.html",
        _context(
            request,
            tenant,
            memberships=memberships.order_by("user__username"),
            roles=Membership.Role.choices,
        ),
    )


def _change_members(request: HttpRequest, tenant: Tenant) -> None:
    """Who may change whom is decided by the tenants services (also for the admin)."""
    action = request.POST.get("action")
    role = request.POST.get("role", Membership.Role.MEMBER)
    if action == "add":
        username = request.POST.get("username", "").strip()
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise ValidationError(f"No user named {username!r}.")
        services.membership_set(tenant=tenant, user=user, role=role, actor=request.user)
        messages.success(request, f"{username} is now {role}.")
        return
    membership_id = forms.object_id(request.POST.get("membership_id"))
    membership = get_object_or_404(Membership, pk=membership_id, tenant=tenant)
    if action == "role":
        services.membership_change_role(membership=membership, role=role, actor=request.user)
    elif action == "remove":
        services.membership_remove(membership=membership, actor=request.user)


@staff_member_required
def platform(request: HttpRequest) -> HttpResponse:
    range_form = _range_form(request)
    status = _refuse_range(request, range_form) if range_form.errors else 200
    date_range = range_form.date_range()
    summary = selectors.usage_summary(date_range=date_range, group_by="tenant")
    deployments = list(ModelDeployment.objects.order_by("name"))
    return render(
        request,
        "console/platform.html",
        _context(
            request,
            None,
            date_range=date_range,
            summary=summary,
            tokens_chart=charts.stacked_bars(summary.days, summary.tokens_by, "tokens"),
            top_tenants=selectors.top_tenants(date_range=date_range),
            model_load=selectors.model_load(date_range=date_range),
            deployments=deployments,
            # follow a load or unload as it goes: the page refreshes until it is done
            refresh_seconds=3 if any(_is_changing(d) for d in deployments) else None,
        ),
        status=status,
    )


def _is_changing(deployment: ModelDeployment) -> bool:
    return any(
        state.get("state") == "loading" or state.get("control", {}).get("state") == "sent"
        for state in (deployment.replicas or {}).values()
    )


@staff_member_required
@require_POST
def deployment_action(request: HttpRequest) -> HttpResponse:
    action = request.POST.get("action")
    try:
        if action == "register":
            endpoints = request.POST.get("endpoints", "").split()
            deployment_register(name=request.POST.get("name", "").strip(), endpoints=endpoints)
        elif action in ("load", "unload"):
            deployment = get_object_or_404(
                ModelDeployment, pk=forms.object_id(request.POST.get("deployment_id"))
            )
            endpoint = request.POST.get("endpoint", "")
            if endpoint not in deployment.endpoints:
                raise ValidationError(f"{endpoint!r} is not a replica of {deployment.name}.")
            model = request.POST.get("model", "").strip() or None
            if action == "load" and not model:
                raise ValidationError("Give the model directory to load.")
            control_engine.delay(deployment.pk, endpoint, action, model)
            messages.success(request, f"{action.title()} requested on {endpoint}.")
        elif action in ("enable", "disable"):
            deployment = get_object_or_404(
                ModelDeployment, pk=forms.object_id(request.POST.get("deployment_id"))
            )
            deployment.is_enabled = action == "enable"
            deployment.save(update_fields=["is_enabled"])
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    return redirect("console:platform")
