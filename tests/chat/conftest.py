"""Chat fixtures: the gateway's live engine (and Daphne) on a tiny model, a user in a tenant
with the model deployed, and WebSocket communicators on the real routing and middleware."""

import asyncio
import contextlib
import json
import signal
import time

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.core.cache import cache
from django.test import Client

from tests.gateway.conftest import (  # noqa: F401  (fixtures)
    MODEL_NAME,
    daphne_server,
    engine,
    tiny_model_dir,
)

ORIGIN = (b"origin", b"http://testserver")
HOST = (b"host", b"testserver")
FRAME_TIMEOUT = 60  # seconds; the machine may be busy, a tiny model is still quick


@pytest.fixture(autouse=True)
def _clear_quota_counters():
    cache.clear()
    yield
    cache.clear()


@pytest.fixture(scope="session")
def ready_engine(engine):  # noqa: F811
    """The engine, once it answers."""
    engine.wait_ready()
    return engine


def asgi_application():
    """The WebSocket stack of config.asgi, built now: AllowedHostsOriginValidator reads
    ALLOWED_HOSTS when it is built, and the test environment adds "testserver" to it."""
    from config.origins import websocket_application

    return websocket_application()


def session_cookie(user) -> bytes:
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}".encode()


class Chat:
    """A connected socket with helpers to read the server's frames."""

    def __init__(self, communicator: WebsocketCommunicator) -> None:
        self.communicator = communicator

    async def send(self, **frame) -> None:
        await self.communicator.send_to(text_data=json.dumps(frame))

    async def send_raw(self, text: str) -> None:
        await self.communicator.send_to(text_data=text)

    async def receive(self) -> dict:
        return json.loads(await self.communicator.receive_from(timeout=FRAME_TIMEOUT))

    async def receive_until(self, *types: str, relayed: bool = True) -> tuple[dict, list[dict]]:
        """Frames up to and including the first of one of ``types``; (that frame, all). With
        ``relayed=False``, a frame relayed from another window (``"relayed": true``) is not
        the one looked for."""
        frames = []
        while True:
            frame = await self.receive()
            frames.append(frame)
            if frame["type"] in types and (relayed or not frame.get("relayed")):
                return frame, frames

    async def is_quiet(self) -> bool:
        return await self.communicator.receive_nothing(timeout=0.3)

    async def close(self) -> None:
        await self.communicator.disconnect(timeout=30)


async def open_chat(user, conversation_id: int, cookie: bytes | None = None):
    """(open, close code, Chat) for ``user`` (None: anonymous) on the conversation. The
    server refuses a socket by accepting it and closing it at once, so that a browser sees the
    code: that counts as not open, with the close's code."""
    headers = [ORIGIN, HOST]
    if user is not None:
        headers.append((b"cookie", cookie or await sync_to_async(session_cookie)(user)))
    communicator = WebsocketCommunicator(
        asgi_application(), f"/ws/chat/{conversation_id}/", headers=headers
    )
    connected, code = await communicator.connect(timeout=FRAME_TIMEOUT)
    if connected and not await communicator.receive_nothing(timeout=0):
        # the consumer sends its close in the same turn as its accept
        closed = await communicator.receive_output(timeout=FRAME_TIMEOUT)
        assert closed["type"] == "websocket.close", closed
        return False, closed.get("code"), Chat(communicator)
    return connected, code, Chat(communicator)


@pytest.fixture
def chat_world(transactional_db, ready_engine, django_user_model):
    """Alice in Acme (a plan open to the tiny model), with one conversation."""
    from chat import services as chat_services
    from serving.services import deployment_register
    from tenants import services
    from tenants.models import Plan

    plan = Plan.objects.create(slug="open", name="Open")
    alice = django_user_model.objects.create_user("alice", password="correct horse battery")
    acme = services.tenant_create(slug="acme", name="Acme", plan=plan, owner=alice)
    deployment_register(name=MODEL_NAME, endpoints=[ready_engine.endpoint])
    conversation = chat_services.conversation_create(user=alice, tenant=acme, model=MODEL_NAME)
    chat_services.conversation_configure(conversation=conversation, temperature=0.0, max_tokens=8)
    return {"user": alice, "tenant": acme, "plan": plan, "conversation": conversation}


@contextlib.contextmanager
def engine_paused(running_engine):
    """Hold the engine still (SIGSTOP) so a reply is certainly mid-stream, however fast the
    machine: stop, disconnect and busy refusals are then tested without a race."""
    running_engine.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        running_engine.process.send_signal(signal.SIGCONT)


async def run_paused_engine_until(
    running_engine, chat: Chat, frame_type: str, slice_seconds: float = 0.01
) -> tuple[dict, list[dict]]:
    """Inside ``engine_paused``: let the engine run in slices of ``slice_seconds`` until
    ``chat`` receives a frame of ``frame_type``, and leave it paused. (that frame, all read.)

    Paused only once a first token had been read, a fast engine could finish the whole reply
    first on a loaded machine (CI saw a reply complete that a test meant to stop); this way it
    generates at most a slice's worth of tokens between two looks, so the reply is certainly
    mid-stream when the test goes on. Held from before the send instead, and for longer than
    a second, the engine would not answer the STATS that routes the request
    (``serving.pool``): the reply would end in an error."""
    frames: list[dict] = []
    deadline = time.monotonic() + FRAME_TIMEOUT
    while time.monotonic() < deadline:
        running_engine.process.send_signal(signal.SIGCONT)
        await asyncio.sleep(slice_seconds)
        running_engine.process.send_signal(signal.SIGSTOP)
        # what the engine sent in its slice reaches the socket while it is held
        while not await chat.communicator.receive_nothing(timeout=0.05):
            frame = await chat.receive()
            frames.append(frame)
            if frame["type"] == frame_type:
                return frame, frames
    raise AssertionError(f"no {frame_type!r} frame within {FRAME_TIMEOUT} s: {frames}")
