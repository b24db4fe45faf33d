"""Who may open which console, and do what there.

A tenant's owners and admins see and manage that tenant by their role; members get no
console. Staff hold the powers the admin's permissions give them, no more: viewing tenants
(``tenants.view_tenant``) opens every tenant's pages and the platform page; each change asks
for the permission the admin asks for the same change (``CHANGES``). Superusers hold every
permission.
"""

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404

from tenants.models import Membership, Tenant

MANAGER_ROLES = (Membership.Role.OWNER, Membership.Role.ADMIN)
SEE_TENANTS = "tenants.view_tenant"
SEE_AUDIT_LOG = "tenants.view_auditevent"
# what a change in the console is, by the admin's permission for it
CHANGES = {
    "create_key": "tenants.add_apikey",
    "revoke_key": "tenants.change_apikey",
    "manage_members": "tenants.change_membership",
    "cancel_batch": "batches.change_batch",
    "read_batch_files": "batches.view_file",
    "register_deployment": "serving.add_modeldeployment",
    "control_deployment": "serving.change_modeldeployment",
    "read_audit_log": SEE_AUDIT_LOG,
}


def sees_every_tenant(user: AbstractBaseUser) -> bool:
    return user.is_staff and user.has_perm(SEE_TENANTS)


def console_tenants(*, user: AbstractBaseUser) -> QuerySet[Tenant]:
    if sees_every_tenant(user):
        return Tenant.objects.all().order_by("slug")
    # a deactivated tenant is staff's alone to see: its managers neither make keys nor
    # change members nor download its files (its API keys are refused already)
    return Tenant.objects.filter(
        memberships__user=user, memberships__role__in=MANAGER_ROLES, is_active=True
    ).order_by("slug")


def console_home_tenant(*, user: AbstractBaseUser) -> Tenant | None:
    """The tenant the console opens on for a tenant's manager; None for anybody else."""
    return console_tenants(user=user).first()


def console_tenant(*, user: AbstractBaseUser, slug: str) -> Tenant:
    """The tenant if the user may manage it; 404 otherwise (existence is not revealed)."""
    tenant = console_tenants(user=user).select_related("plan").filter(slug=slug).first()
    if tenant is None:
        raise Http404("No such tenant")
    return tenant


def console_role(*, user: AbstractBaseUser, tenant: Tenant) -> str:
    membership = Membership.objects.filter(user=user, tenant=tenant).first()
    if membership is not None:
        return membership.role
    return "staff" if user.is_staff else ""


def _is_manager(user: AbstractBaseUser, tenant: Tenant | None) -> bool:
    return (
        tenant is not None
        and Membership.objects.filter(user=user, tenant=tenant, role__in=MANAGER_ROLES).exists()
    )


def may(*, user: AbstractBaseUser, tenant: Tenant | None, change: str) -> bool:
    """Whether ``user`` may make ``change`` (a key of ``CHANGES``) in ``tenant`` (None: on the
    platform pages, which are staff's only)."""
    return _is_manager(user, tenant) or (user.is_staff and user.has_perm(CHANGES[change]))


def require(*, user: AbstractBaseUser, tenant: Tenant | None, change: str) -> None:
    """Raise ``PermissionDenied`` (a 403) unless ``may``."""
    if not may(user=user, tenant=tenant, change=change):
        raise PermissionDenied(f"Your account may not {change.replace('_', ' ')} here.")


def allowed(*, user: AbstractBaseUser, tenant: Tenant | None) -> dict[str, bool]:
    """Every change's ``may``, for a page to offer only what its user may do."""
    is_manager = _is_manager(user, tenant)
    return {
        change: is_manager or (user.is_staff and user.has_perm(permission))
        for change, permission in CHANGES.items()
    }
