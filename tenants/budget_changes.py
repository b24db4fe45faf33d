"""A monthly budget set where there was none brings the month's token counter up to date.

A scope (a tenant or a key) without a monthly budget keeps no token counter up to date
(``tenants.quotas``: admission counts nothing against a budget it does not have), so a
counter left from before its budget was taken off misses what was used meanwhile. Once a
budget was back, that stale counter admitted the tenant past it, and the console showed its
figure as the month's use. So a save that changes a scope's budget (the plan's, the
tenant's own, the key's, or which plan a tenant is on) to one rebuilds that scope's counter
after the commit (``quotas.month_counters_rebuild``: the records plus what requests in
flight hold, so that they stay counted). A save that changes no budget touches no counter.
"""

from django.db import transaction
from django.db.models.signals import post_save, pre_save

from tenants import quotas
from tenants.models import ApiKey, Plan, Tenant


def _effective_budget(tenant_budget: int | None, plan_budget: int | None) -> int | None:
    return tenant_budget if tenant_budget is not None else plan_budget


def _tenant_before(instance: Tenant, **kwargs) -> None:
    before = (
        Tenant.objects.filter(pk=instance.pk)
        .values_list("monthly_token_budget", "plan__monthly_token_budget")
        .first()
    )
    instance._budget_before = _effective_budget(*before) if before else None


def _tenant_saved(instance: Tenant, created: bool, **kwargs) -> None:
    budget = _effective_budget(instance.monthly_token_budget, instance.plan.monthly_token_budget)
    if not created and budget is not None and budget != instance._budget_before:
        transaction.on_commit(lambda: quotas.month_counters_rebuild(tenant=instance))


def _own_budget_before(
    sender: type[Plan] | type[ApiKey], instance: Plan | ApiKey, **kwargs
) -> None:
    instance._budget_before = (
        sender.objects.filter(pk=instance.pk).values_list("monthly_token_budget", flat=True).first()
    )


def _plan_saved(instance: Plan, created: bool, **kwargs) -> None:
    budget = instance.monthly_token_budget
    if created or budget is None or budget == instance._budget_before:
        return
    # the plan's budget is theirs where they have none of their own
    tenants = list(Tenant.objects.filter(plan=instance, monthly_token_budget=None))

    def rebuild() -> None:
        for tenant in tenants:
            quotas.month_counters_rebuild(tenant=tenant)

    transaction.on_commit(rebuild)


def _api_key_saved(instance: ApiKey, created: bool, **kwargs) -> None:
    budget = instance.monthly_token_budget
    if not created and budget is not None and budget != instance._budget_before:
        transaction.on_commit(
            lambda: quotas.month_counters_rebuild(tenant=instance.tenant, api_key=instance)
        )


def connect_signals() -> None:
    """Called once from the app's ``ready()``."""
    for model, before, saved in (
        (Tenant, _tenant_before, _tenant_saved),
        (Plan, _own_budget_before, _plan_saved),
        (ApiKey, _own_budget_before, _api_key_saved),
    ):
        name = model.__name__
        pre_save.connect(before, sender=model, dispatch_uid=f"budget-{name}-before")
        post_save.connect(saved, sender=model, dispatch_uid=f"budget-{name}-saved")
