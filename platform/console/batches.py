"""The console's Batches page: a tenant's batches with their progress and counts, their
output and error files to download, and cancel after a confirmation. Thin views over
``console.batches_selectors`` and ``batches.services``; who may see a tenant is the rest of
the console's rule (``console.views.tenant_page``)."""

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import path

from batches import selectors, services
from batches.models import Batch, File
from console import batches_selectors, permissions
from console.views import _context, tenant_page
from tenants.models import Tenant

REFRESH_SECONDS = 5  # while a batch runs, its page follows it


@tenant_page
def batches(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    """The tenant's batches, newest first, paged by ``PAGE_SIZE`` (the newest 50 were all
    there was: an older batch could be neither cancelled nor downloaded here)."""
    page = Paginator(
        batches_selectors.tenant_batches(tenant=tenant), batches_selectors.PAGE_SIZE
    ).get_page(request.GET.get("page"))
    rows = batches_selectors.batch_rows(page)
    return render(
        request,
        "console/batches.html",
        _context(
            request,
            tenant,
            rows=rows,
            page=page,
            refresh_seconds=REFRESH_SECONDS if any(row.is_active for row in rows) else None,
        ),
    )


def _batch(tenant: Tenant, batch_id: str) -> Batch:
    try:
        return selectors.batch_get(tenant_id=tenant.pk, batch_id=batch_id)
    except Batch.DoesNotExist:
        raise Http404("No such batch") from None


@tenant_page
def batch_cancel(request: HttpRequest, tenant: Tenant, batch_id: str) -> HttpResponse:
    """GET asks to confirm; POST cancels: lines not yet started are not run."""
    permissions.require(user=request.user, tenant=tenant, change="cancel_batch")
    batch = _batch(tenant, batch_id)
    if request.method != "POST":
        return render(
            request, "console/batches_cancel.html", _context(request, tenant, batch=batch)
        )
    try:
        batch = services.batch_cancel(batch=batch, actor=request.user)
    except services.Conflict as exc:
        messages.error(request, exc.message)
    else:
        if batch.status == Batch.Status.CANCELLED:
            messages.success(request, f"Cancelled {batch.id}.")
        else:
            messages.success(request, f"Cancelling {batch.id}: lines already running finish.")
    return redirect("console:batches", slug=tenant.slug)


@tenant_page
def batch_file(request: HttpRequest, tenant: Tenant, file_id: str) -> FileResponse:
    permissions.require(user=request.user, tenant=tenant, change="read_batch_files")
    try:
        file = selectors.file_get(tenant_id=tenant.pk, file_id=file_id)
        stream = selectors.file_open(file=file)
    except File.DoesNotExist:
        raise Http404("No such file") from None
    return FileResponse(
        stream,
        as_attachment=True,
        filename=file.filename,
        content_type="application/jsonl",
    )


urlpatterns = [
    path("", batches, name="batches"),
    path("<str:batch_id>/cancel/", batch_cancel, name="batch-cancel"),
    path("files/<str:file_id>/", batch_file, name="batch-file"),
]
