from django.apps import AppConfig
from django.db.models.signals import post_delete


class BatchesConfig(AppConfig):
    name = "batches"
    verbose_name = "Files and batches"

    def ready(self) -> None:
        from batches import services
        from batches.models import File

        post_delete.connect(
            lambda instance, **kwargs: services.file_bytes_remove(file=instance),
            sender=File,
            weak=False,
            dispatch_uid="batches-file-bytes",
        )
