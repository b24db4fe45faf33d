from __future__ import annotations

import pytest

from inference_engine.tokenization import IncrementalDetokenizer, find_stop_string, render_chat


def stream(tokenizer, text: str, prompt: str = "hello") -> list[str]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer(prompt)["input_ids"])
    deltas = [detokenizer.push([token_id]) for token_id in ids]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == detokenizer.text
    return deltas


def test_multibyte_characters_split_across_tokens_are_held_back(tokenizer):
    text = "price: 5€ 😀 naïve 日本"
    deltas = stream(tokenizer, text)
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)
    # the euro sign is three byte tokens: two of them produce no text
    assert "€" in deltas or any(delta.startswith("€") for delta in deltas)
    assert deltas.count("") >= 2


def test_ascii_streams_token_by_token_with_spaces(tokenizer):
    text = "the quick brown fox"
    assert "".join(stream(tokenizer, text, prompt="say:")) == text


def test_flush_emits_an_incomplete_tail(tokenizer):
    euro = tokenizer("€", add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.push(euro[:1]) == ""
    assert detokenizer.flush() == "\ufffd"


@pytest.mark.parametrize("tail", ["", " ok", "€ and 😀"])
def test_a_prompt_ending_inside_a_character_lends_none_of_its_text_to_the_output(tokenizer, tail):
    """The prompt's last token is the first byte of "é", the output's first token its second:
    the character straddles the two, and the output's text is what the whole text adds to the
    prompt's (as vLLM's detokenizer counts it). It was the whole decode window, " café",
    prompt text included."""
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    e_acute = ids("é")
    assert len(e_acute) == 2  # two byte tokens, or the case is not what it says
    prompt = ids("the lazy caf") + e_acute[:1]
    output = e_acute[1:] + ids(tail)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detokenizer.push([token_id]) for token_id in output) + detokenizer.flush()

    whole, prompt_text = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
    assert text == whole[len(prompt_text) :] == tail


def test_stop_strings_find_the_earliest_new_hit():
    assert find_stop_string("abc###def", ["###"], 9) == (3, 6)
    assert find_stop_string("abc##", ["###"], 1) is None
    assert find_stop_string("abc###", ["###"], 1) == (3, 6)  # completed by the last char
    assert find_stop_string("a STOP b END", ["END", "STOP"], 12) == (2, 6)
    assert find_stop_string("anything", [], 3) is None
    # each stop string is looked for only where the new characters could complete it
    assert find_stop_string("xab" + "c", ["ab", "zzzzzz"], 1) is None
    assert find_stop_string("xa" + "b", ["ab", "zzzzzz"], 1) == (1, 3)


def test_of_stop_strings_completed_at_once_the_one_that_ends_first_is_found():
    # a prefix of another, listed after it
    assert find_stop_string("x" + "abc", ["abc", "ab"], 3) == (1, 3)
    # inside another that starts earlier: its last character comes first
    assert find_stop_string("abcd", ["abcd", "bc"], 4) == (1, 3)
    # ending together, the one that starts first is cut whole
    assert find_stop_string("xabc", ["bc", "abc"], 4) == (1, 4)


def test_chat_template_renders_for_generation(tokenizer):
    ids = render_chat(tokenizer, [{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids) == "<|user|>hi<|end|><|assistant|>"
    with pytest.raises(ValueError, match="role"):
        render_chat(tokenizer, [{"content": "no role"}])


def test_token_bytes_give_each_tokens_own_bytes(tokenizer):
    """A token that holds part of a character decoded to U+FFFD alone: OpenAI's ``bytes``
    (which exist so that a client can put such characters back together) said EF BF BD."""
    from inference_engine.tokenization import TokenBytes, token_text

    token_bytes = TokenBytes(tokenizer)
    text = "héllo ✓ 🙂"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [token_bytes(token_id) for token_id in ids]
    assert b"".join(pieces).decode() == text
    assert any(len(piece) == 1 and piece[0] >= 0x80 for piece in pieces)  # a split character
    assert token_text(b"\xc3") == "bytes:\\xc3" and token_text(b" h") == " h"


def test_token_bytes_read_sentencepiece_byte_fallback():
    from inference_engine.tokenization import TokenBytes

    class Decoder:
        def __repr__(self) -> str:
            return "Sequence(decoders=[Replace(...), ByteFallback(), Fuse(), Strip(...)])"

    class Tokenizer:
        backend_tokenizer = type("Backend", (), {"decoder": Decoder()})()
        tokens = {1: "<0xE6>", 2: "\u2581hello", 3: "<s>"}

        def convert_ids_to_tokens(self, token_id: int) -> str:
            return self.tokens[token_id]

    token_bytes = TokenBytes(Tokenizer())
    assert [token_bytes(i) for i in (1, 2, 3)] == [b"\xe6", b" hello", b"<s>"]
