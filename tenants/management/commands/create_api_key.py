from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from tenants import services
from tenants.management.errors import describe_validation_error
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Create an API key for a tenant and print it (it is shown only once)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("slug", help="The tenant's slug")
        parser.add_argument("--name", default="cli")
        parser.add_argument("--expires-in-days", type=int, help="Expire the key after N days")

    def handle(self, *args, **options) -> None:
        tenant = Tenant.objects.filter(slug=options["slug"]).first()
        if tenant is None:
            raise CommandError(f"No tenant with slug {options['slug']!r}.")
        try:
            expires_at = services.api_key_expires_at(days=options["expires_in_days"])
            api_key, raw_key = services.api_key_create(
                tenant=tenant, name=options["name"], expires_at=expires_at
            )
        except ValidationError as exc:
            raise CommandError(describe_validation_error(exc)) from exc
        self.stdout.write(f"Created key {api_key.display_prefix} for tenant {tenant.slug!r}:")
        self.stdout.write(raw_key)
