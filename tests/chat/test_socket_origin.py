"""The chat socket opens only for the platform's own pages: the ``Origin`` of the host the
browser reached, or a trusted one. With ``ALLOWED_HOSTS=*`` Channels' host check let every
origin through, so any site could open a socket with a signed-in user's cookie."""

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from config.origins import is_same_origin, websocket_application
from tests.chat.conftest import session_cookie

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("origin", "host", "is_same"),
    [
        ("https://llm.example.com", "llm.example.com", True),
        ("http://localhost:8000", "localhost:8000", True),
        ("https://llm.example.com", "llm.example.com:443", True),  # the default port named
        ("https://evil.example", "llm.example.com", False),
        ("http://llm.example.com.evil.example", "llm.example.com", False),
        ("http://localhost:9000", "localhost:8000", False),  # another port, another origin
        ("null", "llm.example.com", False),
        ("", "llm.example.com", False),
        ("https://llm.example.com", "", False),
        ("ftp://llm.example.com", "llm.example.com", False),
        ("https://llm.example.com:x", "llm.example.com", False),
        ("https://app.example.org", "llm.example.com", True),  # in CSRF_TRUSTED_ORIGINS
        ("https://a.corp.example", "llm.example.com", True),  # https://*.corp.example
        ("http://a.corp.example", "llm.example.com", False),
    ],
)
def test_an_origin_is_the_hosts_own_or_a_trusted_one(settings, origin, host, is_same):
    settings.CSRF_TRUSTED_ORIGINS = ["https://app.example.org", "https://*.corp.example"]
    headers = [(b"origin", origin.encode()), (b"host", host.encode())]
    assert is_same_origin([(k, v) for k, v in headers if v]) is is_same


@pytest.mark.parametrize(
    ("origin", "is_let_through"), [(b"https://evil.example", False), (b"http://testserver", True)]
)
async def test_with_every_host_allowed_another_sites_page_gets_no_socket(
    settings, django_user_model, origin, is_let_through
):
    settings.ALLOWED_HOSTS = ["*"]
    user = await sync_to_async(django_user_model.objects.create_user)("victim", password="pw-1x")
    headers = [
        (b"cookie", await sync_to_async(session_cookie)(user)),
        (b"origin", origin),
        (b"host", b"testserver"),
    ]
    communicator = WebsocketCommunicator(websocket_application(), "/ws/chat/1/", headers=headers)
    connected, _ = await communicator.connect(timeout=10)
    assert connected is is_let_through  # the consumer then closes an unknown conversation
    await communicator.disconnect()
