from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants, plans, keys and usage"

    def ready(self) -> None:
        from tenants import budget_changes

        budget_changes.connect_signals()
