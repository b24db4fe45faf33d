"""A run's deltas as OpenAI's objects: a whole ``ChatCompletion``/``Completion``, or
server-sent events of its chunks.

Errors before the first token are raised by ``Run.start`` and become proper HTTP errors (the
first delta of every choice is awaited before a response starts); errors after it end the
stream with a ``data: {"error": …}`` event.
"""

import asyncio
import codecs
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from gateway import schemas
from gateway.errors import SERVER_ERROR, ApiError, from_run_error
from gateway.tool_calls import CallDelta, ToolCallReader
from gateway.validation import GenerationPlan
from inference_engine.protocol import FinishReason, GenerateDelta, TokenLogprobs
from serving.pool import get_pool
from serving.runs import Choice, Run, RunError

logger = logging.getLogger(__name__)

STREAM_FAILED = ApiError(500, SERVER_ERROR, code="internal_error")
# an engine that sent no prompt logprobs (or text) for an echo: one older than this web tier
ECHO_UNSUPPORTED = ApiError(
    501,
    "This model's engine does not return the prompt's logprobs and text that echo needs.",
    code="echo_unsupported",
    param="echo",
)


@dataclass
class _Output:
    """What a choice has said so far, as the API shows it."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # completions' text_offset: the characters the tokens so far complete (a token that holds
    # part of one is at the character it starts)
    offsets: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    offset: int = 0
    # an echo: the prompt went out before the first delta's own text
    echoed: bool = False
    # the next logprobs shown begin with an echoed prompt's first token, which has none
    first_unscored: bool = False
    # a plain text event's bytes around its JSON-encoded text (see Responder._text_template)
    text_template: tuple[bytes, bytes] | None = None


def _chat_logprobs(entries: list[TokenLogprobs]) -> schemas.ChoiceLogprobs:
    return schemas.ChoiceLogprobs(
        content=[
            schemas.TokenLogprob(
                token=entry.token,
                logprob=entry.logprob,
                bytes=list(entry.token_bytes or entry.token.encode()),
                top_logprobs=[
                    schemas.TopLogprob(token=token, logprob=logprob, bytes=list(raw))
                    for token, logprob, raw in zip(
                        entry.top_tokens, entry.top_logprobs, _top_bytes(entry), strict=False
                    )
                ],
            )
            for entry in entries
        ]
    )


def _top_bytes(entry: TokenLogprobs) -> list[bytes]:
    return entry.top_token_bytes or [token.encode() for token in entry.top_tokens]


def _completion_logprobs(
    entries: list[TokenLogprobs], output: _Output
) -> schemas.CompletionLogprobs:
    offsets = []
    for entry in entries:
        offsets.append(output.offset)
        output.offset += len(output.offsets.decode(entry.token_bytes or entry.token.encode()))
    token_logprobs: list[float | None] = [entry.logprob for entry in entries]
    top_logprobs: list[dict[str, float] | None] = [
        _completion_top_logprobs(entry) for entry in entries
    ]
    if output.first_unscored and entries:
        output.first_unscored = False
        token_logprobs[0] = top_logprobs[0] = None
    return schemas.CompletionLogprobs(
        tokens=[entry.token for entry in entries],
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=offsets,
    )


def _completion_top_logprobs(entry: TokenLogprobs) -> dict[str, float]:
    """The sampled token and the top ones: OpenAI "will always return the logprob of the
    sampled token, so there may be up to logprobs+1 elements", and vLLM does the same.

    The keys are the tokens' text, as in OpenAI's and vLLM's answers (vLLM's
    ``_create_completion_logprobs`` builds the same text-keyed dict), so two tokens that decode
    alike share one entry. There the sampled token's own logprob is kept, so that
    ``top_logprobs[i][tokens[i]] == token_logprobs[i]`` always holds; vLLM keeps whichever
    it wrote last."""
    top = {entry.token: entry.logprob}
    for token, logprob in zip(entry.top_tokens, entry.top_logprobs, strict=False):
        top.setdefault(token, logprob)
    return top


class Responder:
    """Answers one API request from its started ``Run``."""

    def __init__(self, *, kind: str, plan: GenerationPlan, run: Run, model: str) -> None:
        self.kind = kind  # "chat" or "completion"
        self.plan = plan
        self.run = run
        self.response_id = run.spec.request_id
        self.model = model
        self.created = int(time.time())
        self.outputs = [_Output() for _ in run.choices]
        # an echo's prompt, per prompt: its text and its tokens' logprobs (None unless asked),
        # from the first choice of the prompt (the engine computes them for that one only)
        self.echoes: dict[int, tuple[str, list[TokenLogprobs] | None]] = {}
        # a chat that may call tools reads each choice's text back through one of these
        self.readers: list[ToolCallReader] | None = None
        # streamed choices of an auto-mode chat whose role chunk waits for the reader: it
        # opens a call without content, text with "", as OpenAI's
        self.unopened: set[int] = set()

    async def _start_reading_tool_calls(self) -> None:
        plan = self.plan.tool_plan
        if plan is None:
            return
        parser = ""
        if plan.mode == "auto":
            parser = await get_pool().tool_call_parser(self.run.caller.deployment.endpoints) or ""
        self.readers = [ToolCallReader(plan, parser) for _ in self.run.choices]

    def usage(self) -> schemas.Usage:
        meter = self.run.meter
        return schemas.Usage(
            prompt_tokens=meter.prompt_tokens,
            completion_tokens=meter.completion_tokens,
            total_tokens=meter.total_tokens,
            prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=meter.cached_tokens),
        )

    async def complete(self) -> schemas.ChatCompletion | schemas.Completion:
        """Run to the end and build the whole response object; ``ApiError`` if it fails."""
        try:
            await self._start_reading_tool_calls()
            async for choice, delta in self.run.deltas():
                output = self.outputs[choice.index]
                text, logprobs = self._shown(choice, delta)
                if text:
                    output.text.append(text)
                if logprobs:
                    output.logprobs.extend(logprobs)
        except RunError as exc:
            raise from_run_error(exc) from exc
        wants_logprobs = self.plan.logprobs is not None
        if self.kind == "chat":
            choices = [
                schemas.ChatChoice(
                    index=c.index,
                    message=self._message(c, o),
                    logprobs=_chat_logprobs(o.logprobs) if wants_logprobs else None,
                    finish_reason=self._chat_finish_reason(c),
                )
                for c, o in zip(self.run.choices, self.outputs, strict=True)
            ]
        else:
            choices = []
            for c, o in zip(self.run.choices, self.outputs, strict=True):
                logprobs = None
                if wants_logprobs:
                    # an echo's logprobs can be millions of entries: each choice's are built
                    # and encoded on their own, the event loop looked at in between (its
                    # other streams' heartbeats go on)
                    logprobs = msgspec.Raw(msgspec.json.encode(_completion_logprobs(o.logprobs, o)))
                    o.logprobs.clear()
                    await asyncio.sleep(0)
                choices.append(
                    schemas.CompletionChoice(
                        index=c.index,
                        text="".join(o.text),
                        logprobs=logprobs,
                        finish_reason=_finish_reason(c.finish_reason),
                    )
                )
        return self._envelope(choices, is_chunk=False, usage=self.usage())

    def _shown(
        self, choice: Choice, delta: GenerateDelta
    ) -> tuple[str, list[TokenLogprobs] | None]:
        """A delta's text and logprobs as its choice shows them: with ``echo`` the first
        begins with the prompt (a text prompt as it was sent, token ids as the engine decoded
        them) and, where logprobs are asked for, its tokens' logprobs; an echo alone
        (``max_tokens`` 0) shows nothing of the one token drawn."""
        text, logprobs = delta.text, delta.logprobs
        plan = self.plan
        if plan.echo_only:
            text, logprobs = "", None
        output = self.outputs[choice.index]
        if not plan.echo or output.echoed:
            return text, logprobs
        output.echoed = True
        prompt_index = choice.index // plan.n
        if choice.is_first_of_prompt:
            self.echoes[prompt_index] = self._echo(prompt_index, delta)
        prompt_text, prompt_logprobs = self.echoes[prompt_index]
        if prompt_logprobs:
            output.first_unscored = True
            logprobs = [*prompt_logprobs, *(logprobs or [])]
        return prompt_text + text, logprobs

    def _echo(
        self, prompt_index: int, delta: GenerateDelta
    ) -> tuple[str, list[TokenLogprobs] | None]:
        """A prompt's echo, from the first delta of its first choice: its text (as sent, or
        as the engine decoded its token ids) and its tokens' logprobs where asked for.
        ``ECHO_UNSUPPORTED`` where the engine sent what was asked for not (an older engine
        ignores the fields it does not know: the answer would be wrong, not refused)."""
        prompt = self.plan.prompts[prompt_index]
        prompt_text = prompt.prompt if prompt.prompt is not None else delta.prompt_text
        wants_logprobs = self.plan.logprobs is not None
        if prompt_text is None or (wants_logprobs and delta.prompt_logprobs is None):
            raise ECHO_UNSUPPORTED
        return prompt_text, delta.prompt_logprobs if wants_logprobs else None

    def _message(self, choice: Choice, output: _Output) -> schemas.AssistantMessage:
        text = "".join(output.text)
        if self.readers is None:
            return schemas.AssistantMessage(role="assistant", content=text)
        reader = self.readers[choice.index]
        reader.feed(text)
        reader.finish()
        calls = [
            schemas.ToolCallOut(
                id=call.id,
                function=schemas.ToolCallFunction(name=call.name, arguments=call.arguments),
            )
            for call in reader.calls
        ]
        return schemas.AssistantMessage(
            role="assistant", content=reader.content, tool_calls=calls or None
        )

    def _chat_finish_reason(self, choice: Choice) -> str | None:
        """OpenAI's finish reason: a choice that ended by calling tools of its own choosing
        (``auto`` or ``required``) says ``tool_calls``; one that called the function the
        request named says ``stop``, as OpenAI's and vLLM's do."""
        reason = _finish_reason(choice.finish_reason)
        if reason != "stop" or self.readers is None or self.plan.tool_plan.mode == "named":
            return reason
        return "tool_calls" if self.readers[choice.index].calls else reason

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

    async def _free_admission(self) -> None:
        """The run's slots, freed before the client reads the end of its answer."""
        try:
            await self.run.meter.free_admission()
        except Exception:  # the settlement frees them (or their leases run out)
            logger.exception("freeing the admission of %s failed", self.run.spec.request_id)

    async def sse(self) -> AsyncIterator[bytes]:
        """The response as server-sent events, ending with ``data: [DONE]``, or with an error
        event where the run fails."""
        # Events that are ready together go out in one write: the role chunks with the first
        # token, tokens that queued up while the server was busy, and the last token with its
        # finish chunk, the usage and [DONE].
        events: list[bytes] = []
        try:
            await self._start_reading_tool_calls()
            tool_plan = self.plan.tool_plan
            if self.kind == "chat" and tool_plan is not None and tool_plan.mode == "auto":
                self.unopened = {choice.index for choice in self.run.choices}
            elif self.kind == "chat":
                # a forced call's message has no content (null, as unstreamed), another's ""
                is_call = tool_plan is not None and tool_plan.mode in ("required", "named")
                first = schemas.ChunkDelta(role="assistant", content=None if is_call else "")
                events += [self._chat_chunk(choice, first) for choice in self.run.choices]
            num_open = len(self.run.choices)
            async for choice, delta in self.run.deltas():
                if self.readers is not None:
                    events += self._tool_reader_events(choice, delta.text, delta.logprobs)
                else:
                    text, logprobs = self._shown(choice, delta)
                    if text or logprobs:
                        events.append(self._text_event(choice, text, None, logprobs))
                if choice.finish_reason is not None:
                    if self.readers is not None:
                        events += self._tool_reader_events(choice, None, None, is_last=True)
                    finish = self._chat_finish_reason(choice)
                    events.append(self._text_event(choice, None, finish))
                    num_open -= 1
                if num_open and events and not self.run.num_ready():
                    yield b"".join(events)
                    events.clear()
            if self.plan.include_usage:
                events.append(self._usage_event())
            events.append(b"data: [DONE]\n\n")
            await self._free_admission()
            yield b"".join(events)
        except RunError as exc:
            yield b"".join([*events, _event(from_run_error(exc).body())])
        except ApiError as exc:
            self.run.meter.fail(exc.code or "invalid_request")
            yield b"".join([*events, _event(exc.body())])
        except Exception:
            # the response has started: a 500 can no longer be sent, and raised from here
            # the response would never end, so the stream ends with the error as its event
            logger.exception("the stream of %s failed", self.run.spec.request_id)
            self.run.meter.fail("internal_error")
            yield b"".join([*events, _event(STREAM_FAILED.body())])

    def _text_event(
        self,
        choice: Choice,
        text: str | None,
        finish: str | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> bytes:
        wants_logprobs = bool(logprobs) and self.plan.logprobs is not None
        output = self.outputs[choice.index]
        if text and finish is None and not wants_logprobs:
            # most events of a stream: one token's text, nothing else
            prefix, suffix = output.text_template or self._text_template(choice)
            return prefix + msgspec.json.encode(text) + suffix
        if self.kind == "chat":
            chat_logprobs = _chat_logprobs(logprobs) if wants_logprobs else None
            return self._chat_chunk(choice, schemas.ChunkDelta(content=text), finish, chat_logprobs)
        completion_logprobs = _completion_logprobs(logprobs, output) if wants_logprobs else None
        return self._completion_chunk(choice, text or "", finish, completion_logprobs)

    def _tool_reader_events(
        self,
        choice: Choice,
        text: str | None,
        logprobs: list[TokenLogprobs] | None,
        *,
        is_last: bool = False,
    ) -> list[bytes]:
        """The events of a chat that may call tools: its text read back as content and
        tool call pieces (``delta.tool_calls``, OpenAI's index/id/name/arguments)."""
        reader = self.readers[choice.index]
        pieces = reader.finish() if is_last else reader.feed(text or "")
        events = []
        for piece in pieces:
            if isinstance(piece, str):
                events += self._opening(choice)
                events.append(self._text_event(choice, piece, None))
            elif choice.index in self.unopened:  # the call's first piece opens the message
                self.unopened.discard(choice.index)
                delta = schemas.ChunkDelta(role="assistant", tool_calls=[_call(piece)])
                events.append(self._chat_chunk(choice, delta))
            else:
                delta = schemas.ChunkDelta(tool_calls=[_call(piece)])
                events.append(self._chat_chunk(choice, delta))
        if is_last or (logprobs and self.plan.logprobs is not None):
            events[:0] = self._opening(choice)  # nothing read yet: opened as text
        if logprobs and self.plan.logprobs is not None:
            chunk_logprobs = _chat_logprobs(logprobs)
            events.append(self._chat_chunk(choice, schemas.ChunkDelta(), None, chunk_logprobs))
        return events

    def _opening(self, choice: Choice) -> list[bytes]:
        """The role chunk of an auto-mode choice not yet opened, as text (none otherwise)."""
        if choice.index not in self.unopened:
            return []
        self.unopened.discard(choice.index)
        return [self._chat_chunk(choice, schemas.ChunkDelta(role="assistant", content=""))]

    def _text_template(self, choice: Choice) -> tuple[bytes, bytes]:
        """The bytes of a plain text event of ``choice`` before and after its JSON-encoded
        text, cut from one event encoded in full around a placeholder: the same bytes as
        encoding each event's objects, for a fraction of the time."""
        if self.kind == "chat":
            event = self._chat_chunk(choice, schemas.ChunkDelta(content=_TEXT_PLACEHOLDER))
        else:
            event = self._completion_chunk(choice, _TEXT_PLACEHOLDER, None, None)
        prefix, _, suffix = event.partition(msgspec.json.encode(_TEXT_PLACEHOLDER))
        self.outputs[choice.index].text_template = (prefix, suffix)
        return prefix, suffix

    def _completion_chunk(
        self,
        choice: Choice,
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
        choice: Choice,
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


def _call(piece: CallDelta) -> schemas.ToolCallDelta:
    function = schemas.ToolCallFunctionDelta(name=piece.name, arguments=piece.arguments)
    if piece.id is None:
        return schemas.ToolCallDelta(index=piece.index, function=function)
    return schemas.ToolCallDelta(index=piece.index, id=piece.id, type="function", function=function)


def _finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "stop" if reason == FinishReason.ERROR else str(reason)
