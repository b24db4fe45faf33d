from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "gateway"
    verbose_name = "OpenAI-compatible API"

    def ready(self) -> None:
        from gateway import authorization

        authorization.connect_signals()
