from django.core.management.base import BaseCommand, CommandError

from config.demo import DemoRefused, demo_bootstrap


class Command(BaseCommand):
    help = (
        "Create the demo tenant, its admin user and an API key where they do not exist, and "
        "print them; never resets what exists (the embedded mode only)."
    )

    def handle(self, *args, **options) -> None:
        try:
            credentials = demo_bootstrap()
        except DemoRefused as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Admin login:  {credentials.login}")
        self.stdout.write(f"Demo API key: {credentials.api_key_shown}")
