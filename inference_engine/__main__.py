"""``python -m inference_engine --model PATH --endpoint tcp://127.0.0.1:5555 [options]``

Every field of ``EngineConfig`` and ``ServerConfig`` is a flag, with the field's default and
help: ``max_num_seqs`` is ``--max-num-seqs``, and a bool field ``x`` is ``--x`` / ``--no-x``.
``--threads`` and ``--log-level`` are the process's own. The link's token is the environment's
``ENGINE_TOKEN`` (``protocol.link_keys``), required on an endpoint other hosts can reach.
"""

from __future__ import annotations

import argparse
import logging
import os
import typing
from dataclasses import MISSING, fields
from typing import Any, TypeVar

from inference_engine.config import EngineConfig, ServerConfig
from inference_engine.protocol import ENGINE_TOKEN_ENV, link_check, link_keys

Config = TypeVar("Config", EngineConfig, ServerConfig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m inference_engine",
        description="Serve one model over ZeroMQ (ROUTER socket, msgspec frames).",
    )
    add_config_arguments(parser.add_argument_group("engine"), EngineConfig)
    add_config_arguments(parser.add_argument_group("server"), ServerConfig)
    process = parser.add_argument_group("process")
    process.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (default: one per CPU this process may run on, its affinity); "
        "on a machine shared with other processes, fewer threads avoid waiting on "
        "descheduled ones",
    )
    process.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    return args


def add_config_arguments(group: argparse._ActionsContainer, config_class: type) -> None:
    """One flag per field of the dataclass ``config_class``, with the field's type, default,
    choices and help (its metadata); a field without a default is a required flag."""
    hints = typing.get_type_hints(config_class)
    for field in fields(config_class):
        kind = _flag_type(hints[field.name])
        options: dict[str, Any] = {"dest": field.name, "help": field.metadata["help"]}
        if field.default is MISSING:
            options["required"] = True
        else:
            options["default"] = field.default
            if kind is bool:
                options["help"] += f" (default: {'on' if field.default else 'off'})"
            elif field.default is not None:
                options["help"] += " (default: %(default)s)"
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = kind
            options["choices"] = field.metadata.get("choices")
        group.add_argument("--" + field.name.replace("_", "-"), **options)


def config_from(config_class: type[Config], args: argparse.Namespace) -> Config:
    """The config of the parsed flags; raises ``ValueError`` for values it refuses."""
    return config_class(**{field.name: getattr(args, field.name) for field in fields(config_class)})


def _flag_type(hint: Any) -> type:
    """The type a flag parses to: ``int`` for ``int`` and for ``int | None``."""
    kinds = [kind for kind in typing.get_args(hint) if kind is not type(None)]
    return kinds[0] if kinds else hint


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    token = os.environ.get(ENGINE_TOKEN_ENV) or None
    try:
        engine_config = config_from(EngineConfig, args)
        server_config = config_from(ServerConfig, args)
        link_check(server_config.endpoint, token)
        if token:
            link_keys(token)  # this libzmq can secure the link
    except ValueError as exc:
        raise SystemExit(f"python -m inference_engine: error: {exc}") from None
    import torch

    from inference_engine.server import EngineServer

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    EngineServer(engine_config, server_config, token=token).run()


if __name__ == "__main__":
    main()
