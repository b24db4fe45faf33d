from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from tenants import services
from tenants.management.errors import describe_validation_error
from tenants.models import Plan


class Command(BaseCommand):
    help = "Create a tenant (optionally with an owner and limit overrides) and its first API key."

    def add_arguments(self, parser) -> None:
        parser.add_argument("slug")
        parser.add_argument("--name", default="")
        parser.add_argument("--plan", help="Plan slug (default: the 'default' plan)")
        parser.add_argument("--owner", help="Username of an existing user to make the owner")
        parser.add_argument("--rpm", type=int, help="Requests per minute")
        parser.add_argument("--tpm", type=int, help="Tokens per minute")
        parser.add_argument("--max-concurrent", type=int, help="Concurrent requests")
        parser.add_argument("--monthly-tokens", type=int, help="Monthly token budget")

    def handle(self, *args, **options) -> None:
        owner = None
        if options["owner"]:
            try:
                owner = get_user_model().objects.get(username=options["owner"])
            except get_user_model().DoesNotExist as exc:
                raise CommandError(
                    f"No user named {options['owner']!r}: make the account first (the admin's "
                    "Users page, or `manage.py createsuperuser` for staff)."
                ) from exc
        plan = None
        if options["plan"]:
            plan = Plan.objects.filter(slug=options["plan"]).first()
            if plan is None:
                raise CommandError(f"No plan with slug {options['plan']!r}.")
        try:
            with transaction.atomic():
                tenant = services.tenant_create(
                    slug=options["slug"],
                    name=options["name"],
                    plan=plan,
                    owner=owner,
                    requests_per_minute=options["rpm"],
                    tokens_per_minute=options["tpm"],
                    max_concurrent_requests=options["max_concurrent"],
                    monthly_token_budget=options["monthly_tokens"],
                )
                _, raw_key = services.api_key_create(
                    tenant=tenant, name="default", created_by=owner
                )
        except ValidationError as exc:
            raise CommandError(describe_validation_error(exc)) from exc
        self.stdout.write(f"Created tenant {tenant.slug!r} on plan {tenant.plan.slug!r}.")
        self.stdout.write("Its API key (shown once):")
        self.stdout.write(raw_key)
