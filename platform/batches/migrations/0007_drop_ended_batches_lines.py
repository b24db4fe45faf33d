"""The lines of batches that ended before their lines went with their end: their prompts and
answers are in the batches' files (or in files the tenant deleted)."""

from django.db import migrations

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


def drop_ended_batches_lines(apps, schema_editor):
    BatchRequest = apps.get_model("batches", "BatchRequest")
    BatchRequest.objects.exclude(batch__status__in=ACTIVE_STATUSES).delete()


class Migration(migrations.Migration):
    dependencies = [("batches", "0006_batch_queued_at")]

    operations = [migrations.RunPython(drop_ended_batches_lines, migrations.RunPython.noop)]
