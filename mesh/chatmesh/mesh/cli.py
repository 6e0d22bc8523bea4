"""The `chatmesh` command. Each subcommand lives beside the code it drives and registers itself here
through `COMMAND_MODULES` (a module with `register(subparsers)`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

COMMAND_MODULES = (
    "chatmesh.mesh.commands",
    "chatmesh.mesh.up",
    "chatmesh.store.cli",
    "chatmesh.router.cli",
    "chatmesh.engine_adapter.cli",
    "chatmesh.engine_adapter.triton.cli",
    "chatmesh.chat.cli",
    "chatmesh.moderation.cli",
    "chatmesh.gateway.cli",
)

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatmesh", description="chatmesh: a self-hosted chat-assistant mesh")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is None or not name.startswith(err.name):
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
