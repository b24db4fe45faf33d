"""The engine's link to its clients: over the network, only a client holding the engine's token
(``ENGINE_TOKEN``) reaches it. The engine listened in plain on every interface
(``tcp://0.0.0.0:5555`` in the deploy files), and anybody who reached the port generated
unmetered as any tenant, or unloaded the model."""

from __future__ import annotations

import asyncio
import logging
import subprocess

import pytest
import zmq
import zmq.asyncio

from inference_engine.client import AsyncEngineClient, EngineUnavailable
from inference_engine.protocol import (
    ControlRequest,
    GenerateRequest,
    RequestType,
    SamplingParams,
    link_check,
    link_keys,
)
from tests.conftest import PYTHON, ROOT, subprocess_env
from tests.inference_engine.test_server import EngineProcess, free_port, running

pytestmark = pytest.mark.timeout(180)

TOKEN = "a-secret-of-the-deployment"


class TokenEngine(EngineProcess):
    """The engine on a TCP port, with ``ENGINE_TOKEN`` in its environment."""

    def __init__(self, model: str, folder, endpoint: str, token: str | None) -> None:
        super().__init__(model, folder)
        self.command[self.command.index(self.endpoint)] = endpoint
        self.endpoint, self.token = endpoint, token

    def start(self) -> TokenEngine:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                env=subprocess_env(ENGINE_TOKEN=self.token),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self


@pytest.fixture(scope="module")
def secured(llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("secured-engine")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with running(TokenEngine(llama_dir, folder, endpoint, TOKEN)) as process:
        yield process


async def _tokens(client: AsyncEngineClient) -> list[int]:
    request = GenerateRequest(prompt="hello", params=SamplingParams(temperature=0, max_tokens=4))
    return [t for delta in [d async for d in client.generate(request)] for t in delta.token_ids]


async def test_only_a_client_holding_the_token_is_served(secured, caplog):
    right = AsyncEngineClient(secured.endpoint, token=TOKEN)
    await right.wait_ready(timeout=90)
    assert len(await _tokens(right)) == 4

    for token in (None, "a-guess"):
        stranger = AsyncEngineClient(secured.endpoint, token=token)
        # and it says why, not only "not connected"
        with caplog.at_level(logging.WARNING, logger="inference_engine.client"):
            with pytest.raises(EngineUnavailable, match="ENGINE_TOKEN"):
                await stranger.wait_ready(timeout=3)
            with pytest.raises(EngineUnavailable, match="ENGINE_TOKEN"):
                await _tokens(stranger)
        assert any("ENGINE_TOKEN" in r.getMessage() for r in caplog.records), token
        caplog.clear()
        stranger.close()

    # the one holding the token is still served
    assert len(await _tokens(right)) == 4
    right.close()
    # and the engine's log says why the others were not
    assert "a client failed the handshake" in secured.log()


async def test_a_plain_socket_gets_nothing_from_a_secured_engine(secured):
    """A raw DEALER, as a stranger would write one: its CONTROL unload and its stats get no
    answer (no handshake: nothing it sends is read), and the model still serves."""
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(secured.endpoint)
    try:
        unload = ControlRequest(action="unload")
        await raw.send_multipart([RequestType.CONTROL.value, _encode(unload)])
        await raw.send_multipart([RequestType.STATS.value, b""])
        assert await raw.poll(2000) == 0
    finally:
        raw.close(linger=0)
        ctx.term()
    right = AsyncEngineClient(secured.endpoint, token=TOKEN)
    await right.wait_ready(timeout=30)
    assert len(await _tokens(right)) == 4
    right.close()


def _encode(message) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(message)


def test_a_network_endpoint_without_a_token_is_refused_at_start(llama_dir):
    result = subprocess.run(
        [PYTHON, "-m", "inference_engine", "--model", llama_dir, "--endpoint", "tcp://0.0.0.0:5"],
        env=subprocess_env(ENGINE_TOKEN=None),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "set ENGINE_TOKEN" in result.stderr


@pytest.mark.parametrize(
    ("endpoint", "token", "refused"),
    [
        ("tcp://0.0.0.0:5555", None, True),
        ("tcp://10.0.0.5:5555", "", True),
        ("tcp://engine:5555", None, True),
        ("tcp://0.0.0.0:5555", "replace-with-a-secret", True),  # the env example's
        ("ws://127.0.0.1:5555", None, True),  # only ipc and loopback tcp go without
        ("tcp://0.0.0.0:5555", TOKEN, False),
        ("tcp://127.0.0.1:5555", None, False),
        ("tcp://[::1]:5555", None, False),
        ("ipc:///var/lib/llm/engine.sock", None, False),
    ],
)
def test_which_endpoints_need_a_token(endpoint, token, refused):
    if refused:
        with pytest.raises(ValueError, match="ENGINE_TOKEN"):
            link_check(endpoint, token)
    else:
        link_check(endpoint, token)


def test_both_ends_derive_the_same_keys_and_another_token_other_ones():
    keys = link_keys(TOKEN)
    assert keys == link_keys(TOKEN)
    assert keys.server_public == zmq.curve_public(keys.server_secret)
    other = link_keys("another")
    assert {other.server_public, other.client_public}.isdisjoint(
        {keys.server_public, keys.client_public}
    )


async def test_the_client_reads_the_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("ENGINE_TOKEN", TOKEN)
    assert AsyncEngineClient("tcp://127.0.0.1:1").token == TOKEN
    monkeypatch.delenv("ENGINE_TOKEN")
    assert AsyncEngineClient("tcp://127.0.0.1:1").token is None
    await asyncio.sleep(0)
