"""Who is calling: the authenticated principal of a request. The owner id comes from here, never from a field."""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

from chatmesh.mesh import ids


class Via(enum.Enum):
    """How the principal was established."""

    LOCAL = "local"  # the development identity: no auth configured, loopback only
    API_KEY = "api_key"  # `Authorization: Bearer <key>`
    SESSION = "session"  # a browser session cookie (state-changing requests also need the CSRF header)


@dataclass(frozen=True)
class Principal:
    owner: ids.OwnerId
    via: Via


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
