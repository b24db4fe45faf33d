"""Chat templates, the incremental detokenizer and stop strings. No torch."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from inference_engine.protocol import Message

# prompt tokens kept as left context so the first output token decodes with the right spacing
NUM_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Llama 3, Qwen and the demo model use it too): each
    byte's printable stand-in, mapped back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    stand_ins = {byte: byte for byte in printable}
    for byte in range(256):
        if byte not in stand_ins:
            stand_ins[byte] = 256 + len(stand_ins) - len(printable)
    return {chr(char): byte for byte, char in stand_ins.items()}


_BYTE_OF = _byte_level_alphabet()


class TokenBytes:
    """Each token's own bytes, as OpenAI's logprobs give them (a token may hold part of a
    character, which its decoded text shows as U+FFFD): a byte-level BPE token's stand-ins
    mapped back, a SentencePiece byte-fallback token ``<0xE6>`` its byte and ``▁`` a space,
    any other its decoded text. Cached per token id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        described = repr(decoder)
        self.kind = (
            "byte_level"
            if "ByteLevel" in described
            else "byte_fallback"
            if "ByteFallback" in described
            else ""
        )
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._cache[token_id] = self._bytes(token_id)
        return raw

    def _bytes(self, token_id: int) -> bytes:
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(token, str) and self.kind == "byte_level":
            if all(char in _BYTE_OF for char in token):
                return bytes(_BYTE_OF[char] for char in token)
        elif isinstance(token, str) and self.kind == "byte_fallback":
            if match := _BYTE_TOKEN.fullmatch(token):
                return bytes([int(match.group(1), 16)])
            return token.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id]).encode()  # an added token, written as text


def token_text(raw: bytes) -> str:
    """A token's text as OpenAI shows it: its characters, or where its bytes are not whole
    UTF-8, ``bytes:`` and their escapes (``bytes:\\xc3``)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template, ready for the
    assistant's turn. ``tools`` (OpenAI's function tool objects) are passed to the template,
    which shows them to the model where it knows how (transformers' convention)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template")
    for message in messages:
        if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
            raise ValueError(f"each message needs 'role' and 'content': {message!r}")
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token of ``tokenizer`` spells, special and added tokens
    included: a text of ``n`` characters is at least ``n / longest_token_chars`` tokens (a
    byte-level vocabulary spells a byte per character, and a text's character is at least a
    byte)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def min_prompt_tokens(
    prompt: str | None, messages: list[Message] | None, longest_token: int
) -> int:
    """The fewest tokens a prompt (or the messages' contents, which their template renders)
    can come to, counted without tokenizing: a prompt over the context by this count is
    refused at once, not after seconds of tokenizing megabytes."""
    if prompt is not None:
        num_chars = len(prompt)
    elif messages is not None:
        num_chars = sum(len(message.content) for message in messages)
    else:
        return 0
    return -(-num_chars // longest_token)


def tool_call_parser(tokenizer: PreTrainedTokenizerBase | None) -> str:
    """How the model writes a tool call, read from its chat template: "hermes" for the
    ``<tool_call>{"name": …, "arguments": …}</tool_call>`` convention of Hermes, Qwen 2.5/3
    and the demo model; "" where the template shows no convention the API can parse."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: the default one, or any
        template = template.get("tool_use") or template.get("default") or ""
    return "hermes" if "<tool_call>" in template else ""


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A character whose bytes are split across tokens is held back until it is complete: text
    that ends in U+FFFD is not emitted yet. Each decode covers only a short window that starts
    where the previous emitted delta started, so the cost per token stays constant. A delta is
    what the window's text adds to its prefix's, by length (as vLLM's): a character that
    straddles the prompt and the output is the prompt's, and no prompt text is emitted.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_token_ids: list[int]) -> str:
        """Add tokens; returns the newly completed text (may be empty)."""
        self.token_ids.extend(new_token_ids)
        text = self._decode(self.token_ids[self.prefix_offset :])
        if text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Emit whatever is held back (at the end of a request)."""
        if self.read_offset == len(self.token_ids):
            return ""
        return self._emit(self._decode(self.token_ids[self.prefix_offset :]))

    def _emit(self, text: str) -> str:
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        if len(text) <= len(prefix):
            return ""  # what the new tokens completed was counted in the prefix's text
        delta = text[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


def find_stop_string(text: str, stop: list[str], num_new_chars: int) -> tuple[int, int] | None:
    """Where (start, end) in ``text`` the stop string completed first lies, looking only where
    the last ``num_new_chars`` characters could complete one; None when there is none. Of
    several completed by the same characters, the one whose last character comes first (as if
    the text came a character at a time), then the longest, whatever their order in ``stop``."""
    old_end = len(text) - num_new_chars  # each stop string is searched from where it could
    hits = [  # end past the old text: one found wholly in it was not completed now
        (i + len(s), i) for s in stop if (i := text.find(s, max(0, old_end - len(s) + 1))) >= 0
    ]
    if not hits:
        return None
    end, start = min(hits)
    return start, end
