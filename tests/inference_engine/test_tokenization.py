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


def test_stop_strings_find_the_earliest_new_hit():
    assert find_stop_string("abc###def", ["###"], 9) == 3
    assert find_stop_string("abc##", ["###"], 1) is None
    assert find_stop_string("abc###", ["###"], 1) == 3  # completed by the last char
    assert find_stop_string("a STOP b END", ["END", "STOP"], 12) == 2
    assert find_stop_string("anything", [], 3) is None


def test_chat_template_renders_for_generation(tokenizer):
    ids = render_chat(tokenizer, [{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids) == "<|user|>hi<|end|><|assistant|>"
    with pytest.raises(ValueError, match="role"):
        render_chat(tokenizer, [{"content": "no role"}])
