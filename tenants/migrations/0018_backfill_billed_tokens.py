"""What the usage recorded before 0017 is billed as, which no record kept: a batch line's tokens
at the ``batch_price_factor`` of its tenant's plan of now, every other token one. The plan a
past record was used under is nowhere recorded, so the current one is the best available (it
is what the console billed them at until now); from here on each record keeps its own. The
roll-ups get the same sum their records have."""

from django.db import migrations, models
from django.db.models import ExpressionWrapper, F, Value

BILLED = models.DecimalField(max_digits=22, decimal_places=2)


def bill_at_the_current_plans(apps, schema_editor):
    Plan = apps.get_model("tenants", "Plan")
    for name in ("UsageRecord", "UsageRollup"):
        rows = apps.get_model("tenants", name).objects
        tokens = F("prompt_tokens") + F("completion_tokens")
        rows.exclude(source="batch").update(billed_tokens=ExpressionWrapper(tokens, BILLED))
        for plan in Plan.objects.all():
            factor = Value(plan.batch_price_factor, output_field=BILLED)
            rows.filter(source="batch", tenant__plan=plan).update(
                billed_tokens=ExpressionWrapper(tokens * factor, BILLED)
            )


class Migration(migrations.Migration):
    dependencies = [("tenants", "0017_usage_billed_tokens")]

    operations = [migrations.RunPython(bill_at_the_current_plans, migrations.RunPython.noop)]
