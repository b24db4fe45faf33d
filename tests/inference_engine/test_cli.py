"""``python -m inference_engine``'s flags are ``EngineConfig``'s and ``ServerConfig``'s fields,
with their defaults, and every flag the project's callers pass still parses."""

from __future__ import annotations

from dataclasses import fields

import pytest

from inference_engine.__main__ import config_from, main, parse_args
from inference_engine.config import EngineConfig, ServerConfig


@pytest.mark.parametrize("config_class", [EngineConfig, ServerConfig])
def test_every_field_is_a_flag_with_the_fields_default(config_class):
    args = parse_args(["--model", "m"])
    assert [f.name for f in fields(config_class) if not hasattr(args, f.name)] == []
    defaults = {"model": "m"} if config_class is EngineConfig else {}
    assert config_from(config_class, args) == config_class(**defaults)


def test_flags_reach_the_configs():
    args = parse_args(
        ["--model", "m", "--block-size", "32", "--enforce-eager", "--no-enable-prefix-caching",
         "--gpu-memory-utilization", "0.5", "--attention-backend", "torch",
         "--max-cudagraph-batch-size", "8", "--endpoint", "ipc:///tmp/e.sock",
         "--served-model-name", "tiny", "--no-async-output", "--metrics-port", "9100",
         "--tenant-queue-share", "1", "--threads", "2"]
    )  # fmt: skip
    engine, server = config_from(EngineConfig, args), config_from(ServerConfig, args)
    assert (engine.block_size, engine.enforce_eager, engine.enable_prefix_caching) == (
        32,
        True,
        False,
    )
    assert (engine.gpu_memory_utilization, engine.attention_backend) == (0.5, "torch")
    assert engine.max_cudagraph_batch_size == 8
    assert (server.endpoint, server.served_model_name, server.async_output) == (
        "ipc:///tmp/e.sock",
        "tiny",
        False,
    )
    assert (server.metrics_port, server.tenant_queue_share, args.threads) == (9100, 1.0, 2)


@pytest.mark.parametrize(
    "flags",
    [
        # runplatform, its ENGINE_ARGS default and the README
        "--endpoint tcp://0.0.0.0:5555 --served-model-name demo --threads 1 "
        "--kv-cache-memory 268435456 --dtype bfloat16 --gpu-memory-utilization 0.9",
        # tests/gateway, tests/config and bench/reliability.py
        "--dtype float32 --max-model-len 512 --num-kv-blocks 256",
        # tests/inference_engine/test_server.py
        "--max-frame-bytes 1048576 --metrics-port 9100 --max-num-seqs 2 "
        "--max-queued-requests 2 --shutdown-grace-period 1",
        # bench/engine_serving.py, bench/noisy_neighbour.py, bench/serve_vs_vllm.py
        "--log-level WARNING --no-async-output --scheduling-policy fcfs "
        "--tenant-queue-share 1 --enforce-eager --device cpu",
    ],
)
def test_the_flags_the_projects_callers_pass_still_parse(flags):
    args = parse_args(["--model", "m", *flags.split()])
    config_from(EngineConfig, args)
    config_from(ServerConfig, args)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-queued-requests", "-1"], "max_queued_requests must be >= 0"),
        (["--tenant-queue-share", "0"], r"tenant_queue_share must be in \(0, 1\]"),
        (["--num-kv-blocks", "8", "--kv-cache-memory", "1024"], "not both"),
    ],
)
def test_values_the_configs_refuse_end_the_process_with_their_message(flags, message):
    with pytest.raises(SystemExit, match=message):
        main(["--model", "m", *flags])


def test_choices_and_types_are_checked_by_the_parser(capsys):
    for flags in (["--dtype", "float8"], ["--max-num-seqs", "many"]):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(["--model", "m", *flags])
        assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
