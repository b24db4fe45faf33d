from django.db import migrations

DEFAULT_PLAN = {
    "slug": "default",
    "name": "Default",
    "requests_per_minute": 60,
    "tokens_per_minute": 100_000,
    "max_concurrent_requests": 8,
    "monthly_token_budget": 10_000_000,
}


def create_default_plan(apps, schema_editor):
    Plan = apps.get_model("tenants", "Plan")
    Plan.objects.get_or_create(slug=DEFAULT_PLAN["slug"], defaults=DEFAULT_PLAN)


class Migration(migrations.Migration):
    dependencies = [("tenants", "0001_initial")]

    operations = [migrations.RunPython(create_default_plan, migrations.RunPython.noop)]
