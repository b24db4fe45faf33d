"""``python -m inference_engine``'s flags are ``EngineConfig``'s fields, with its defaults."""

from __future__ import annotations

from dataclasses import fields

from inference_engine.__main__ import engine_config_from, parse_args
from inference_engine.config import EngineConfig


def test_the_defaults_are_engine_configs_own():
    assert engine_config_from(parse_args(["--model", "m"])) == EngineConfig(model="m")


def test_every_engine_config_field_has_a_flag():
    args = parse_args(["--model", "m"])
    missing = [f.name for f in fields(EngineConfig) if not hasattr(args, f.name)]
    assert missing == ["enable_prefix_caching"]  # set by --no-enable-prefix-caching


def test_flags_reach_the_config():
    config = engine_config_from(
        parse_args(
            ["--model", "m", "--block-size", "32", "--enforce-eager", "--no-enable-prefix-caching",
             "--gpu-memory-utilization", "0.5", "--attention-backend", "torch"]
        )
    )  # fmt: skip
    assert (config.block_size, config.enforce_eager, config.enable_prefix_caching) == (
        32,
        True,
        False,
    )
    assert (config.gpu_memory_utilization, config.attention_backend) == (0.5, "torch")
