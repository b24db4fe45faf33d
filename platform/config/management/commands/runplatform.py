import os
import sys

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from config.demo import demo_bootstrap
from config.supervisor import ProcessSpec, Supervisor, python_path_env


class Command(BaseCommand):
    help = (
        "Run the whole platform in the foreground: migrate, make sure the demo tenant, admin "
        "and API key exist, then serve with Daphne. Ctrl-C or SIGTERM stops everything."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--no-demo", action="store_true", help="Skip the demo data")

    def handle(self, *args, **options) -> None:
        call_command("migrate", interactive=False, verbosity=0)
        base_url = f"http://{options['host']}:{options['port']}"
        self.stdout.write(f"Mode: {'embedded' if settings.IS_EMBEDDED else 'production'}")
        if not options["no_demo"]:
            credentials = demo_bootstrap()
            self.stdout.write(f"Admin:   {base_url}/admin/")
            self.stdout.write(f"  login: {credentials.username} / {credentials.password}")
            self.stdout.write(f"API key: {credentials.api_key}")
        self.stdout.flush()
        env = python_path_env(settings.BASE_DIR)
        daphne = ProcessSpec(
            name="daphne",
            argv=[
                sys.executable,
                "-m",
                "daphne",
                "--bind",
                options["host"],
                "--port",
                str(options["port"]),
                "config.asgi:application",
            ],
            env=env,
        )
        exit_code = Supervisor([daphne]).run()
        if exit_code:
            raise CommandError(f"The platform stopped (exit code {exit_code}).")
