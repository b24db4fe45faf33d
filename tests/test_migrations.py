"""Every model change has its migration: one left out (a validator, an audit action's new
choice) is written by the next person's makemigrations, into their unrelated change."""

import io

import pytest
from django.core.management import call_command

pytestmark = pytest.mark.django_db


def test_no_model_change_lacks_its_migration():
    out = io.StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit as exc:
        pytest.fail(f"models changed without a migration (exit {exc.code}):\n{out.getvalue()}")
