"""Runs one API request on an engine: fans it out into one engine request per choice,
turns the engine's deltas into OpenAI objects (whole, or as server-sent events) and keeps
the meter up to date for exactly-once usage records.

Errors the engine reports before the first token become proper HTTP errors (the first delta
of every choice is awaited before a response starts); errors after it end the stream with a
``data: {"error": …}`` event.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from gateway import schemas
from gateway.errors import ApiError
from gateway.validation import GenerationPlan
from inference_engine.client import AsyncEngineClient, EngineUnavailable
from inference_engine.protocol import (
    ErrorCode,
    FinishReason,
    GenerateDelta,
    GenerateRequest,
    TokenLogprobs,
    Usage,
)
from tenants.metering import Meter
from tenants.models import UsageRecord

# engine error code -> (HTTP status, API code, usage status)
ENGINE_ERRORS = {
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "context_length_exceeded", "rejected"),
    ErrorCode.INVALID_REQUEST: (400, "invalid_request", "rejected"),
    ErrorCode.OVERLOADED: (503, "engine_overloaded", "rejected"),
    ErrorCode.ENGINE_ERROR: (500, "engine_error", "error"),
    ErrorCode.MODEL_LOADING: (503, "model_loading", "rejected"),
    ErrorCode.MODEL_NOT_LOADED: (503, "model_not_loaded", "rejected"),
}
RETRY_AFTER_SECONDS = {503: "1"}
# how long a request left early waits for the engine's count of what it computed
FINAL_USAGE_TIMEOUT_SECONDS = 2.0


def engine_error(code: ErrorCode | str | None, message: str | None) -> ApiError:
    status, api_code, _ = ENGINE_ERRORS.get(code, (503, str(code or "engine_error"), "error"))
    headers = {"Retry-After": RETRY_AFTER_SECONDS[status]} if status in RETRY_AFTER_SECONDS else {}
    return ApiError(status, message or api_code, code=api_code, headers=headers)


def unavailable(exc: Exception) -> ApiError:
    return ApiError(
        503,
        f"The model's engine is unavailable: {exc}",
        code="engine_unavailable",
        headers={"Retry-After": "5"},
    )


@dataclass
class _Choice:
    index: int
    is_first_of_prompt: bool
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_chars: int = 0  # characters streamed so far: completions' text_offset
    num_tokens: int = 0  # tokens generated for this choice, as metered
    # a plain text event's bytes around its JSON-encoded text (see Generation._text_template)
    text_template: tuple[bytes, bytes] | None = None


def _chat_logprobs(entries: list[TokenLogprobs]) -> schemas.ChoiceLogprobs:
    return schemas.ChoiceLogprobs(
        content=[
            schemas.TokenLogprob(
                token=entry.token,
                logprob=entry.logprob,
                bytes=list(entry.token.encode()),
                top_logprobs=[
                    schemas.TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))
                    for token, logprob in zip(entry.top_tokens, entry.top_logprobs, strict=False)
                ],
            )
            for entry in entries
        ]
    )


def _completion_logprobs(entries: list[TokenLogprobs], offset: int) -> schemas.CompletionLogprobs:
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return schemas.CompletionLogprobs(
        tokens=[entry.token for entry in entries],
        token_logprobs=[entry.logprob for entry in entries],
        top_logprobs=[
            dict(zip(entry.top_tokens, entry.top_logprobs, strict=False)) for entry in entries
        ],
        text_offset=offsets,
    )


def fan_out(
    plan: GenerationPlan,
    response_id: str,
    cache_salt: str | None,
    tenant: str,
    *,
    tier_priority: int = 1,
    tenant_weight: float = 1.0,
) -> list:
    """One engine request per choice; a choice's seed is offset so the n samples differ.
    The request's ``priority`` may lower its plan tier's (a larger value), never raise it."""
    priority = max(tier_priority, plan.priority if plan.priority is not None else tier_priority)
    requests = []
    for prompt_index, prompt in enumerate(plan.prompts):
        for sample in range(plan.n):
            params = msgspec.structs.replace(prompt.params)
            if params.seed is not None and sample:
                params.seed += sample
            requests.append(
                msgspec.structs.replace(
                    prompt,
                    params=params,
                    request_id=f"{response_id}-{prompt_index * plan.n + sample}",
                    tenant_id=tenant,
                    cache_salt=cache_salt,
                    priority=priority,
                    tenant_weight=tenant_weight,
                )
            )
    return requests


class Generation:
    def __init__(
        self,
        *,
        kind: str,
        plan: GenerationPlan,
        requests: list[GenerateRequest],
        client: AsyncEngineClient,
        meter: Meter,
        response_id: str,
        model: str,
    ) -> None:
        self.kind = kind  # "chat" or "completion"
        self.plan = plan
        self.client = client
        self.meter = meter
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.requests = requests
        self.choices = [_Choice(i, i % plan.n == 0) for i in range(len(requests))]
        self._streams: list[AsyncIterator[GenerateDelta]] = []
        self._first: list[GenerateDelta] = []
        # choice index -> (prompt tokens, cached tokens), for each prompt's first choice
        self._prompt_usage: dict[int, tuple[int, int]] = {}

    # --- engine side ---------------------------------------------------------------------

    async def start(self) -> None:
        """Send every choice's request and wait for its first delta; raises ``ApiError``
        (having aborted the others) when the engine refuses or is unavailable."""
        self._streams = [self.client.generate(request) for request in self.requests]
        try:
            self._first = list(await asyncio.gather(*(anext(s) for s in self._streams)))
        except EngineUnavailable as exc:
            await self.close()
            self.meter.fail("engine_unavailable")
            raise unavailable(exc) from exc
        except StopAsyncIteration as exc:
            await self.close()
            self.meter.fail("engine_error")
            raise engine_error(ErrorCode.ENGINE_ERROR, "The engine closed the stream.") from exc
        except BaseException:
            # cancelled (the client left): the engine still says what it computed
            await self.close()
            raise
        for choice, delta in zip(self.choices, self._first, strict=True):
            self._account(choice, delta)
        for delta in self._first:
            if delta.error is not None:
                await self.close()
                _, _, usage_status = ENGINE_ERRORS.get(delta.error, (0, "", "error"))
                self.meter.fail(str(delta.error), usage_status)
                raise engine_error(delta.error, delta.error_message)

    async def close(self) -> None:
        """Close every engine stream (an unfinished one is aborted in the engine) and meter
        each unfinished choice by the engine's answer to its abort: the prompt tokens it
        computed and every token it generated, also those the client never read."""
        await asyncio.gather(*(s.aclose() for s in self._streams), return_exceptions=True)
        unfinished = [c for c in self.choices[: len(self._streams)] if c.finish_reason is None]
        if not unfinished:
            return
        finals = await asyncio.gather(
            *(
                self.client.final_delta(
                    self.requests[c.index].request_id, FINAL_USAGE_TIMEOUT_SECONDS
                )
                for c in unfinished
            )
        )
        for choice, final in zip(unfinished, finals, strict=True):
            if final is not None and final.usage is not None:
                self._settle_tokens(choice, final.usage)

    async def deltas(self) -> AsyncIterator[tuple[_Choice, GenerateDelta]]:
        """Every delta of every choice, as they arrive, starting with the prefetched ones
        (which ``start`` has accounted for already)."""
        for choice, delta in zip(self.choices, self._first, strict=True):
            yield choice, delta
        open_streams = [
            (choice, stream)
            for choice, stream, first in zip(self.choices, self._streams, self._first, strict=True)
            if first.finish_reason is None
        ]
        if len(open_streams) == 1:
            choice, stream = open_streams[0]
            async for delta in stream:
                self._account(choice, delta)
                yield choice, delta
            return
        async for choice, delta in _merge(open_streams):
            self._account(choice, delta)
            yield choice, delta

    def _account(self, choice: _Choice, delta: GenerateDelta) -> None:
        if delta.token_ids:
            self.meter.mark_first_token()
            self.meter.completion_tokens += len(delta.token_ids)
            choice.num_tokens += len(delta.token_ids)
        if delta.text:
            choice.text.append(delta.text)
        if delta.logprobs:
            choice.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            choice.finish_reason = _finish_reason(delta.finish_reason)
        if delta.error is not None:
            _, _, usage_status = ENGINE_ERRORS.get(delta.error, (0, "", "error"))
            self.meter.fail(str(delta.error), usage_status)
        if delta.usage is not None and choice.is_first_of_prompt:
            self._count_prompt(choice, delta.usage)

    def _settle_tokens(self, choice: _Choice, usage: Usage) -> None:
        """A choice's tokens as the engine counted them at its end."""
        choice.finish_reason = choice.finish_reason or str(FinishReason.ABORT)
        self.meter.completion_tokens += usage.completion_tokens - choice.num_tokens
        choice.num_tokens = usage.completion_tokens
        if choice.is_first_of_prompt:
            self._count_prompt(choice, usage)

    def _count_prompt(self, choice: _Choice, usage: Usage) -> None:
        """The prompt is billed once per prompt, not once per choice."""
        self._prompt_usage[choice.index] = (usage.prompt_tokens, usage.cached_tokens)
        self.meter.prompt_tokens = sum(p for p, _ in self._prompt_usage.values())
        self.meter.cached_tokens = sum(c for _, c in self._prompt_usage.values())

    def usage(self) -> schemas.Usage:
        return schemas.Usage(
            prompt_tokens=self.meter.prompt_tokens,
            completion_tokens=self.meter.completion_tokens,
            total_tokens=self.meter.total_tokens,
            prompt_tokens_details=schemas.PromptTokensDetails(
                cached_tokens=self.meter.cached_tokens
            ),
        )

    # --- API side ---------------------------------------------------------------------------

    async def complete(self) -> schemas.ChatCompletion | schemas.Completion:
        """Run to the end and build the whole response object."""
        try:
            async for _choice, delta in self.deltas():
                if delta.error is not None:
                    raise engine_error(delta.error, delta.error_message)
        except EngineUnavailable as exc:
            self.meter.fail("engine_unavailable")
            raise unavailable(exc) from exc
        finally:
            await self.close()
        wants_logprobs = self.plan.logprobs is not None
        if self.kind == "chat":
            choices = [
                schemas.ChatChoice(
                    index=c.index,
                    message=schemas.AssistantMessage(role="assistant", content="".join(c.text)),
                    logprobs=_chat_logprobs(c.logprobs) if wants_logprobs else None,
                    finish_reason=c.finish_reason,
                )
                for c in self.choices
            ]
        else:
            choices = [
                schemas.CompletionChoice(
                    index=c.index,
                    text="".join(c.text),
                    logprobs=_completion_logprobs(c.logprobs, 0) if wants_logprobs else None,
                    finish_reason=c.finish_reason,
                )
                for c in self.choices
            ]
        return self._envelope(choices, is_chunk=False, usage=self.usage())

    def _envelope(
        self, choices: list, *, is_chunk: bool, usage: schemas.Usage | None = None
    ) -> schemas.ChatCompletion | schemas.ChatCompletionChunk | schemas.Completion:
        """This kind's response object (or stream chunk) around ``choices``."""
        fields = dict(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )
        if self.kind != "chat":
            return schemas.Completion(object="text_completion", **fields)
        if is_chunk:
            return schemas.ChatCompletionChunk(object="chat.completion.chunk", **fields)
        return schemas.ChatCompletion(object="chat.completion", **fields)

    async def sse(self) -> AsyncIterator[bytes]:
        """The response as server-sent events, ending with ``data: [DONE]``."""
        # Events that are ready together go out in one write: the role chunks with the first
        # token, tokens that queued up while the server was busy, and the last token with its
        # finish chunk, the usage and [DONE].
        events: list[bytes] = []
        try:
            if self.kind == "chat":
                events += [
                    self._chat_chunk(choice, schemas.ChunkDelta(role="assistant", content=""))
                    for choice in self.choices
                ]
            num_open = len(self.choices)
            async for choice, delta in self.deltas():
                if delta.error is not None:
                    events.append(_event(engine_error(delta.error, delta.error_message).body()))
                    yield b"".join(events)
                    return
                if delta.text or delta.logprobs:
                    events.append(self._text_event(choice, delta.text, None, delta.logprobs))
                if choice.finish_reason is not None:
                    events.append(self._text_event(choice, None, choice.finish_reason))
                    num_open -= 1
                if num_open and events and not self._has_ready_delta():
                    yield b"".join(events)
                    events.clear()
            if self.plan.include_usage:
                events.append(self._usage_event())
            events.append(b"data: [DONE]\n\n")
            yield b"".join(events)
        except EngineUnavailable as exc:
            self.meter.fail("engine_unavailable")
            yield b"".join([*events, _event(unavailable(exc).body())])
        except asyncio.CancelledError:
            self.meter.fail("cancelled", UsageRecord.Status.CANCELLED)
            raise
        finally:
            await self.close()

    def _has_ready_delta(self) -> bool:
        """Whether the next delta of a single-choice stream is already here: when the server
        falls behind, the tokens that queued up go out in one write instead of one each."""
        return len(self.requests) == 1 and self.client.num_buffered(self.requests[0].request_id) > 0

    def _text_event(
        self,
        choice: _Choice,
        text: str | None,
        finish: str | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> bytes:
        wants_logprobs = bool(logprobs) and self.plan.logprobs is not None
        if text and finish is None and not wants_logprobs:
            # most events of a stream: one token's text, nothing else
            choice.num_chars += len(text)
            prefix, suffix = choice.text_template or self._text_template(choice)
            return prefix + msgspec.json.encode(text) + suffix
        if self.kind == "chat":
            chat_logprobs = _chat_logprobs(logprobs) if wants_logprobs else None
            return self._chat_chunk(choice, schemas.ChunkDelta(content=text), finish, chat_logprobs)
        completion_logprobs = (
            _completion_logprobs(logprobs, choice.num_chars) if wants_logprobs else None
        )
        choice.num_chars += len(text or "")
        return self._completion_chunk(choice, text or "", finish, completion_logprobs)

    def _text_template(self, choice: _Choice) -> tuple[bytes, bytes]:
        """The bytes of a plain text event of ``choice`` before and after its JSON-encoded
        text, cut from one event encoded in full around a placeholder: the same bytes as
        encoding each event's objects, for a fraction of the time."""
        if self.kind == "chat":
            event = self._chat_chunk(choice, schemas.ChunkDelta(content=_TEXT_PLACEHOLDER))
        else:
            event = self._completion_chunk(choice, _TEXT_PLACEHOLDER, None, None)
        prefix, _, suffix = event.partition(msgspec.json.encode(_TEXT_PLACEHOLDER))
        choice.text_template = (prefix, suffix)
        return choice.text_template

    def _completion_chunk(
        self,
        choice: _Choice,
        text: str,
        finish: str | None,
        logprobs: schemas.CompletionLogprobs | None,
    ) -> bytes:
        completion_choice = schemas.CompletionChoice(
            index=choice.index, text=text, logprobs=logprobs, finish_reason=finish
        )
        return _event(self._envelope([completion_choice], is_chunk=True))

    def _chat_chunk(
        self,
        choice: _Choice,
        delta: schemas.ChunkDelta,
        finish: str | None = None,
        logprobs: schemas.ChoiceLogprobs | None = None,
    ) -> bytes:
        chunk_choice = schemas.ChatChunkChoice(
            index=choice.index, delta=delta, logprobs=logprobs, finish_reason=finish
        )
        return _event(self._envelope([chunk_choice], is_chunk=True))

    def _usage_event(self) -> bytes:
        return _event(self._envelope([], is_chunk=True, usage=self.usage()))


# stands for the text while a text event's template is cut (it appears nowhere else in one)
_TEXT_PLACEHOLDER = "\ue000text\ue000"


def _event(payload: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def _finish_reason(reason: FinishReason) -> str:
    return "stop" if reason == FinishReason.ERROR else str(reason)


async def _merge(
    streams: list[tuple[_Choice, AsyncIterator[GenerateDelta]]],
) -> AsyncIterator[tuple[_Choice, GenerateDelta]]:
    """Interleave several choices' streams in arrival order."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: _Choice, stream: AsyncIterator[GenerateDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((choice, delta))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((choice, exc))
        await queue.put((choice, done))

    tasks = [asyncio.create_task(pump(choice, stream)) for choice, stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            choice, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
