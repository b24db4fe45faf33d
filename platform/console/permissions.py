"""Who may open which console: staff see every tenant and the platform console; a tenant's
owners and admins see that tenant only; members get no console."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet
from django.http import Http404

from tenants.models import Membership, Tenant

MANAGER_ROLES = (Membership.Role.OWNER, Membership.Role.ADMIN)


def console_tenants(*, user: AbstractBaseUser) -> QuerySet[Tenant]:
    if user.is_staff:
        return Tenant.objects.all().order_by("slug")
    return Tenant.objects.filter(
        memberships__user=user, memberships__role__in=MANAGER_ROLES
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
