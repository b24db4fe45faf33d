from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from serving.services import deployment_register
from tenants.management.errors import describe_validation_error


class Command(BaseCommand):
    help = "Register (or update) a model deployment served by one or more engine endpoints."

    def add_arguments(self, parser) -> None:
        parser.add_argument("name", help="The model name clients send, e.g. qwen2.5-7b-instruct")
        parser.add_argument(
            "--endpoint",
            action="append",
            required=True,
            help="An engine replica (tcp://HOST:PORT or ipc:///PATH); repeat for more",
        )
        parser.add_argument("--max-context", type=int, help="Context length (default: engine's)")
        parser.add_argument("--description", default="")
        parser.add_argument("--disabled", action="store_true", help="Register it disabled")

    def handle(self, *args, **options) -> None:
        try:
            deployment = deployment_register(
                name=options["name"],
                endpoints=options["endpoint"],
                description=options["description"],
                max_context=options["max_context"],
                is_enabled=not options["disabled"],
            )
        except ValidationError as exc:
            raise CommandError(describe_validation_error(exc)) from exc
        state = "enabled" if deployment.is_enabled else "disabled"
        self.stdout.write(
            f"Deployment {deployment.name!r} ({state}): {', '.join(deployment.endpoints)}"
        )
