"""The `chatmesh` command. Each subcommand lives beside the code it drives and registers itself here
through `COMMAND_MODULES` (a module with `register(subparsers)`)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

COMMAND_MODULES = (
    "chatmesh.mesh.commands",
    "chatmesh.model.cli",
    "chatmesh.mesh.up",
    "chatmesh.mesh.status",
    "chatmesh.mesh.certs",
    "chatmesh.store.cli",
    "chatmesh.router.cli",
    "chatmesh.engine_adapter.cli",
    "chatmesh.engine_adapter.triton.cli",
    "chatmesh.moderation.cli",
    "chatmesh.gateway.cli",
)

Handler = Callable[[argparse.Namespace], int]


# Commands whose module is known: `chatmesh serve store` imports only what serving the store needs, not every
# command's dependencies (torch, scikit-learn, matplotlib), so a service process starts in a second.
KNOWN = {"serve": "chatmesh.mesh.commands", "model": "chatmesh.model.cli", "config": "chatmesh.mesh.commands",
         "up": "chatmesh.mesh.up", "certs": "chatmesh.mesh.certs", "status": "chatmesh.mesh.status"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatmesh", description="chatmesh: a self-hosted chat-assistant mesh")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [KNOWN[command]] if command in KNOWN else COMMAND_MODULES
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


EXIT_BROKEN_PIPE = 141  # what a shell reports for a command killed by SIGPIPE (128 + 13)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        handler: Handler = args.handler
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `chatmesh ... | head`: the reader left; stop quietly, as a SIGPIPE'd command would
        return _reader_gone()
    except SystemExit as done:  # --help and usage errors exit from inside argparse: flush while we can catch it
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            return _reader_gone()
        raise done


def _reader_gone() -> int:
    """Points stdout at /dev/null so the interpreter's flush at exit does not fail again (Python's documented
    recipe for SIGPIPE, https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
