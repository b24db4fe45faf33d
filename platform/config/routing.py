"""WebSocket URL patterns; each app that speaks WebSocket adds its own here."""

websocket_urlpatterns: list = []
