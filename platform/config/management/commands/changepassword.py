"""Django's ``changepassword``, with the password set in the platform's audit log, its value
hidden (as the admin's password page writes it)."""

from django.contrib.auth import get_user_model
from django.contrib.auth.management.commands import changepassword
from django.db.models.signals import post_save

from tenants.audit import HIDDEN_VALUE, audit_record
from tenants.models import AuditEvent


class Command(changepassword.Command):
    def handle(self, *args, **options) -> str:
        changed = []

        def remember(instance, **kwargs) -> None:
            changed.append(instance)

        user_model = get_user_model()
        post_save.connect(remember, sender=user_model, weak=False)
        try:
            result = super().handle(*args, **options)
        finally:
            post_save.disconnect(remember, sender=user_model)
        for user in changed:
            audit_record(
                action=AuditEvent.Action.USER_UPDATED,
                actor=None,
                target=user,
                changes={"password": [HIDDEN_VALUE, HIDDEN_VALUE]},
            )
        return result
