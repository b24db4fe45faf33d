from django.core.management.base import BaseCommand, CommandError

from config.demo import DemoRefused, demo_bootstrap


class Command(BaseCommand):
    help = (
        "Make sure the demo tenant, an admin user and an API key exist, and print them "
        "(the embedded mode only)."
    )

    def handle(self, *args, **options) -> None:
        try:
            credentials = demo_bootstrap()
        except DemoRefused as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Admin login:  {credentials.username} / {credentials.password}")
        self.stdout.write(f"Demo API key: {credentials.api_key}")
