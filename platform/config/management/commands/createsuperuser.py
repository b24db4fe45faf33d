"""Django's ``createsuperuser``, with the user it creates in the platform's audit log (as the
console, the admin and the demo bootstrap write theirs). ``config`` is listed before
``django.contrib.auth`` so that this command is the one ``manage.py`` runs."""

from django.contrib.auth import get_user_model
from django.contrib.auth.management.commands import createsuperuser
from django.db.models.signals import post_save

from tenants.audit import audit_record, field_changes, model_values
from tenants.models import AuditEvent


class Command(createsuperuser.Command):
    def handle(self, *args, **options) -> None:
        new_users = []

        def remember(instance, created: bool = False, **kwargs) -> None:
            if created:
                new_users.append(instance)

        user_model = get_user_model()
        post_save.connect(remember, sender=user_model, weak=False)
        try:
            super().handle(*args, **options)
        finally:
            post_save.disconnect(remember, sender=user_model)
        for user in new_users:
            audit_record(
                action=AuditEvent.Action.USER_CREATED,
                actor=None,
                target=user,
                changes=field_changes(
                    {}, model_values(user, ("username", "is_staff", "is_superuser"))
                ),
            )
