"""Django's ``createsuperuser``, with the user it creates in the platform's audit log (as the
console, the admin and the demo bootstrap write theirs). ``config`` is listed before
``django.contrib.auth`` so that this command is the one ``manage.py`` runs."""

from django.contrib.auth.management.commands import createsuperuser

from config.user_saves import users_saved
from tenants.audit import audit_record, field_changes, model_values
from tenants.models import AuditEvent


class Command(createsuperuser.Command):
    def handle(self, *args, **options) -> None:
        with users_saved() as saved:
            super().handle(*args, **options)
        for user, created in saved:
            if created:
                audit_record(
                    action=AuditEvent.Action.USER_CREATED,
                    actor=None,
                    target=user,
                    changes=field_changes(
                        {}, model_values(user, ("username", "is_staff", "is_superuser"))
                    ),
                )
