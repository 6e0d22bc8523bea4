"""`chatmesh store migrate | downgrade | current | purge`: operator commands for the conversation store."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from chatmesh.mesh import config, logs
from chatmesh.mesh import settings as mesh_settings
from chatmesh.mesh.commands import report_unread
from chatmesh.mesh.config import Config
from chatmesh.store import migrate, settings
from chatmesh.store.core import ConversationStore
from chatmesh.store.limits import FieldLimits
from chatmesh.store.db import database_url, make_engine


def register(sub: Any) -> None:
    p = sub.add_parser("store", help="conversation store: schema migrations and retention purge")
    p.add_argument("action", choices=("migrate", "downgrade", "current", "purge"),
                   help="migrate: upgrade the schema (to --revision, default head); downgrade: to --revision; "
                        "current: print the schema revision; purge: delete what is past retention now")
    p.add_argument("--revision", default=None, help="target revision for migrate (head) or downgrade (required)")
    config.add_flags(p, *config.SERVICE_SETTINGS["store"])
    p.set_defaults(handler=_store)


def engine_for(cfg: Config) -> AsyncEngine:
    url = database_url(cfg[settings.DATABASE_URL], cfg[mesh_settings.DATA_DIR])
    return make_engine(url, pool_size=2, search_path=cfg[settings.DATABASE_SCHEMA] or None)


def _store(args: argparse.Namespace) -> int:
    cfg = Config(flags=config.flags_of(args))
    logs.configure("store", cfg[mesh_settings.LOG_LEVEL], cfg[mesh_settings.LOG_JSON])
    if args.action == "downgrade" and not args.revision:
        print("chatmesh store downgrade needs --revision (e.g. base)")
        return 2
    code = asyncio.run(_run(cfg, args.action, args.revision))
    report_unread(cfg)  # names only: what a Job's environment gave this command and it never read
    return code


async def _run(cfg: Config, action: str, revision: str | None) -> int:
    engine = engine_for(cfg)
    try:
        if action == "migrate":
            await migrate.upgrade(engine, revision or "head")
            print(await migrate.current(engine))
        elif action == "downgrade":
            await migrate.downgrade(engine, revision or "base")
            print(await migrate.current(engine) or "base")
        elif action == "current":
            print(await migrate.current(engine) or "base")
        else:
            store = ConversationStore(engine, FieldLimits(retention_days=cfg[settings.RETENTION_DAYS]))
            try:
                purged = await store.lifecycle.purge_expired()
            finally:
                await store.close()
            print(f"purged {len(purged.conversations)} conversations, {purged.abandoned_turns} abandoned turns")
    finally:
        await engine.dispose()
    return 0
