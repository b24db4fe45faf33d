"""HTTP probes for the reliability suite (bench/reliability.py) and its fast tests
(tests/gateway/test_fuzz.py): a raw HTTP/1.1 client on asyncio streams, so a probe can send
what a well-behaved library refuses to (invalid UTF-8, a 50 MB chunked body, a cut at any
byte); hostile request bodies generated from the API's own OpenAPI document with a fixed
seed; and schemathesis over that document. WebSocket probes are in bench/ws_probes.py.

No Django, no torch: the probes see the platform only from the outside.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import random
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
REQUEST_SCHEMAS = {CHAT_PATH: "ChatCompletionRequest", COMPLETIONS_PATH: "CompletionRequest"}


# --- HTTP ---------------------------------------------------------------------------------


@dataclass
class Answer:
    """What came back for one request; ``status`` None when no response head arrived."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    # why the exchange ended without a whole response: "reset", "eof", "timeout", ...
    dropped: str = ""

    def json(self) -> object:
        return json.loads(self.body)

    @property
    def is_openai_error(self) -> bool:
        """A JSON body that is exactly OpenAI's error object."""
        try:
            error = json.loads(self.body)["error"]
        except (ValueError, KeyError, TypeError):
            return False
        return (
            isinstance(error, dict)
            and set(error) == OPENAI_ERROR_KEYS
            and isinstance(error["message"], str)
            and bool(error["message"])
            and isinstance(error["type"], str)
        )


def request_head(
    method: str, path: str, host: str, headers: dict[str, str | bytes] | None = None
) -> bytes:
    """An HTTP/1.1 request head; header values may be raw bytes (invalid UTF-8 on purpose)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), f"Host: {host}".encode()]
    for name, value in (headers or {}).items():
        raw = value if isinstance(value, bytes) else value.encode("latin-1")
        lines.append(name.encode() + b": " + raw)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def chunked(body: bytes, size: int = 1 << 20) -> Iterable[bytes]:
    for start in range(0, len(body), size):
        piece = body[start : start + size]
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    yield b"0\r\n\r\n"


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return int(status_line.split(" ", 2)[1]), headers


async def iter_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body's pieces as they arrive (chunked, sized, or up to the connection's end)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
            yield (await reader.readexactly(size + 2))[:-2]
        await reader.readline()
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(65536):
            yield piece


async def exchange(
    host: str,
    port: int,
    head: bytes,
    body: bytes | Iterable[bytes] = b"",
    *,
    timeout: float = 30,
) -> Answer:
    """Send one request on a new connection and read the whole answer. The body is sent
    while the answer is read, so a server that answers early (a 413 after 8 MB of 50) is
    heard, and sending stops."""
    answer = Answer()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError) as exc:
        answer.dropped = f"connect: {exc!r}"
        return answer
    pieces = [body] if isinstance(body, bytes) else body

    async def send() -> None:
        writer.write(head)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()

    async def receive() -> None:
        answer.status, answer.headers = await read_head(reader)
        parts = [piece async for piece in iter_body(reader, answer.headers)]
        answer.body = b"".join(parts)

    sender = asyncio.ensure_future(send())
    try:
        await asyncio.wait_for(receive(), timeout)
    except TimeoutError:
        answer.dropped = "timeout"
    except asyncio.IncompleteReadError:
        answer.dropped = "eof"
    except ConnectionError as exc:
        answer.dropped = type(exc).__name__
    finally:
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender
        writer.transport.abort()
    return answer


async def post_json(
    base: str,
    path: str,
    key: str | None,
    body: bytes,
    *,
    content_type: str | None = "application/json",
    headers: dict[str, str | bytes] | None = None,
    timeout: float = 30,
) -> Answer:
    host, port = split_base(base)
    all_headers: dict[str, str | bytes] = {"Connection": "close"}
    if key is not None:
        all_headers["Authorization"] = f"Bearer {key}"
    if content_type is not None:
        all_headers["Content-Type"] = content_type
    all_headers["Content-Length"] = str(len(body))
    all_headers.update(headers or {})
    head = request_head("POST", path, f"{host}:{port}", all_headers)
    return await exchange(host, port, head, body, timeout=timeout)


def split_base(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").rstrip("/").rsplit(":", 1)
    return host, int(port)


# --- hostile HTTP inputs ---------------------------------------------------------------------


@dataclass
class Probe:
    """One hostile request. ``must_refuse``: the answer must be a 4xx with OpenAI's error
    object; otherwise any answer but a 5xx or a dropped connection will do (an input the
    schema allows may be served)."""

    name: str
    path: str
    body: bytes | Iterable[bytes]
    content_type: str | None = "application/json"
    headers: dict[str, str | bytes] = field(default_factory=dict)
    method: str = "POST"
    must_refuse: bool = True
    category: str = ""


HUGE_INTEGERS = ("1e400", str(10**30), str(-(10**30)))
HUGE_NUMBERS = ("1e400", "-1e400")
# one of each JSON type; a field gets each one its schema refuses
WRONG_TYPES: tuple[object, ...] = ("x", 7, 1.5, True, None, [], {}, [1, "a"], {"a": [None]})
RAW = "\ue001raw\ue001"  # stands for a JSON token json.dumps cannot write (1e400, bad UTF-8)


def valid_body(path: str, model: str) -> dict:
    if path == CHAT_PATH:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {"model": model, "prompt": "hi", "max_tokens": 2}


def _encode(body: dict, raw: bytes | None = None) -> bytes:
    encoded = json.dumps(body).encode()
    if raw is not None:
        encoded = encoded.replace(json.dumps(RAW).encode(), raw)
    return encoded


def _properties(document: dict, schema_name: str) -> dict[str, dict]:
    return document["components"]["schemas"][schema_name]["properties"]


def _kinds(schema: dict) -> set[str]:
    """The JSON types a property's schema admits at its top (``anyOf`` branches included)."""
    kinds = set()
    for branch in schema.get("anyOf", [schema]):
        kind = branch.get("type")
        kinds.update(kind if isinstance(kind, list) else [kind] if kind else [])
        if "$ref" in branch:
            kinds.add("object")
    return kinds


class SchemaCheck:
    """Whether a body is valid for an operation's request schema (the API's own document)."""

    def __init__(self, document: dict) -> None:
        import jsonschema_rs

        self._validators = {
            path: jsonschema_rs.validator_for(
                {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
            )
            for path, name in REQUEST_SCHEMAS.items()
        }

    def is_valid(self, path: str, body: object) -> bool:
        return self._validators[path].is_valid(body)


def hostile_bodies(document: dict, model: str) -> list[Probe]:
    """Every request field of both generation endpoints with huge numbers and with every JSON
    type its schema refuses, invalid UTF-8 and lone surrogates in its strings, deep nesting,
    empty and non-object bodies."""
    check = SchemaCheck(document)
    probes = []
    for path, schema_name in REQUEST_SCHEMAS.items():
        base = valid_body(path, model)
        for name, schema in _properties(document, schema_name).items():
            kinds = _kinds(schema)
            if kinds & {"integer", "number"}:
                numbers = HUGE_INTEGERS if "integer" in kinds else HUGE_NUMBERS
                for number in numbers:
                    probes.append(
                        Probe(
                            f"{name}={number}",
                            path,
                            _encode({**base, name: RAW}, number.encode()),
                            category="huge_number",
                        )
                    )
            for value in WRONG_TYPES:
                body = {**base, name: value}
                if not check.is_valid(path, body):
                    probes.append(
                        Probe(f"{name}={value!r}", path, _encode(body), category="wrong_type")
                    )
        text_fields = ["model", "user", "stop"]
        text_fields.append("messages[0].content" if path == CHAT_PATH else "prompt")
        for name in text_fields:
            for label, raw in (
                ("bytes ff fe", b'"a\xff\xfeb"'),
                ("truncated c3", b'"a\xc3"'),
                ("overlong c0 af", b'"\xc0\xaf"'),
                ("encoded surrogate", b'"\xed\xa0\x80"'),
            ):
                probes.append(
                    Probe(
                        f"{name}: {label}",
                        path,
                        _encode(_with_text(base, name, RAW), raw),
                        category="invalid_utf8",
                    )
                )
            # valid JSON, but no Unicode string: a 400 naming the field
            for label, raw in (
                ("high", b'"a\\ud800b"'),
                ("low", b'"\\udfff"'),
                ("reversed pair", b'"\\ude00\\ud83d"'),
            ):
                probes.append(
                    Probe(
                        f"{name}: lone surrogate escape, {label}",
                        path,
                        _encode(_with_text(base, name, RAW), raw),
                        category="lone_surrogate",
                    )
                )
        depth = 100_000
        for label, raw in (
            ("array", b"[" * depth + b"]" * depth),
            ("object", b'{"a":' * depth + b"1" + b"}" * depth),
        ):
            probes.append(Probe(f"body: {label} x{depth}", path, raw, category="deep_nesting"))
            nested = _encode({**base, "messages" if path == CHAT_PATH else "prompt": RAW}, raw)
            probes.append(Probe(f"field: {label} x{depth}", path, nested, category="deep_nesting"))
        # fields the decoder does not type (a schema, a tool's parameters) are read by recursion:
        # just past the API's cap, and where Python's stack runs out
        for depth in (101, 3_000):
            schema = b'{"a":' * depth + b"1" + b"}" * depth
            untyped = {"structured_outputs": {"json": RAW}}
            if path == CHAT_PATH:
                untyped["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": RAW},
                }
                untyped["tools"] = [
                    {"type": "function", "function": {"name": "f", "parameters": RAW}}
                ]
            for name, value in untyped.items():
                probes.append(
                    Probe(
                        f"{name}: nested x{depth}",
                        path,
                        _encode({**base, name: value}, schema),
                        category="deep_nesting",
                    )
                )
        for label, raw in (
            ("empty", b""),
            ("whitespace", b" \r\n\t"),
            ("null", b"null"),
            ("array", b"[]"),
            ("number", b"0"),
            ("string", b'"hi"'),
            ("truncated", _encode(base)[:-3]),
            ("trailing garbage", _encode(base) + b"}{"),
            ("NaN", _encode({**base, "temperature": RAW}, b"NaN")),
            ("BOM", b"\xef\xbb\xbf" + _encode(base)),
            ("NUL", b"\x00" + _encode(base)),
        ):
            probes.append(Probe(f"body: {label}", path, raw, category="malformed_body"))
        for content_type in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/xml",
            "application/json-patch+json",
            "\u00e9/\u00e9",
        ):
            probes.append(
                Probe(
                    f"content type {content_type!r}",
                    path,
                    _encode(base),
                    content_type=content_type,
                    category="content_type",
                )
            )
        probes += _charset_probes(path, base)
        probes.append(
            Probe(
                "no content type, not JSON",
                path,
                b"model=x",
                content_type=None,
                category="content_type",
            )
        )
    return probes


def _charset_probes(path: str, base: dict) -> list[Probe]:
    """Bodies in odd charsets: a known charset is decoded (served or refused for what the
    body says), an unknown one or a bytes codec is a 415, undecodable bytes a 400."""
    text = _with_text(base, "user", "caf\u00e9 \u00bd")
    served = [
        ("latin-1", json.dumps(text, ensure_ascii=False).encode("latin-1")),
        ("ISO-8859-1", json.dumps(text, ensure_ascii=False).encode("latin-1")),
        ("cp1252", json.dumps(text, ensure_ascii=False).encode("cp1252")),
        ("utf-16", json.dumps(text, ensure_ascii=False).encode("utf-16")),
        ("utf-8", json.dumps(text, ensure_ascii=False).encode()),
    ]
    refused = [
        ("nope", _encode(base)),
        ("base64", _encode(base)),
        ("zlib", _encode(base)),
        ("utf-16", _encode(base) + b" "),  # an odd number of bytes
        ("utf-8", json.dumps(text, ensure_ascii=False).encode("latin-1")),
    ]
    return [
        Probe(
            f"charset={charset} ({'served' if is_served else 'refused'})",
            path,
            body,
            content_type=f"application/json; charset={charset}",
            must_refuse=not is_served,
            category="charset",
        )
        for is_served, cases in ((True, served), (False, refused))
        for charset, body in cases
    ]


def _with_text(base: dict, name: str, value: str) -> dict:
    if name == "messages[0].content":
        return {**base, "messages": [{"role": "user", "content": value}]}
    return {**base, name: value}


def random_bodies(seed: int, count: int) -> list[Probe]:
    """Random bytes, random JSON-looking text and random JSON values, to both endpoints."""
    rng = random.Random(seed)
    alphabet = b'{}[]":,0123456789.eE-+ truefalsnul\\u\xff\x00'
    probes = []
    for i in range(count):
        path = (CHAT_PATH, COMPLETIONS_PATH)[i % 2]
        size = rng.choice((1, 7, 64, 512, 4096))
        kind = i % 3
        if kind == 0:
            body = rng.randbytes(size)
        elif kind == 1:
            body = bytes(rng.choice(alphabet) for _ in range(size))
        else:
            body = json.dumps(_random_json(rng, 4)).encode()
        probes.append(Probe(f"random #{i}", path, body, category="random"))
    return probes


def _random_json(rng: random.Random, depth: int) -> object:
    choice = rng.randrange(8 if depth else 5)
    if choice == 0:
        return rng.choice([None, True, False])
    if choice == 1:
        return rng.choice([0, -1, 2**63, -(2**64), 10**30, rng.randrange(-1000, 1000)])
    if choice == 2:
        return rng.choice([0.5, -1e308, 1e-320, rng.random()])
    if choice in (3, 4):
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(12)))
    if choice == 5:
        return [_random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    keys = ["model", "messages", "prompt", "max_tokens", "n", "stream", "x", ""]
    return {rng.choice(keys): _random_json(rng, depth - 1) for _ in range(rng.randrange(5))}


def big_bodies(model: str, size: int = 50 * 1024 * 1024) -> list[Probe]:
    """A body of ``size`` bytes, once with its Content-Length declared and once chunked."""
    base = valid_body(CHAT_PATH, model)
    filler = b"x" * size
    body = _encode({**base, "messages": [{"role": "user", "content": RAW}]}, b'"' + filler + b'"')
    return [
        Probe(f"{size >> 20} MB, Content-Length", CHAT_PATH, body, category="big_body"),
        Probe(
            f"{size >> 20} MB, chunked",
            CHAT_PATH,
            chunked(body),
            headers={"Transfer-Encoding": "chunked"},
            category="big_body",
        ),
    ]


def odd_requests(model: str) -> list[Probe]:
    """Methods, routes, model ids and Authorization headers that the API does not expect."""
    body = _encode(valid_body(CHAT_PATH, model))
    probes = [
        Probe(f"{method} chat", CHAT_PATH, b"", method=method, content_type=None)
        for method in ("GET", "PUT", "DELETE", "PATCH")
    ]
    for model_id in ("%ff%fe", "%00", "a" * 10_000, "..%2F..%2Fetc%2Fpasswd", "%ED%A0%80", "%"):
        probes.append(
            Probe(
                f"GET /v1/models/{model_id[:20]}",
                f"/v1/models/{model_id}",
                b"",
                method="GET",
                content_type=None,
            )
        )
    for route in ("/v1/%ff", "/v1/embeddings", "/v1/chat/completions/x"):
        probes.append(Probe(f"POST {route}", route, body))
    for label, value in (
        ("bytes ff", b"Bearer sk-\xff\xfe"),
        ("10k chars", ("Bearer sk-" + "a" * 10_000).encode()),
        ("100 KB", ("Bearer sk-" + "a" * 100_000).encode()),
        ("1 MB", ("Bearer sk-" + "a" * 1_000_000).encode()),
        ("no scheme", b"sk-abc"),
        ("basic", b"Basic " + base64.b64encode(b"a:b")),
    ):
        probes.append(
            Probe(f"Authorization {label}", CHAT_PATH, body, headers={"Authorization": value})
        )
    many = {f"X-Pad-{i}": "p" * 1000 for i in range(40)}
    probes.append(Probe("40 headers of 1 KB", CHAT_PATH, body, headers=many))
    probes.append(Probe("a 50 KB cookie", CHAT_PATH, body, headers={"Cookie": "c=" + "x" * 50_000}))
    probes.append(Probe("request line of 20 KB", f"/v1/models/{'m' * 20_000}", b"", method="GET"))
    return probes


async def send_probe(base: str, key: str | None, probe: Probe, timeout: float = 60) -> Answer:
    host, port = split_base(base)
    headers: dict[str, str | bytes] = {"Connection": "close"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if probe.content_type is not None:
        headers["Content-Type"] = probe.content_type
    if isinstance(probe.body, bytes) and (probe.body or probe.method == "POST"):
        headers["Content-Length"] = str(len(probe.body))
    headers.update(probe.headers)
    head = request_head(probe.method, probe.path, f"{host}:{port}", headers)
    return await exchange(host, port, head, probe.body, timeout=timeout)


def judge(probe: Probe, answer: Answer) -> str:
    """'' when the answer is acceptable for the probe, else what was wrong with it."""
    if answer.dropped:
        return f"dropped ({answer.dropped})"
    if answer.status is None or answer.status >= 500:
        return f"status {answer.status}"
    if probe.must_refuse and not 400 <= answer.status < 500:
        return f"status {answer.status}, expected a 4xx"
    if 400 <= answer.status < 500 and not answer.is_openai_error:
        return f"status {answer.status} without OpenAI's error object: {answer.body[:80]!r}"
    return ""


# --- schema fuzzing ------------------------------------------------------------------------


@dataclass
class FuzzReport:
    cases: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    server_errors: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    no_error_object: list[str] = field(default_factory=list)  # a 4xx without OpenAI's object


def schema_fuzz(base: str, key: str, num_cases: int) -> FuzzReport:
    """Schemathesis' cases for every operation of the API's own OpenAPI document, half in
    positive and half in negative mode, derandomized (the same cases every run). A request
    with no or a large max_tokens is given a small one, so valid cases stay short (huge
    values are ``hostile_bodies``' job)."""
    import requests
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base}/v1/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    report = FuzzReport()
    session = requests.Session()
    per_run = -(-num_cases // (2 * len(operations)))
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(operation, mode, per_run, base, key, session, report)
    return report


def _fuzz_operation(operation, mode, num_cases: int, base, key, session, report) -> None:
    import requests
    from hypothesis import HealthCheck, given, settings

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=num_cases,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    def run(case) -> None:
        _shorten(case)
        report.cases += 1
        try:
            label = f"{operation.label} [{mode.value}] {case.as_curl_command()[:2000]}"
        except Exception as exc:  # noqa: BLE001 - a label only
            label = f"{operation.label} [{mode.value}] ({exc!r})"
        try:
            response = case.call(
                base_url=f"{base}/v1",
                session=session,
                timeout=60,
                headers={"Authorization": f"Bearer {key}"},
            )
        except requests.RequestException as exc:
            report.dropped.append(f"{label}: {exc!r}")
            return
        report.statuses[response.status_code] += 1
        if response.status_code >= 500:
            report.server_errors.append(f"{response.status_code} {label}: {response.text[:200]}")
        elif not 400 <= response.status_code < 500:
            return
        elif not Answer(status=response.status_code, body=response.content).is_openai_error:
            report.no_error_object.append(f"{label}: {response.text[:200]}")

    run()


def _shorten(case) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    limits = [name for name in ("max_tokens", "max_completion_tokens") if name in body]
    for name in limits:
        value = body[name]
        if isinstance(value, int) and not isinstance(value, bool) and value > 16:
            body[name] = 1 + value % 16
    if not limits:
        body["max_tokens"] = 8
