"""A change of monthly budgets drops the month's token counters it touches.

A scope (a tenant or a key) without a monthly budget keeps no token counter up to date
(``tenants.quotas``: admission counts nothing against a budget it does not have), so a
counter left from before its budget was taken off misses what was used meanwhile. Once a
budget is back, that stale counter admitted the tenant past it, and the console showed its
figure as the month's use. So saving a tenant, a plan or a key (anything that may set or
clear a budget: the plan's, the tenant's own, the key's, or which plan a tenant is on)
drops the counters of the scopes it governs, after the commit; the next admission under a
budget builds each again from the usage records.
"""

from collections.abc import Iterable

from django.db import transaction
from django.db.models.signals import post_save

from tenants import quotas
from tenants.models import ApiKey, Plan, Tenant

# a save of only these fields sets no budget
BUDGET_FIELDS = frozenset({"monthly_token_budget", "plan"})


def _may_change_budget(update_fields: Iterable[str] | None) -> bool:
    return update_fields is None or not BUDGET_FIELDS.isdisjoint(update_fields)


def _forget_later(**scopes: list[int]) -> None:
    transaction.on_commit(lambda: quotas.month_counters_forget(**scopes))


def _tenant_saved(instance: Tenant, created: bool, update_fields=None, **kwargs) -> None:
    if not created and _may_change_budget(update_fields):
        _forget_later(tenant_ids=[instance.pk])


def _plan_saved(instance: Plan, created: bool, update_fields=None, **kwargs) -> None:
    if not created and _may_change_budget(update_fields):
        tenant_ids = list(Tenant.objects.filter(plan=instance).values_list("pk", flat=True))
        _forget_later(tenant_ids=tenant_ids)


def _api_key_saved(instance: ApiKey, created: bool, update_fields=None, **kwargs) -> None:
    if not created and _may_change_budget(update_fields):
        _forget_later(api_key_ids=[instance.pk])


def connect_signals() -> None:
    """Called once from the app's ``ready()``."""
    post_save.connect(_tenant_saved, sender=Tenant, dispatch_uid="budget-tenant-save")
    post_save.connect(_plan_saved, sender=Plan, dispatch_uid="budget-plan-save")
    post_save.connect(_api_key_saved, sender=ApiKey, dispatch_uid="budget-api-key-save")
