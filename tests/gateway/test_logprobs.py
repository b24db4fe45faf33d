"""Logprobs as OpenAI gives them, from the engine's entries: each token's own bytes (a token
may hold part of a character) and, for completions, where each token starts in the text."""

from gateway.responses import _chat_logprobs, _completion_logprobs, _Output
from inference_engine.protocol import TokenLogprobs


def _entry(raw: bytes, token: str) -> TokenLogprobs:
    return TokenLogprobs(
        -0.5, [7], [-0.5], token=token, top_tokens=[token], token_bytes=raw, top_token_bytes=[raw]
    )


# "é" in two tokens, then " ok"
SPLIT = [_entry(b"\xc3", "bytes:\\xc3"), _entry(b"\xa9", "bytes:\\xa9"), _entry(b" ok", " ok")]


def test_chat_bytes_are_each_tokens_own_and_spell_the_text():
    content = _chat_logprobs(SPLIT).content
    assert [entry.bytes for entry in content] == [[0xC3], [0xA9], list(b" ok")]
    assert bytes(b for entry in content for b in entry.bytes).decode() == "é ok"
    assert content[0].top_logprobs[0].bytes == [0xC3]


def test_completion_offsets_count_characters_not_token_texts():
    """Offsets were the lengths of the tokens' texts: U+FFFD for each part of a character."""
    output = _Output()
    first = _completion_logprobs(SPLIT[:1], output)  # a stream: one chunk, then the next
    rest = _completion_logprobs(SPLIT[1:], output)
    assert first.text_offset + rest.text_offset == [0, 0, 1]
    assert first.tokens == ["bytes:\\xc3"]


def test_entries_from_an_engine_without_bytes_read_as_before():
    old = TokenLogprobs(-1.0, [3], [-1.0], token="hi", top_tokens=["hi"])
    assert _chat_logprobs([old]).content[0].bytes == list(b"hi")
    assert _completion_logprobs([old, old], _Output()).text_offset == [0, 2]
