"""Plans stored before their form checked ``allowed_models``: one name as a string becomes a
list of it (it was read letter by letter: no model found), a list keeps its names. Anything
else is left for an admin to correct: it opens no model (``serving.selectors``)."""

from django.db import migrations


def names_as_lists(apps, schema_editor):
    Plan = apps.get_model("tenants", "Plan")
    for plan in Plan.objects.all():
        allowed = plan.allowed_models
        if isinstance(allowed, str):
            names = [allowed] if allowed.strip() else []
        elif isinstance(allowed, list):
            names = [name for name in allowed if isinstance(name, str) and name.strip()]
            if allowed and not names:
                continue  # e.g. [1, 2]: nothing to keep, and [] would open every model
        else:
            continue
        if names != allowed:
            plan.allowed_models = names
            plan.save(update_fields=["allowed_models"])


class Migration(migrations.Migration):
    dependencies = [("tenants", "0011_plan_allowed_models_names")]

    operations = [migrations.RunPython(names_as_lists, migrations.RunPython.noop)]
