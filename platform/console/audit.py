"""The console's audit log pages: a tenant's (its owners and admins see who changed its keys
and members, and what staff changed in it) and the platform's (staff: every event). Thin
views over ``console.audit_selectors``."""

from django.contrib.admin.views.decorators import staff_member_required
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import path
from django.utils import timezone

from console import audit_selectors, forms, permissions
from console.views import _context, _refuse, tenant_page
from tenants.models import AuditEvent, Tenant

PAGE_SIZE = 50


@tenant_page
def tenant_audit(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    permissions.require(user=request.user, tenant=tenant, change="read_audit_log")
    events = audit_selectors.tenant_audit_events(tenant=tenant)
    return _audit_page(request, tenant, events, audit_selectors.TENANT_ACTIONS)


@staff_member_required
def platform_audit(request: HttpRequest) -> HttpResponse:
    permissions.require(user=request.user, tenant=None, change="read_audit_log")
    events = audit_selectors.platform_audit_events()
    return _audit_page(request, None, events, AuditEvent.Action.choices)


def _audit_page(
    request: HttpRequest,
    tenant: Tenant | None,
    events: QuerySet[AuditEvent],
    actions: list[tuple[str, str]],
) -> HttpResponse:
    form = forms.AuditFilterForm(request.GET, actions=actions, today=timezone.now().date())
    status = _refuse(request, form)
    filters = form.filters()
    page = Paginator(audit_selectors.audit_filter(events, **filters), PAGE_SIZE).get_page(
        request.GET.get("page")
    )
    return render(
        request,
        "console/audit.html",
        _context(
            request,
            tenant,
            form=form,
            filters=filters,
            actions=actions,
            page=page,
            rows=audit_selectors.audit_rows(list(page), tenant=tenant),
        ),
        status=status,
    )


urlpatterns = [
    path("platform/audit/", platform_audit, name="platform-audit"),
    path("t/<slug:slug>/audit/", tenant_audit, name="audit"),
]
