"""`chatmesh serve SERVICE`, `chatmesh config table` (`chatmesh model ...` lives in chatmesh.model.cli)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import sys
from typing import Any

from chatmesh.mesh import config, logs, settings, tracing
from chatmesh.mesh.config import Config, Setting, SettingRefused
from chatmesh.mesh.secrets_guard import DevelopmentSecrets, refuse_development_secrets
from chatmesh.mesh.trust import Trust, TrustRefused, service_trust

# service name -> (module with `build(cfg) -> Service`, the setting holding its address)
GRPC_SERVICES: dict[str, tuple[str, Setting[str]]] = {
    "chat": ("chatmesh.chat.service", settings.CHAT_ADDRESS),
    "store": ("chatmesh.store.service", settings.STORE_ADDRESS),
    "router": ("chatmesh.router.service", settings.ROUTER_ADDRESS),
    "engine": ("chatmesh.engine_adapter.service", settings.ENGINE_ADDRESS),
    "moderation": ("chatmesh.moderation.service", settings.MODERATION_ADDRESS),
}
SERVICES = (*GRPC_SERVICES, "gateway")


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="run one service (the production unit)")
    services = p.add_subparsers(dest="service", required=True, metavar="SERVICE")
    for name in SERVICES:
        one = services.add_parser(name, help=f"run the {name} service",
                                  usage=f"chatmesh serve {name} [-h] [--help-all] [--SETTING VALUE ...]")
        config.add_flags(one, *config.SERVICE_SETTINGS[name])
    p.set_defaults(handler=_serve)

    p = sub.add_parser("config", help="show configuration")
    p.add_argument("action", choices=("table", "readme"),
                   help="table: print the settings table; readme: rewrite it into README.md")
    p.set_defaults(handler=_config)


def _serve(args: argparse.Namespace) -> int:
    cfg = Config(flags=config.flags_of(args))
    logs.configure(args.service, cfg[settings.LOG_LEVEL], cfg[settings.LOG_JSON])
    tracing.configure(args.service)
    if args.service == "gateway":
        gateway = importlib.import_module("chatmesh.gateway.app")
        result: int = gateway.run(cfg)
        return result
    module_name, address = GRPC_SERVICES[args.service]
    module = importlib.import_module(module_name)
    listen = cfg[settings.LISTEN] or cfg[address]
    try:
        trust = service_trust(cfg, args.service)
        trust.check_address(listen, f"{args.service}: listening on")
        refuse_development_secrets(cfg, args.service, listen)
    except (TrustRefused, DevelopmentSecrets) as err:
        logs.get("chatmesh.serve").error("startup_refused", reason=str(err))
        return 2
    try:
        asyncio.run(_run(module, cfg, listen, trust, cfg[settings.METRIC_PORTS[args.service]]))
    except SettingRefused as err:
        logs.get("chatmesh.serve").error("startup_refused", reason=str(err))
        return 2
    return 0


async def _run(module: Any, cfg: Config, listen: str, trust: Trust, metrics_port: int) -> None:
    from chatmesh.mesh.server import serve

    # Built inside the running loop: grpc.aio channels and asyncio primitives bind to the loop that makes them.
    # build(cfg, trust=...); a service that needs nothing of its trust but the server's (moderation) takes cfg alone.
    takes_trust = "trust" in inspect.signature(module.build).parameters
    service = module.build(cfg, trust=trust) if takes_trust else module.build(cfg)
    ready = asyncio.Event()
    serving = asyncio.create_task(serve(service, listen, cfg[settings.SHUTDOWN_GRACE_S], ready, trust=trust,
                                        health_port=cfg[settings.HEALTH_PORT], metrics_port=metrics_port))
    up = asyncio.create_task(ready.wait())
    await asyncio.wait([serving, up], return_when=asyncio.FIRST_COMPLETED)
    up.cancel()
    if ready.is_set():
        report_unread(cfg)
    await serving


def report_unread(cfg: Config) -> None:
    """Once a service is up (every start-up read done): logs the settings it read (`settings_read`, names only)
    and warns of CHATMESH_* variables it was given and never read (`settings_unread`): a misspelled, stale or
    another service's setting. Names only, never values."""
    log = logs.get("chatmesh.serve")
    log.info("settings_read", names=sorted(config.read_so_far()))
    names = cfg.unread()
    if not names:
        return
    known = {s.env for s in config.all_settings()}
    unknown = [n for n in names if n not in known]
    # a name no service declares is a mistake; another service's setting (chatmesh up hands every process the
    # whole mesh's environment) is only noted
    (log.warning if unknown else log.info)("settings_unread", names=names, unknown=unknown)


README_START = "<!-- settings-table:start -->"
README_END = "<!-- settings-table:end -->"


def readme_with_table(readme: str) -> str:
    head, _, rest = readme.partition(README_START)
    _, _, tail = rest.partition(README_END)
    return f"{head}{README_START}\n{config.markdown_table()}\n{README_END}{tail}"


def _config(args: argparse.Namespace) -> int:
    if args.action == "table":
        print(config.markdown_table())
        return 0
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "README.md"
    path.write_text(readme_with_table(path.read_text()))
    print(f"rewrote the settings table in {path}")
    return 0
