"""WebSocket probes for the reliability suite (bench/reliability.py) and its fast tests
(tests/gateway/test_fuzz.py): a bare RFC 6455 client on asyncio streams that can send any
frame at all (binary, unmasked, reserved bits, oversized), the malformed chat frames, drawn
with a fixed seed, and the loop that sends them and sorts the answers.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import os
import random
import struct
from dataclasses import dataclass, field

from bench.probes import read_head, request_head, split_base

# --- WebSocket ---------------------------------------------------------------------------

OP_CONTINUATION, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0, 1, 2, 8, 9, 10


@dataclass
class Received:
    """A server frame: kind "text", "binary" or "close" (``code`` set), or "eof" (the TCP
    connection ended without a close frame), or "timeout"."""

    kind: str
    data: bytes = b""
    code: int | None = None

    def frame(self) -> dict | None:
        """A text frame as JSON, None if it is not a JSON object."""
        try:
            value = json.loads(self.data)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


class WebSocket:
    """A bare RFC 6455 client: masks what it sends (unless told not to), answers pings, and
    lets a caller send any frame at all."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.closed_code: int | None = None

    @classmethod
    async def connect(
        cls, base: str, path: str, headers: dict[str, str], timeout: float = 30
    ) -> tuple[int, WebSocket | None]:
        """(HTTP status of the handshake, the socket when it was upgraded)."""
        host, port = split_base(base)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        head = request_head(
            "GET",
            path,
            f"{host}:{port}",
            {
                "Upgrade": "websocket",
                "Connection": "Upgrade",
                "Sec-WebSocket-Key": key,
                "Sec-WebSocket-Version": "13",
                **headers,
            },
        )
        writer.write(head)
        try:
            status, _ = await asyncio.wait_for(read_head(reader), timeout)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            writer.transport.abort()
            return 0, None
        if status != 101:
            writer.transport.abort()
            return status, None
        return status, cls(reader, writer)

    async def send_frame(
        self, opcode: int, payload: bytes, *, fin: bool = True, mask: bool = True, rsv: int = 0
    ) -> None:
        first = (0x80 if fin else 0) | (rsv << 4) | opcode
        length = len(payload)
        mask_bit = 0x80 if mask else 0
        if length < 126:
            header = struct.pack("!BB", first, mask_bit | length)
        elif length < 1 << 16:
            header = struct.pack("!BBH", first, mask_bit | 126, length)
        else:
            header = struct.pack("!BBQ", first, mask_bit | 127, length)
        if mask:
            key = os.urandom(4)
            payload = _masked(payload, key)
            header += key
        self.writer.write(header + payload)
        await self.writer.drain()

    async def send_text(self, text: str | bytes) -> None:
        await self.send_frame(OP_TEXT, text if isinstance(text, bytes) else text.encode())

    async def receive(self, timeout: float = 30) -> Received:
        """The next data or close frame (pings are answered on the way)."""
        try:
            return await asyncio.wait_for(self._receive(), timeout)
        except TimeoutError:
            return Received("timeout")
        except (asyncio.IncompleteReadError, ConnectionError):
            return Received("eof")

    async def _receive(self) -> Received:
        data, kind = b"", None
        while True:
            first, second = await self.reader.readexactly(2)
            opcode, length = first & 0x0F, second & 0x7F
            if length == 126:
                (length,) = struct.unpack("!H", await self.reader.readexactly(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", await self.reader.readexactly(8))
            if second & 0x80:
                key = await self.reader.readexactly(4)
                payload = _masked(await self.reader.readexactly(length), key)
            else:
                payload = await self.reader.readexactly(length)
            if opcode == OP_PING:
                await self.send_frame(OP_PONG, payload)
                continue
            if opcode == OP_PONG:
                continue
            if opcode == OP_CLOSE:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                self.closed_code = code
                with contextlib.suppress(ConnectionError):
                    await self.send_frame(OP_CLOSE, payload[:2])
                return Received("close", payload[2:], code)
            if opcode != OP_CONTINUATION:
                kind = "text" if opcode == OP_TEXT else "binary"
            data += payload
            if first & 0x80:
                return Received(kind or "binary", data)

    async def close(self, code: int = 1000) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.send_frame(OP_CLOSE, struct.pack("!H", code))
        self.writer.transport.abort()


def _masked(payload: bytes, key: bytes) -> bytes:
    if not payload:
        return payload
    repeated = (key * (len(payload) // 4 + 1))[: len(payload)]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")).to_bytes(
        len(payload), "big"
    )


# a frame that breaks RFC 6455 itself: the server may fail the connection without a close
# frame (section 7.1.7), which is no crash
PROTOCOL = "protocol"
# the chat consumer's refusals of a socket (not of a frame): anonymous, or not allowed
REFUSED_SOCKET = (4401, 4403)


@dataclass
class WsProbe:
    """One hostile frame for the chat socket: ``opcode`` and raw payload."""

    name: str
    payload: bytes
    opcode: int = OP_TEXT
    category: str = ""
    mask: bool = True  # RFC 6455: a client must mask every frame
    rsv: int = 0  # reserved bits, which no extension was negotiated for


def hostile_frames(seed: int, count: int, *, foreign_message_id: int) -> list[WsProbe]:
    """``count`` frames the chat socket must refuse, each with an error frame or a close with
    a code: binary frames, invalid JSON, non-objects, wrong and unknown types, every known
    type with fields of the wrong type, frames over the size limit, another tenant's message
    id. Valid frames that would start a reply, and ``stop`` (which is ignored, by design,
    when nothing runs), are not among them."""
    rng = random.Random(seed)
    text = OP_TEXT

    def frame(name: str, value: object, category: str) -> WsProbe:
        return WsProbe(name, json.dumps(value).encode(), text, category)

    fixed = [
        WsProbe(
            "binary JSON",
            json.dumps({"type": "send", "content": "hi"}).encode(),
            OP_BINARY,
            "binary",
        ),
        WsProbe("binary empty", b"", OP_BINARY, "binary"),
        WsProbe("text empty", b"", text, "invalid_json"),
        WsProbe(
            "text 100 KB", b'{"type":"send","content":"' + b"x" * 100_000 + b'"}', text, "huge"
        ),
        WsProbe("text 1 MB", b"[" + b"1," * 500_000 + b"1]", text, "huge"),
        WsProbe("deep nesting", b"[" * 50_000 + b"]" * 50_000, text, "invalid_json"),
        frame(
            "edit foreign message",
            {"type": "edit", "message_id": foreign_message_id, "content": "mine now"},
            "foreign",
        ),
        frame(
            "edit foreign message, string id",
            {"type": "edit", "message_id": str(foreign_message_id), "content": "x"},
            "foreign",
        ),
        frame("edit huge id", {"type": "edit", "message_id": 10**30, "content": "x"}, "foreign"),
        frame("edit negative id", {"type": "edit", "message_id": -1, "content": "x"}, "foreign"),
        frame("regenerate with nothing to regenerate", {"type": "regenerate"}, "state"),
    ]
    for kind, name in (
        ("send", "content"),
        ("edit", "message_id"),
        ("settings", "model"),
        ("settings", "system_prompt"),
        ("settings", "temperature"),
        ("settings", "max_tokens"),
    ):
        for value in WRONG_FRAME_VALUES[name]:
            fixed.append(
                frame(f"{kind}.{name}={value!r}", {"type": kind, name: value}, "wrong_type")
            )
    for value in ("", "x" * 70_000, "\ud800"):
        category = "lone_surrogate" if value == "\ud800" else "wrong_value"
        fixed.append(
            frame(f"send.content={value[:8]!r}…", {"type": "send", "content": value}, category)
        )
    for value in (-1, 0, 10**9, float("inf")):
        probe = {"type": "settings", "max_tokens": value}
        raw = json.dumps(probe).replace("Infinity", "1e400").encode()
        fixed.append(WsProbe(f"settings.max_tokens={value}", raw, text, "wrong_value"))
    for value in (-0.5, 3, "hot"):
        fixed.append(
            frame(
                f"settings.temperature={value!r}",
                {"type": "settings", "temperature": value},
                "wrong_value",
            )
        )
    fixed.append(
        frame("settings.model unknown", {"type": "settings", "model": "nope"}, "wrong_value")
    )
    fixed.append(
        frame(
            "settings.system_prompt 100k",
            {"type": "settings", "system_prompt": "x" * 60_000},
            "wrong_value",
        )
    )
    for value in (None, 1, [], {}, "", "on_send", "__init__", "send ", "sënd", "x" * 5000, "STOP"):
        fixed.append(frame(f"type={str(value)[:12]!r}", {"type": value}, "unknown_type"))
    for value in (None, 1, "x", [], [{"type": "send"}], 1.5, True):
        fixed.append(frame(f"frame {value!r}", value, "not_object"))
    fixed.append(
        WsProbe("invalid UTF-8 in text", b'{"type":"send","content":"\xff"}', text, PROTOCOL)
    )
    valid = json.dumps({"type": "settings"}).encode()
    fixed += [
        WsProbe("unmasked frame", valid, text, PROTOCOL, mask=False),
        WsProbe("reserved opcode 3", valid, 3, PROTOCOL),
        WsProbe("RSV1 set", valid, text, PROTOCOL, rsv=4),
        WsProbe("ping of 200 bytes", b"p" * 200, OP_PING, PROTOCOL),
    ]
    probes = list(fixed)
    generators = [
        lambda: WsProbe("random bytes", rng.randbytes(rng.randrange(1, 300)), OP_BINARY, "binary"),
        lambda: WsProbe(
            "random text",
            "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(1, 80))).encode(),
            text,
            "invalid_json",
        ),
        lambda: frame("random type", {"type": _random_word(rng)}, "unknown_type"),
        lambda: _random_field_frame(rng, "settings", rng.choice(SETTINGS_FIELDS)),
        lambda: _random_field_frame(rng, "send", "content"),
        lambda: _random_field_frame(rng, "edit", "message_id"),
        lambda: WsProbe("truncated JSON", b'{"type": "se', text, "invalid_json"),
    ]
    while len(probes) < count:
        probes.append(rng.choice(generators)())
    return probes[:count]


def _random_word(rng: random.Random) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz_0123456789"
    word = "".join(rng.choice(letters) for _ in range(rng.randrange(1, 12)))
    return word if word not in ("send", "stop", "edit", "settings", "regenerate") else word + "x"


SETTINGS_FIELDS = ("model", "system_prompt", "temperature", "max_tokens")
# values each chat frame field refuses (None leaves a setting as it is, so it is not here)
_NOT_TEXT: tuple[object, ...] = (7, 1.5, True, [], {}, ["x"], {"a": 1}, 10**30)
WRONG_FRAME_VALUES: dict[str, tuple[object, ...]] = {
    "content": (None, *_NOT_TEXT, -(10**30)),
    "message_id": (None, 1.5, True, [], {}, ["x"], "7", 10**30, -(10**30)),
    "model": _NOT_TEXT,
    "system_prompt": _NOT_TEXT,
    "temperature": (-1, 2.5, 10**30, True, "hot", [], {}, [0.5]),
    "max_tokens": (0, -1, 1.5, 10**30, True, "8", [], {}),
}


def _random_field_frame(rng: random.Random, kind: str, name: str) -> WsProbe:
    value = rng.choice(WRONG_FRAME_VALUES[name])
    return WsProbe(
        f"random {kind}.{name}",
        json.dumps({"type": kind, name: value}).encode(),
        OP_TEXT,
        "wrong_type",
    )


def is_refusal(received: Received) -> bool:
    """An error frame, or a close with a code; what a hostile frame must get."""
    if received.kind == "close":
        return received.code is not None
    if received.kind == "text":
        frame = received.frame()
        return frame is not None and frame.get("type") == "error" and bool(frame.get("code"))
    return False


def is_over_budget(received: Received) -> bool:
    """The socket's frame budget refused the frame unhandled (``too_many_frames``)."""
    return (
        received.kind == "text"
        and is_refusal(received)
        and received.frame()["code"] == "too_many_frames"
    )


# --- WebSocket fuzzing ------------------------------------------------------------------------


@dataclass
class WsReport:
    error_frames: int = 0
    closes: int = 0  # closes with a code, and connections failed for a protocol violation
    close_codes: collections.Counter = field(default_factory=collections.Counter)
    accepted: list[str] = field(default_factory=list)  # frames that were not refused
    crashes: list[str] = field(default_factory=list)  # 1011, a lost connection, silence
    connects: int = 0
    refused_connects: int = 0
    over_budget: int = 0  # frames refused unhandled for the socket's frame budget, then resent

    @property
    def refused(self) -> int:
        return self.error_frames + self.closes


async def ws_fuzz(base: str, path: str, headers: dict, frames: list[WsProbe]) -> WsReport:
    """Send each frame on the socket at ``path`` and read the answer; reconnect after a
    close. A reply started by a frame that was accepted is read to its end. A socket's frame
    budget (``chat.frame_budget``) refuses frames unhandled past it: the probe is sent again on
    a new socket, since the refusal said nothing about it."""
    report = WsReport()
    socket_: WebSocket | None = None
    for probe in frames:
        received = None
        resends = 0
        while received is None:
            if socket_ is None:
                status, socket_ = await WebSocket.connect(base, path, headers)
                report.connects += 1
                if socket_ is None:
                    report.refused_connects += 1
                    report.crashes.append(f"handshake {status} before {probe.name}")
                    break
            try:
                await socket_.send_frame(
                    probe.opcode, probe.payload, mask=probe.mask, rsv=probe.rsv
                )
            except ConnectionError as exc:
                report.crashes.append(f"{probe.name}: send failed {exc!r}")
                socket_ = None
                break
            received = await socket_.receive(timeout=20)
            if is_over_budget(received):
                report.over_budget += 1
                await socket_.close()
                socket_ = None
                if resends == 2:  # a new socket's budget did not take it either
                    report.crashes.append(f"{probe.name[:50]}: refused for the frame budget")
                    received = None
                    break
                resends, received = resends + 1, None
        if received is None:
            continue
        if received.kind == "close" and received.code in REFUSED_SOCKET:
            report.refused_connects += 1  # the socket itself was refused: the probe proves nothing
            report.crashes.append(f"socket refused with {received.code} before {probe.name}")
        elif received.kind == "close" and received.code not in (None, 1011):
            report.closes += 1
            report.close_codes[received.code] += 1
        elif received.kind == "eof" and probe.category == PROTOCOL:
            report.closes += 1  # failed as RFC 6455 allows for a protocol violation
            report.close_codes["dropped (protocol violation)"] += 1
        elif received.kind in ("close", "eof", "timeout"):
            report.crashes.append(f"{probe.category} {probe.name[:50]}: {received.kind} "
                                  f"{received.code or ''}".strip())  # fmt: skip
        elif is_refusal(received):
            report.error_frames += 1
            continue
        else:
            report.accepted.append(f"{probe.category} {probe.name[:50]} -> {received.data[:120]!r}")
            await _drain_reply(socket_)
            continue
        await socket_.close()
        socket_ = None
    if socket_ is not None:
        await socket_.close()
    return report


async def _drain_reply(socket_: WebSocket) -> None:
    """An accepted frame may have started a reply: read until it is done (or silent)."""
    while True:
        received = await socket_.receive(timeout=5)
        frame = received.frame() if received.kind == "text" else None
        if (
            frame is None
            or frame.get("type") == "done"
            or (frame.get("type") == "error" and "message_id" in frame)
        ):
            return


async def ws_close_code(base: str, path: str, headers: dict) -> int | str | None:
    """The code a socket that the server refuses (accepts, then closes) is closed with."""
    status, socket_ = await WebSocket.connect(base, path, headers)
    if socket_ is None:
        return f"handshake {status}"
    received = await socket_.receive(timeout=20)
    await socket_.close()
    return received.code if received.kind == "close" else received.kind


async def ws_reply(base: str, path: str, headers: dict) -> str:
    """Send one message on a new socket: "done" when its reply completed, else what ended it."""
    status, socket_ = await WebSocket.connect(base, path, headers)
    if socket_ is None:
        return f"handshake {status}"
    try:
        await socket_.send_text(json.dumps({"type": "send", "content": "hello"}))
        while True:
            received = await socket_.receive(timeout=60)
            frame = received.frame() if received.kind == "text" else None
            if frame is None:
                return f"{received.kind} {received.code}"
            if frame["type"] in ("done", "error"):
                return frame["type"] if frame["type"] == "done" else f"error {frame.get('code')}"
    finally:
        await socket_.close()
