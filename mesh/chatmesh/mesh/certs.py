"""`chatmesh certs`: the development PKI for an operator (the same files `chatmesh up` makes, laid out as pki.py
says: the CA in <data>/ca/, every identity's pair in <data>/certs/, the signing keys in <data>/gateway/), and
grpcurl flags.

    chatmesh certs [--data-dir D]                   make what is missing or due under D/certs/ (pki.py)
    chatmesh certs --client reports                 also a certificate for spiffe://chatmesh/client/reports
    chatmesh certs --rotate-token-key [--retire-token-key KID ...]
                                                    new owner-token signing key; old ones kept until retired

It prints where the files are and the grpcurl flags that call the mesh as the operator identity.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from chatmesh.mesh import config, pki, settings
from chatmesh.mesh import identity as ident
from chatmesh.mesh.config import Config
from chatmesh.mesh.trust import certs_folder


def register(sub: Any) -> None:
    p = sub.add_parser("certs", help="make the mesh's development CA, certificates and owner-token keys")
    p.add_argument("--client", action="append", default=[], metavar="NAME",
                   help="also make spiffe://chatmesh/client/NAME (an internal service acting for users)")
    p.add_argument("--rotate-token-key", action="store_true", help="add a new owner-token signing key")
    p.add_argument("--retire-token-key", action="append", default=[], metavar="KID",
                   help="drop an old owner-token key (after CHATMESH_OWNER_TOKEN_TTL_S has passed since rotating)")
    config.add_flags(p, "chatmesh.mesh.settings")
    p.set_defaults(handler=_certs)


def grpcurl_tls(folder: Path) -> str:
    """The flags that make grpcurl the operator: the mesh CA, the operator's certificate and key."""
    stem = ident.file_stem(ident.OPERATOR)
    return f"-cacert {folder / pki.CA_FILE} -cert {folder / f'{stem}.pem'} -key {folder / f'{stem}-key.pem'}"


def grpcurl_flags(folder: Path, service: str = "chat") -> str:
    """The flags that make grpcurl the operator, expecting `service`'s certificate."""
    return f"{grpcurl_tls(folder)} -authority {ident.server_name(service)}"


def _certs(args: argparse.Namespace) -> int:
    cfg = Config(flags=config.flags_of(args))
    folder = certs_folder(cfg)
    issued = pki.ensure(folder, pki.default_identities(["dev", *args.client]))
    for who in issued:
        print(f"issued {who}: {folder / ident.file_stem(who)}.pem")
    if args.rotate_token_key or args.retire_token_key:
        kid = pki.rotate_token_key(folder, args.retire_token_key) if args.rotate_token_key else \
            pki.retire_token_keys(folder, args.retire_token_key)
        print(f"owner tokens are signed with key {kid} ({pki.private_keys_file(folder)})")
    chat, engine = cfg[settings.CHAT_ADDRESS], cfg[settings.ENGINE_ADDRESS]
    print(f"""certificates in {folder} (the CA's key in {pki.ca_folder(folder)}, read by this command only; the
owner-token signing keys in {pki.private_keys_file(folder).parent}, read by the gateway only)
grpcurl as the operator (-authority names the service whose certificate to expect):
  TLS="{grpcurl_tls(folder)}"
  grpcurl $TLS -authority {ident.server_name("chat")} {chat} list
  grpcurl $TLS -authority {ident.server_name("engine")} -d '{{}}' {engine} chatmesh.v1.GenerateService/GetStats""")
    return 0
