"""OutputProcessor in process: detokenization, stop strings, frames per client, failures."""

from __future__ import annotations

import msgspec
import pytest

from inference_engine.output_processor import OutputProcessor
from inference_engine.protocol import (
    EngineOutput,
    ErrorCode,
    FinishReason,
    GenerateDelta,
    RequestTimings,
    ResponseType,
    SamplingParams,
)

DECODER = msgspec.msgpack.Decoder(list[GenerateDelta])


class Harness:
    def __init__(self, tokenizer) -> None:
        self.aborted: list[str] = []
        self.processor = OutputProcessor(tokenizer, abort=self.aborted.extend)
        self.tokenizer = tokenizer

    def add(self, req_id: str, identity: bytes = b"c1", **params) -> None:
        prompt = self.tokenizer("hello")["input_ids"]
        self.processor.add_request(req_id, identity, req_id, prompt, SamplingParams(**params))

    def step(self, *outputs: EngineOutput) -> dict[bytes, list[GenerateDelta]]:
        frames = self.processor.process(list(outputs), step_time=1.0)
        assert all(frame[1] == ResponseType.OUTPUTS.value for frame in frames)
        return {frame[0]: DECODER.decode(frame[2]) for frame in frames}


def finished(req_id: str, reason: FinishReason, num_tokens: int, *tokens: int) -> EngineOutput:
    return EngineOutput(
        req_id,
        list(tokens),
        finish_reason=reason,
        num_prompt_tokens=1,
        num_output_tokens=num_tokens,
        timings=RequestTimings(1.0, 2.0, 3.0, 4.0),
    )


def test_multibyte_characters_come_out_whole(tokenizer):
    harness = Harness(tokenizer)
    harness.add("r")
    text = "héllo ✓ wörld 🙂"
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas = [harness.step(EngineOutput("r", [t]))[b"c1"][0] for t in token_ids[:-1]]
    deltas += harness.step(finished("r", FinishReason.LENGTH, len(token_ids), token_ids[-1]))[b"c1"]
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == text
    last = deltas[-1]
    assert last.finish_reason == FinishReason.LENGTH and last.usage.completion_tokens == len(
        token_ids
    )
    assert last.timings == RequestTimings(1.0, 2.0, 3.0, 4.0)
    assert "r" not in harness.processor.states


def test_stop_string_is_held_back_cut_and_aborts_in_the_core(tokenizer):
    harness = Harness(tokenizer)
    harness.add("r", stop=["brown"])
    token_ids = tokenizer("the quick brown fox jumps", add_special_tokens=False)["input_ids"]
    sent = []
    for token in token_ids:
        for delta in harness.step(EngineOutput("r", [token])).get(b"c1", []):
            sent.append(delta)
        if harness.aborted:
            break
    num_tokens = sum(len(d.token_ids) for d in sent)
    assert harness.aborted == ["r"]
    assert "".join(d.text for d in sent) == "the quick "
    assert all(d.finish_reason is None for d in sent)
    # a token computed before the core saw the abort is dropped; the abort output ends it
    assert harness.step(EngineOutput("r", [token_ids[-1]])) == {}
    [last] = harness.step(finished("r", FinishReason.ABORT, num_tokens + 1))[b"c1"]
    assert (last.text, last.token_ids, last.finish_reason) == ("", [], FinishReason.STOP)
    assert last.usage.completion_tokens == num_tokens
    assert last.timings.finished == 4.0


@pytest.mark.parametrize("stop", [["quick"], ["quick", "a longer stop string"]])
def test_a_stop_string_within_min_tokens_does_not_stop_the_request(tokenizer, stop):
    """As vLLM: stop strings count only once more than ``min_tokens`` tokens exist (as EOS
    and stop tokens do); a request asked for at least 8 tokens ended after 3. With a longer
    stop string beside it, the search reached back by the longer's length for every stop
    string, and found the one in the window again after it."""
    harness = Harness(tokenizer)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    min_tokens = len(ids("the quick brown"))
    harness.add("r", stop=stop, min_tokens=min_tokens)
    sent = []
    for token in ids("the quick brown fox quick dog"):
        sent += harness.step(EngineOutput("r", [token])).get(b"c1", [])
        if harness.aborted:
            break
    assert harness.aborted == ["r"]
    assert "".join(d.text for d in sent) == "the quick brown fox "
    assert sum(len(d.token_ids) for d in sent) > min_tokens


@pytest.mark.parametrize(("include_stop", "text"), [(False, "the quick"), (True, "the quick fox")])
def test_a_stop_token_is_no_text_unless_asked_for(tokenizer, include_stop, text):
    """As vLLM: a request the core stops on one of its ``stop_token_ids`` (an ordinary token
    here) leaves that token's text out, unless ``include_stop_str_in_output``; its id stays."""
    harness = Harness(tokenizer)
    token_ids = tokenizer("the quick fox", add_special_tokens=False)["input_ids"]
    harness.add("r", stop_token_ids=[token_ids[-1]], include_stop_str_in_output=include_stop)
    deltas = [d for t in token_ids[:-1] for d in harness.step(EngineOutput("r", [t]))[b"c1"]]
    deltas += harness.step(finished("r", FinishReason.STOP, len(token_ids), token_ids[-1]))[b"c1"]
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == token_ids
    assert deltas[-1].finish_reason == FinishReason.STOP


def test_a_stop_tokens_logprob_is_left_out_with_its_text(tokenizer):
    """OpenAI's logprobs spell the content: the end-of-turn token's entry made them one
    longer than the text."""
    from inference_engine.protocol import TokenLogprobs

    harness = Harness(tokenizer)
    token_ids = tokenizer("the quick fox", add_special_tokens=False)["input_ids"]
    harness.add("r", stop_token_ids=[token_ids[-1]], logprobs=0)
    deltas = []
    for n, token in enumerate(token_ids):
        output = (
            finished("r", FinishReason.STOP, len(token_ids), token)
            if n == len(token_ids) - 1
            else EngineOutput("r", [token])
        )
        output.new_logprobs = [TokenLogprobs(-0.5)]
        deltas += harness.step(output)[b"c1"]
    entries = [entry for delta in deltas for entry in delta.logprobs or ()]
    assert "".join(entry.token for entry in entries) == "the quick"
    assert len(entries) == len(token_ids) - 1


def test_stop_string_in_the_last_token_finishes_at_once(tokenizer):
    harness = Harness(tokenizer)
    harness.add("r", stop=["fox"])
    token_ids = tokenizer("the fox", add_special_tokens=False)["input_ids"]
    deltas = [d for t in token_ids[:-1] for d in harness.step(EngineOutput("r", [t]))[b"c1"]]
    deltas += harness.step(finished("r", FinishReason.LENGTH, len(token_ids), token_ids[-1]))[b"c1"]
    assert "".join(d.text for d in deltas) == "the "
    assert deltas[-1].finish_reason == FinishReason.STOP and harness.aborted == []


def test_one_frame_per_client_per_step(tokenizer):
    harness = Harness(tokenizer)
    for req_id, identity in (("a", b"c1"), ("b", b"c1"), ("c", b"c2")):
        harness.add(req_id, identity)
    token = tokenizer("the", add_special_tokens=False)["input_ids"][0]
    frames = harness.step(*(EngineOutput(r, [token]) for r in "abc"))
    assert {i: [d.request_id for d in deltas] for i, deltas in frames.items()} == {
        b"c1": ["a", "b"],
        b"c2": ["c"],
    }


def test_errors_from_the_core_end_the_stream_with_their_code(tokenizer):
    harness = Harness(tokenizer)
    harness.add("r")
    output = finished("r", FinishReason.ERROR, 0)
    output.error_code, output.error_message = ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long"
    [delta] = harness.step(output)[b"c1"]
    assert (delta.finish_reason, delta.error, delta.error_message) == (
        FinishReason.ERROR,
        ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        "too long",
    )


class BrokenTokenizer:
    """Decodes like the real one, except that token ``bad`` makes decode raise."""

    def __init__(self, tokenizer, bad: int) -> None:
        self.tokenizer, self.bad = tokenizer, bad

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def decode(self, token_ids, **kwargs):
        if self.bad in token_ids:
            raise RuntimeError("cannot decode")
        return self.tokenizer.decode(token_ids, **kwargs)


@pytest.mark.filterwarnings("ignore")
def test_a_failure_in_one_request_fails_only_that_request(tokenizer):
    good, bad = tokenizer("the quick", add_special_tokens=False)["input_ids"][:2]
    harness = Harness(BrokenTokenizer(tokenizer, bad))
    harness.add("ok")
    harness.add("broken")
    [ok, broken] = harness.step(EngineOutput("ok", [good]), EngineOutput("broken", [bad]))[b"c1"]
    assert ok.error is None and ok.text
    assert broken.error == ErrorCode.ENGINE_ERROR and "cannot decode" in broken.error_message
    assert broken.finish_reason == FinishReason.ERROR
    assert harness.aborted == ["broken"]
    [last] = harness.step(finished("ok", FinishReason.LENGTH, 2, good))[b"c1"]
    assert last.finish_reason == FinishReason.LENGTH


def test_stop_string_kept_when_asked(tokenizer):
    harness = Harness(tokenizer)
    harness.add("r", stop=["zzz", "fox"], include_stop_str_in_output=True)
    token_ids = tokenizer("the fox jumps", add_special_tokens=False)["input_ids"]
    deltas = [d for t in token_ids for d in harness.step(EngineOutput("r", [t])).get(b"c1", [])]
    assert "".join(d.text for d in deltas) == "the fox"


@pytest.mark.parametrize(("skip", "text"), [(True, "hello"), (False, "<|user|>hello")])
def test_special_tokens_are_text_only_when_not_skipped(tokenizer, skip, text):
    """vLLM's ``skip_special_tokens``: off, a special token the model writes (a tool call's
    tag, in some models) is part of the text; the EOS that ends it still is not."""
    harness = Harness(tokenizer)
    harness.add("r", skip_special_tokens=skip)
    token_ids = [
        tokenizer.convert_tokens_to_ids("<|user|>"),
        *tokenizer("hello", add_special_tokens=False)["input_ids"],
        tokenizer.eos_token_id,
    ]
    deltas = [harness.step(EngineOutput("r", [t]))[b"c1"][0] for t in token_ids[:-1]]
    deltas += harness.step(finished("r", FinishReason.STOP, len(token_ids), token_ids[-1]))[b"c1"]
    assert "".join(d.text for d in deltas) == text
