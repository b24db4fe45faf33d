"""How many tokens a run may use, decided once for the API and the chat alike.

Before the engine counts a prompt, the web tier knows two figures for it. The *likely* count
(OpenAI's rule of thumb, four characters a token) decides whether a request could ever fit a
limit. The *most* it can be is what admission holds against the limits until the request
settles with the engine's count: byte-level BPE (and SentencePiece with byte fallback) spends
at most one token per UTF-8 byte, and a chat template adds a few tokens per message and some
once.

``max_tokens`` unset means "up to the context length", as OpenAI's and vLLM's chat completions
have it (their legacy completions default to 16, which ``gateway.validation`` sets): the engine
stops a request there (``SamplingParams.max_tokens=None``). A ``max_tokens`` above the whole
context can never be honoured and is refused.
"""

from dataclasses import dataclass

from inference_engine.protocol import Message

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
MAX_TEMPLATE_TOKENS_PER_MESSAGE = 16
MAX_TEMPLATE_TOKENS = 256
# a tokenizer may add a beginning-of-sequence token or two to a plain prompt
MAX_SPECIAL_TOKENS_PER_PROMPT = 2


@dataclass(frozen=True)
class PromptTokens:
    """A prompt's token count before the engine has counted it: likely, and at most."""

    likely: int
    most: int

    def __add__(self, other: "PromptTokens") -> "PromptTokens":
        return PromptTokens(self.likely + other.likely, self.most + other.most)


def message_tokens(messages: list[Message]) -> PromptTokens:
    """A chat prompt's likely and largest token count."""
    likely = sum(len(m.content) // CHARS_PER_TOKEN + TOKENS_PER_MESSAGE for m in messages)
    most = MAX_TEMPLATE_TOKENS + sum(
        len(m.content.encode()) + len(m.role) + MAX_TEMPLATE_TOKENS_PER_MESSAGE for m in messages
    )
    return PromptTokens(likely, most)


def text_tokens(text: str) -> PromptTokens:
    """A plain prompt's likely and largest token count."""
    return PromptTokens(
        len(text) // CHARS_PER_TOKEN + 1, len(text.encode()) + MAX_SPECIAL_TOKENS_PER_PROMPT
    )


def token_id_tokens(token_ids: list[int]) -> PromptTokens:
    return PromptTokens(len(token_ids), len(token_ids))


class ContextExceeded(ValueError):
    """A ``max_tokens`` larger than the whole context."""


@dataclass(frozen=True)
class Reservation:
    """Tokens a run may use, for admission: ``tokens`` (at most: held against the budgets
    until the run settles with the engine's count) and ``likely_tokens`` (more than a limit,
    and no wait would ever admit it)."""

    tokens: int
    likely_tokens: int


def reserve(*, prompt: PromptTokens, max_tokens: list[int | None], max_context: int) -> Reservation:
    """The tokens to reserve for completions of up to ``max_tokens`` each (one per choice;
    None: up to ``max_context``) after a prompt of ``prompt`` tokens (all of the run's
    prompts together). Raises ``ContextExceeded`` for a ``max_tokens`` over the context."""
    largest = max((m for m in max_tokens if m is not None), default=None)
    if largest is not None and largest > max_context:
        raise ContextExceeded(
            f"This model's maximum context length is {max_context} tokens. However, you "
            f"requested {largest} tokens for the completion."
        )
    # Unset: it may run to the context (held: each prompt's own share of it at most), but it
    # may as well stop at its first token, so no limit below the context makes it hopeless
    # (OpenAI counts max_tokens where it is given, and the prompt's characters).
    completion = sum(max_context if m is None else m for m in max_tokens)
    likely_completion = sum(1 if m is None else m for m in max_tokens)
    return Reservation(
        tokens=prompt.most + completion, likely_tokens=prompt.likely + likely_completion
    )
