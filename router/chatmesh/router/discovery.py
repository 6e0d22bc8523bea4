"""Replicas from DNS: the members of a Kubernetes StatefulSet of engines, by the names its pods get.

A StatefulSet `engine` behind the headless Service `engine` gives each pod a stable name, `engine-<ordinal>`,
and a DNS record `engine-<ordinal>.engine` (in the pod's namespace, found through the resolver's search path).
`CHATMESH_REPLICAS_DNS=engine-{ordinal}.engine:50054` makes the router's membership follow the set's size:

- every CHATMESH_REPLICAS_DNS_INTERVAL_S the router resolves ordinals 0, 1, 2, ... until MISS_RUN names in a
  row do not resolve (so a gap left by one pod being replaced does not hide the pods after it), at most
  MAX_ORDINAL; each name that resolves is a replica, its id the name's first label (`engine-3`, the pod name:
  the id the engine reports as CHATMESH_REPLICA_ID from the downward API), its address the name itself, so
  the channel follows the pod to a new IP after a restart;
- a replica whose name stops resolving leaves the ring after REMOVE_AFTER lookups in a row without it
  (`kubectl scale` down; a pod being recreated is back before that, and meanwhile health marks it down, so its
  conversations spill and return as with any unhealthy replica); a new name joins at once (scale up).

The headless Service must set `publishNotReadyAddresses: true`: membership is the set's size, not its
readiness, which the router's own health watch decides (membership.py). Resolution is the system resolver's
(getaddrinfo: cluster DNS, or /etc/hosts), so nothing here needs the Kubernetes API or its credentials.
`Tracker` is the pure part (what a lookup round changes); `watch` runs the rounds.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from chatmesh.mesh import logs
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.mesh.ids import ReplicaId
from chatmesh.router.ring import Replica

log = logs.get("chatmesh.router.discovery")

PLACEHOLDER = "{ordinal}"
MISS_RUN = 4          # names in a row that must fail to resolve before a round stops counting up
MAX_ORDINAL = 1024    # a round never looks past this ordinal
REMOVE_AFTER = 3      # rounds in a row a member must be missing before it leaves the ring

Resolver = Callable[[str, int], Awaitable[bool]]


@dataclass(frozen=True)
class Pattern:
    """`host{ordinal}...:port`: where pod `ordinal` of the set answers."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Pattern:
        host, sep, port = text.strip().rpartition(":")
        if not sep or PLACEHOLDER not in host or not port.isdigit():
            raise InvalidArgument(f"CHATMESH_REPLICAS_DNS: expected a name with {PLACEHOLDER} and a port, such as "
                                  f"engine-{PLACEHOLDER}.engine:50054, got {text!r}")
        return cls(host, int(port))

    def host_of(self, ordinal: int) -> str:
        return self.host.replace(PLACEHOLDER, str(ordinal))

    def replica(self, ordinal: int) -> Replica:
        host = self.host_of(ordinal)
        return Replica(ReplicaId(host.split(".", 1)[0]), f"{host}:{self.port}")


@dataclass
class Tracker:
    """Members across lookup rounds: joins at once, leaves after REMOVE_AFTER rounds missing."""

    pattern: Pattern
    members: dict[int, Replica] = field(default_factory=dict)
    _missing: dict[int, int] = field(default_factory=dict)

    def round(self, found: Iterable[int]) -> tuple[list[Replica], list[Replica]]:
        """One round's resolved ordinals -> (replicas that joined, replicas that left)."""
        seen = set(found)
        joined: list[Replica] = []
        for o in sorted(seen - set(self.members)):
            self.members[o] = self.pattern.replica(o)
            joined.append(self.members[o])
        left: list[Replica] = []
        for o in sorted(set(self.members) - seen):
            self._missing[o] = self._missing.get(o, 0) + 1
            if self._missing[o] >= REMOVE_AFTER:
                left.append(self.members.pop(o))
                del self._missing[o]
        for o in seen:
            self._missing.pop(o, None)
        return joined, left


async def resolves(host: str, port: int) -> bool:
    """Whether the system resolver knows `host` (cluster DNS, /etc/hosts)."""
    try:
        return bool(await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM))
    except (socket.gaierror, UnicodeError):
        return False


async def lookup(pattern: Pattern, resolver: Resolver = resolves) -> list[int]:
    """The ordinals whose names resolve, counting up until MISS_RUN misses in a row."""
    found: list[int] = []
    misses = 0
    for ordinal in range(MAX_ORDINAL):
        if await resolver(pattern.host_of(ordinal), pattern.port):
            found.append(ordinal)
            misses = 0
        else:
            misses += 1
            if misses >= MISS_RUN:
                break
    return found


async def watch(tracker: Tracker, interval_s: float, add: Callable[[Replica], None],
                remove: Callable[[Replica], Awaitable[None]], resolver: Resolver = resolves) -> None:
    """Runs lookup rounds forever, applying each round's changes through `add` / `remove`."""
    while True:
        joined, left = tracker.round(await lookup(tracker.pattern, resolver))
        for replica in joined:
            log.info("replica_joined", replica_id=replica.id, address=replica.address)
            add(replica)
        for replica in left:
            log.info("replica_left", replica_id=replica.id, address=replica.address)
            await remove(replica)
        await asyncio.sleep(interval_s)
