"""`chatmesh users create NAME` and `chatmesh keys create NAME`: identities for the edge (CHATMESH_AUTH=required).

    chatmesh users create alice                 # a user without a password (API keys only)
    printf 'secret' | chatmesh users create bob --password-stdin
    chatmesh keys create alice --label laptop   # prints the key once; only its digest is stored
    chatmesh keys create webui --frontend       # a trusted front-end's key: it may name end users (Open WebUI)
    chatmesh keys revoke cmk_...
    chatmesh groups add support alice bob       # a group an internal client's owner-token grant may name
    chatmesh groups remove support bob
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from chatmesh.gateway import settings
from chatmesh.gateway.accounts import Accounts, open_accounts
from chatmesh.mesh import config, errors
from chatmesh.mesh import settings as mesh_settings
from chatmesh.mesh.config import Config
from chatmesh.store import settings as store_settings


def register(sub: Any) -> None:
    users = sub.add_parser("users", help="edge users (the owners of conversations)")
    users.add_argument("action", choices=("create",))
    users.add_argument("name")
    users.add_argument("--password-stdin", action="store_true",
                       help="read a password for browser login from standard input")
    config.add_flags(users, *config.SERVICE_SETTINGS["accounts"])
    users.set_defaults(handler=_users)

    keys = sub.add_parser("keys", help="API keys (Authorization: Bearer <key>)")
    keys.add_argument("action", choices=("create", "revoke"))
    keys.add_argument("subject", help="user name (create) or the key (revoke)")
    keys.add_argument("--label", default="", help="a note to recognise the key by")
    keys.add_argument("--frontend", action="store_true",
                      help="a trusted front-end's key (Open WebUI, LibreChat): it may name the end user of each "
                           "request (X-OpenWebUI-User-Id), each of whom is then an owner of their own")
    config.add_flags(keys, *config.SERVICE_SETTINGS["accounts"])
    keys.set_defaults(handler=_keys)

    groups = sub.add_parser("groups", help="named groups of users (an internal client's owner-token grant may name "
                                           "one: CHATMESH_MESH_AUTHZ_FILE owner_token_grants)")
    groups.add_argument("action", choices=("add", "remove"))
    groups.add_argument("group")
    groups.add_argument("names", nargs="+", metavar="USER", help="user names")
    config.add_flags(groups, *config.SERVICE_SETTINGS["accounts"])
    groups.set_defaults(handler=_run)


def accounts_for(cfg: Config) -> Accounts:
    url = cfg[settings.AUTH_DATABASE_URL] or cfg[store_settings.DATABASE_URL]
    return open_accounts(url, cfg[mesh_settings.DATA_DIR], cfg[settings.SESSION_TTL_S],
                         cache_s=cfg[settings.AUTH_CACHE_S], pepper=cfg[settings.KEY_PEPPER],
                         schema=cfg[store_settings.DATABASE_SCHEMA])


async def _with_accounts(cfg: Config, args: argparse.Namespace, password: str | None) -> str:
    accounts = accounts_for(cfg)
    try:
        await accounts.create_tables()
        if args.command == "users":
            return await accounts.create_user(args.name, password)
        if args.command == "groups":
            changed = [n for n in args.names if await accounts.set_group(args.group, n, args.action == "add")]
            return f"{args.action}: {', '.join(changed) or 'nothing changed'}"
        if args.action == "create":
            return await accounts.create_key(args.subject, args.label, frontend=args.frontend)
        return "revoked" if await accounts.revoke_key(args.subject) else "no such active key"
    finally:
        await accounts.close()


def _run(args: argparse.Namespace, password: str | None = None) -> int:
    cfg = Config(flags=config.flags_of(args))
    try:
        print(asyncio.run(_with_accounts(cfg, args, password)))
    except errors.CoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def _users(args: argparse.Namespace) -> int:
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else None
    if args.password_stdin and not password:
        print("error: empty password on standard input", file=sys.stderr)
        return 1
    return _run(args, password)


def _keys(args: argparse.Namespace) -> int:
    return _run(args)
