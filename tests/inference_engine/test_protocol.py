from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from inference_engine.config import EngineConfig
from inference_engine.protocol import EngineOutput, FinishReason, RequestType, SamplingParams


def test_defaults_match_vllm():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert params.max_tokens == 16 and params.min_tokens == 0 and params.seed is None
    assert params.stop is None and params.stop_token_ids is None and params.logprobs is None
    assert not params.ignore_eos


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("logprobs", 21),
        ("seed", 1.5),
        ("seed", 2**64),  # past a torch generator's range: it failed the whole batch's step
        ("seed", -(2**63) - 1),
        ("temperature", float("nan")),
    ],
)
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_seed_is_taken_across_a_torch_generators_range():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_max_tokens_none_means_up_to_the_context_and_survives_the_wire():
    params = SamplingParams(max_tokens=None, min_tokens=3)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.max_tokens is None and decoded.min_tokens == 3


def test_stop_string_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


def test_wire_round_trip_and_validation_on_decode():
    params = SamplingParams(temperature=0.5, stop=["x"], seed=3, logprobs=2)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
    bad = msgspec.msgpack.encode([-1.0])
    with pytest.raises((ValueError, msgspec.ValidationError), match="temperature"):
        msgspec.msgpack.decode(bad, type=SamplingParams)


def test_output_round_trip():
    output = EngineOutput("r1", [1, 2], finish_reason=FinishReason.LENGTH, num_output_tokens=2)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(output), type=EngineOutput)
    assert decoded == output and decoded.is_finished
    assert str(FinishReason.ABORT) == "abort"
    assert len(RequestType.GENERATE.value) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"max_num_seqs": -1},
        {"dtype": "int8"},
        {"num_kv_blocks": 0},
        {"num_kv_blocks": 4, "kv_cache_memory": 1024},
    ],
)
def test_engine_config_validation(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(model="m", **kwargs)


def test_importing_the_package_and_protocol_does_not_import_torch():
    code = (
        "import sys, inference_engine, inference_engine.protocol;"
        "inference_engine.SamplingParams;"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_skip_special_tokens_is_on_by_default_and_travels():
    """vLLM's default; a request that turns it off says so on the wire, one that keeps it
    sends nothing more (an older engine reads the same)."""
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(SamplingParams)
    assert SamplingParams().skip_special_tokens is True
    assert encoder.encode(SamplingParams()) == encoder.encode(
        SamplingParams(skip_special_tokens=True)
    )
    assert (
        decoder.decode(
            encoder.encode(SamplingParams(skip_special_tokens=False))
        ).skip_special_tokens
        is False
    )
