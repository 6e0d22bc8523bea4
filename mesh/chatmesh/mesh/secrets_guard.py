"""The production guard: a service refuses to start on a non-loopback address while a secret it uses still holds
its development default (a constant in this repository, so anyone can read it).

- CHATMESH_CACHE_SALT_SECRET (engine): keys each owner's KV-cache salt. Knowing it and an owner id gives that
  owner's salt, and with it the chance to probe the shared prefix cache for that owner's text (I1).
- CHATMESH_KEY_PEPPER (gateway): keys the stored digests of API keys and session tokens and signs device
  cookies; knowing it lets a copy of the tables confirm guessed keys and lets anyone forge a device cookie.

On loopback (`chatmesh up`, tests) the defaults are fine: nothing outside the machine reaches the service, unless
its configuration says it serves the public anyway (a loopback bind behind a proxy: the gateway's public origin,
secure cookies, TLS or trusted proxies, `public_because`), and then they are refused whatever it binds. Anywhere
else, set each to a long random value of your own, the same on every process of that service.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatmesh.mesh.config import Config, all_settings
from chatmesh.mesh.trust import is_loopback

DEV_SECRETS: dict[str, tuple[str, ...]] = {
    "engine": ("CHATMESH_CACHE_SALT_SECRET",),
    "gateway": ("CHATMESH_KEY_PEPPER",),
}


class DevelopmentSecrets(Exception):
    """A service on a non-loopback address with a development secret."""


def defaults_in_use(cfg: Config, service: str) -> list[str]:
    """The secrets `service` uses that still hold their development defaults."""
    by_env = {s.env: s for s in all_settings()}
    return [env for env in DEV_SECRETS.get(service, ()) if env in by_env and cfg[by_env[env]] == by_env[env].default]


def refuse_development_secrets(cfg: Config, service: str, address: str, public_because: Sequence[str] = ()
                               ) -> None:
    """Raises DevelopmentSecrets naming the settings when a secret is a default and `address` is not loopback or
    `public_because` names settings that make the service public whatever it binds."""
    if is_loopback(address) and not public_because:
        return
    found = defaults_in_use(cfg, service)
    if found:
        where = f"{address} ({'; '.join(public_because)})" if public_because else address
        raise DevelopmentSecrets(
            f"{service}: refusing to serve {where} with {', '.join(found)} at the development default (a value "
            f"anyone can read in chatmesh's source); set {' and '.join(found)} to a long random secret of your own, "
            f"the same on every {service} process (e.g. `openssl rand -hex 32`)")
