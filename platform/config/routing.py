"""WebSocket URL patterns; each app that speaks WebSocket adds its own here."""

from chat.routing import websocket_urlpatterns as chat_websocket_urlpatterns

websocket_urlpatterns: list = [*chat_websocket_urlpatterns]
