from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from serving.services import KEPT, deployment_register
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
        parser.add_argument(
            "--max-context",
            type=int,
            help="Context length (default: the engine's, or as it was for a deployment "
            "registered before)",
        )
        parser.add_argument("--description", default="")
        state = parser.add_mutually_exclusive_group()
        state.add_argument("--disabled", action="store_true", help="Register it disabled")
        state.add_argument(
            "--enabled", action="store_true", help="Open it (a new deployment is open)"
        )

    def handle(self, *args, **options) -> None:
        try:
            deployment = deployment_register(
                name=options["name"],
                endpoints=options["endpoint"],
                description=options["description"],
                max_context=KEPT if options["max_context"] is None else options["max_context"],
                is_enabled=False if options["disabled"] else True if options["enabled"] else KEPT,
            )
        except ValidationError as exc:
            raise CommandError(describe_validation_error(exc)) from exc
        state = "enabled" if deployment.is_enabled else "disabled"
        self.stdout.write(
            f"Deployment {deployment.name!r} ({state}): {', '.join(deployment.endpoints)}"
        )
