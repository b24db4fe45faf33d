"""Django's ``changepassword``, with the password set in the platform's audit log, its value
hidden (as the admin's password page writes it)."""

from django.contrib.auth.management.commands import changepassword

from config.user_saves import users_saved
from tenants.audit import HIDDEN_VALUE, audit_record
from tenants.models import AuditEvent


class Command(changepassword.Command):
    def handle(self, *args, **options) -> str:
        with users_saved() as saved:
            result = super().handle(*args, **options)
        for user, _ in saved:
            audit_record(
                action=AuditEvent.Action.USER_UPDATED,
                actor=None,
                target=user,
                changes={"password": [HIDDEN_VALUE, HIDDEN_VALUE]},
            )
        return result
