from django.core.management.base import BaseCommand

from config.demo import demo_bootstrap


class Command(BaseCommand):
    help = "Make sure the demo tenant, an admin user and an API key exist, and print them."

    def handle(self, *args, **options) -> None:
        credentials = demo_bootstrap()
        self.stdout.write(f"Admin login:  {credentials.username} / {credentials.password}")
        self.stdout.write(f"Demo API key: {credentials.api_key}")
