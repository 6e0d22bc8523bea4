"""Prefix transfer between engine replicas (issue 29): a replica imports a conversation's cached KV blocks from
the replica that computed them instead of prefilling them again, so a turn moved for balance, a drain or a lost
replica keeps its history.

Protocol (GenerateService.PullPrefix, generate.proto). The PULLER, serving a generation whose request names a
source replica, computes the owner-salted chain hashes of the prompt's full blocks (block_manager.chain_hashes:
the very hashes its own admission looks up), skips the leading run its own cache holds, and asks the source for
the rest, forwarding the turn's owner token. The SOURCE (its servicer has checked the caller is an engine and the
token is for the request's owner, and derived that owner's salt itself) pins the leading run of those hashes it
caches under that salt (`BlockManager.pin`; another owner's hash and an unknown one read the same: not held),
answers how many follow, and streams them in chunks, each block's payload with a BLAKE2b-128 digest keyed by
its hash. The puller reserves device blocks for them, checks each block's hash, size and digest, writes it,
and caches the lot (`adopt`) only once every announced block arrived intact; any mismatch drops the whole
transfer. A caller without the salt and the tokens can name nothing; without the owner's token, ask nothing.

Failure is never the turn's: a source that is gone, refuses, holds nothing, evicts a block for deletion during
the transfer (its stream ends ABORTED), is slower than the deadline (CHATMESH_PREFIX_PULL_TIMEOUT_MS), sends a
corrupt block, or a puller without device room: each ends the pull with an outcome (PullOutcome), frees what
it reserved, and the generation prefills what its cache lacks. The source holds a pin only while its stream
is open: the stream ending, failing, being cancelled or passing its deadline unpins. Blocks it delivered whole
go to the cold end of its LRU (`BlockManager.demote`): kept for a retry, evicted first.

Threads. Steps run on the engine's worker thread; block data moves on a second, transfer thread, so a pull
never waits behind a step (a 256-token step of `local` takes about a second). That is safe because a transfer
reads only pinned blocks (never reallocated, evicted or spilled while pinned) and writes only reserved ones (no
step reads them before `adopt`). The one exception is the step in flight when a transfer pins or reserves: its
queued tier copies may still be filling those blocks, so a transfer's first read or write waits for that step
(`barrier`). Digests are computed on the transfer thread too (hashlib releases the GIL).

`sim` moves no data: its payloads are empty and the puller waits out the link model's time for the modelled
bytes (`Executor.transfer_s`, router/link.py), so TTFT shows the transfer. `local` moves its int8 K/V and
scales (local/model.py KVPool.export/load). `triton` cannot (docs/triton.md): it reports serves/receives false,
and the router never plans a pull to or from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from chatmesh.engine_adapter.backend import (
    GenerateParams,
    KvBlockData,
    KvLayout,
    PrefixEvicted,
    PullOutcome,
    PullReport,
    PullSource,
    ServeRequest,
    TransferChunk,
    TransferEvent,
    TransferStarted,
    TransferStats,
)
from chatmesh.engine_adapter.block_manager import BlockHash, BlockManager, PinnedBlock, chain_hashes
from chatmesh.engine_adapter.executor import Executor
from chatmesh.mesh import logs
from chatmesh.mesh.errors import FailedPrecondition, ResourceExhausted
from chatmesh.mesh.ids import OwnerId

log = logs.get("chatmesh.engine.transfer")

T = TypeVar("T")
HASH_BYTES = 16
MAX_PULL_BLOCKS = 4096  # hashes per PullPrefix request (the proto's limit)
DEFAULT_MESSAGE_BYTES = 4 << 20  # gRPC's default largest message
BLOCK_OVERHEAD_BYTES = 64  # a KvBlock's framing beside its payload: hash, digest, tags
MAX_BLOCKS_PER_CHUNK = 256


@dataclass(frozen=True)
class PullConfig:
    """Whether this replica pulls and serves, a pull's deadline, and how many transfers it serves at once."""

    enabled: bool = True
    timeout_s: float = 5.0
    max_serving: int = 8

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or self.max_serving < 1:
            raise ValueError(f"bad pull config {self}")


@dataclass(frozen=True)
class PullRequest:
    """What the puller asks a source for."""

    request_id: str
    owner_id: OwnerId
    conversation_id: str | None
    hashes: tuple[BlockHash, ...]
    layout: KvLayout
    max_message_bytes: int = DEFAULT_MESSAGE_BYTES


class PullFailed(Exception):
    """The pull ended without blocks (raised by a PrefixPeer; the detail is for logs, never shown to users)."""

    def __init__(self, outcome: PullOutcome, detail: str = "") -> None:
        super().__init__(detail or outcome.value)
        self.outcome = outcome


class PrefixPeer(Protocol):
    """How a puller reaches a source (service.py: PullPrefix over the mesh, carrying the turn's owner token)."""

    def pull(self, source: PullSource, request: PullRequest, timeout_s: float
             ) -> AsyncGenerator[TransferEvent, None]:
        """The source's events; PullFailed for a refusal or a broken transfer."""
        ...


class Offload(Protocol):
    """Runs a function on the transfer thread."""

    def __call__(self, fn: Callable[[], T]) -> Awaitable[T]: ...


def digest(block: BlockHash, payload: bytes) -> bytes:
    """BLAKE2b-128 of a block's payload, keyed with its chain hash (so contents cannot pass for another block)."""
    return hashlib.blake2b(payload, digest_size=16, key=block).digest()


def blocks_per_chunk(payload_bytes: int, max_message_bytes: int) -> int:
    per = max(1, (max_message_bytes - BLOCK_OVERHEAD_BYTES) // (payload_bytes + BLOCK_OVERHEAD_BYTES))
    return min(per, MAX_BLOCKS_PER_CHUNK)


class Transfers:
    """One replica's pulls (as puller) and serves (as source) over its block manager and executor."""

    def __init__(self, blocks: BlockManager, executor: Executor, layout: KvLayout | None, replica_id: str,
                 cfg: PullConfig, *, offload: Offload,
                 barrier: Callable[[], Awaitable[None]], wait_modelled: Callable[[float, float], Awaitable[None]]):
        self.blocks = blocks
        self.executor = executor
        self.layout = layout if cfg.enabled else None
        self.replica_id = replica_id
        self.cfg = cfg
        self._offload = offload
        self._barrier = barrier
        self._wait_modelled = wait_modelled
        fmt = executor.kv_format
        self.payload_bytes = fmt.payload_bytes if fmt is not None else 0
        self.peer: PrefixPeer | None = None  # set by the service (no peer: this replica serves but never pulls)
        self.tamper: Callable[[KvBlockData], KvBlockData] | None = None  # test hook: alters a block before sending
        self.serving = 0
        self.pulls = self.failed_pulls = self.pulled_bytes = 0
        self.served_blocks = self.served_bytes = 0
        self.outcomes: dict[PullOutcome, int] = {}

    def stats(self, pulled_tokens: int) -> TransferStats:
        return TransferStats(
            serves=self.layout is not None, receives=self.layout is not None and self.peer is not None,
            layout=self.layout, pulled_tokens=pulled_tokens, pulled_bytes=self.pulled_bytes, pulls=self.pulls,
            failed_pulls=self.failed_pulls, served_blocks=self.served_blocks, served_bytes=self.served_bytes,
            outcomes=tuple((o.value, n) for o, n in self.outcomes.items()), serving=self.serving)

    # ---- puller ------------------------------------------------------------------------------------------------

    async def pull(self, params: GenerateParams) -> PullReport:
        """Imports what the prompt's cache lacks from `params.source`; never raises for the pull's own failures
        (cancellation, the caller going away, still propagates, after freeing what the pull held)."""
        source = params.source
        assert source is not None
        t0 = time.perf_counter()
        layout, peer, owner = self.layout, self.peer, params.owner_id
        if source.replica_id == self.replica_id:
            return PullReport(source.replica_id, PullOutcome.NOT_NEEDED)
        if layout is None or peer is None or owner is None:
            return PullReport(source.replica_id, PullOutcome.UNSUPPORTED)
        hashes = chain_hashes(params.prompt_token_ids, params.platform_prefix_tokens, params.cache_salt,
                              self.blocks.block_size)
        own = self.blocks.cached_run(hashes)
        want = tuple(hashes[own:own + MAX_PULL_BLOCKS])
        if not want:
            return PullReport(source.replica_id, PullOutcome.NOT_NEEDED, own)
        self.pulls += 1
        held = self.blocks.pin(hashes[:own], params.cache_salt)  # our own prefix stays while the rest arrives
        request = PullRequest(params.request_id, owner, params.conversation_id, want, layout)
        reserved: list[int] = []
        moved = 0
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                moved = await self._receive(peer, source, request, reserved)
                await self._wait_modelled(self.executor.transfer_s(moved), time.perf_counter() - t0)
            adopted = self.blocks.adopt(reserved, want[:len(reserved)], own, params.platform_prefix_tokens,
                                        params.cache_salt, params.conversation_id)
            n, reserved = len(reserved), []
            outcome = PullOutcome.PULLED
            log.debug("prefix_pulled", request_id=params.request_id, source=source.replica_id, blocks=n,
                      adopted=adopted, bytes=moved)
        except TimeoutError:
            n, outcome = 0, PullOutcome.DEADLINE
        except PullFailed as failed:
            n, outcome = 0, failed.outcome
            if outcome is not PullOutcome.NOT_HELD:
                log.info("prefix_pull_failed", request_id=params.request_id, source=source.replica_id,
                         outcome=outcome.value, detail=str(failed))
        except Exception as exc:  # a bug on this side (an import that raised): logged; the turn still prefills
            n, outcome = 0, PullOutcome.UNAVAILABLE
            log.error("prefix_pull_error", request_id=params.request_id, source=source.replica_id, exc_info=exc)
        finally:
            if reserved:
                self.blocks.unreserve(reserved)
            self.blocks.unpin(held)
        self.pulled_bytes += moved
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome is not PullOutcome.PULLED:
            self.failed_pulls += 1
        return PullReport(source.replica_id, outcome, own, n, moved, time.perf_counter() - t0)

    async def _receive(self, peer: PrefixPeer, source: PullSource, request: PullRequest, reserved: list[int]
                       ) -> int:
        """Streams the transfer into `reserved` (filled here; the caller frees it on failure); returns the bytes
        moved. PullFailed for every way a transfer can go wrong."""
        layout = request.layout
        want = request.hashes
        stream = peer.pull(source, request, self.cfg.timeout_s)
        try:
            first = await anext(stream, None)
            if not isinstance(first, TransferStarted) or first.blocks > len(want) or first.blocks < 0 \
                    or first.block_bytes != layout.block_bytes:
                raise PullFailed(PullOutcome.CORRUPT, "the transfer did not start with a valid header")
            if first.blocks == 0:
                raise PullFailed(PullOutcome.NOT_HELD)
            reserved.extend(self.blocks.reserve(first.blocks))
            room = len(reserved)
            if room == 0:
                raise PullFailed(PullOutcome.NO_ROOM, f"no device block free for {first.blocks} pulled blocks")
            await self._barrier()
            got = 0
            async for event in stream:
                if not isinstance(event, TransferChunk) or not event.blocks or got + len(event.blocks) > first.blocks:
                    raise PullFailed(PullOutcome.CORRUPT, "a chunk out of the announced range")
                take = event.blocks[:room - got]
                targets, expected = reserved[got:got + len(take)], want[got:got + len(take)]
                if not await self._settled(lambda: self._verify_and_import(take, expected, targets)):
                    raise PullFailed(PullOutcome.CORRUPT, f"a block of chunk at {got} failed its digest check")
                got += len(take)
                if got >= room:
                    break
            if got < room:
                raise PullFailed(PullOutcome.CORRUPT, f"the transfer ended after {got} of {room} blocks")
            return room * layout.block_bytes
        finally:
            await stream.aclose()

    async def _settled(self, fn: Callable[[], T]) -> T:
        """`fn` on the transfer thread. Cancelled meanwhile (the caller went away, the deadline passed), it still
        waits for `fn` to finish before letting the cancellation through: the blocks `fn` reads or writes are
        unpinned or freed right after, and a write landing in a block already given to another sequence would
        corrupt that sequence's KV."""
        job = asyncio.ensure_future(self._offload(fn))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait([job])
            raise

    def _verify_and_import(self, take: Sequence[KvBlockData], expected: Sequence[BlockHash],
                           targets: Sequence[int]) -> bool:
        """Transfer thread: every block is the one named, of the layout's size, matching its digest; then written."""
        for block, h in zip(take, expected, strict=True):
            if block.hash != h or len(block.payload) != self.payload_bytes or digest(h, block.payload) != block.digest:
                return False
        self.executor.import_blocks(targets, [b.payload for b in take])
        return True

    # ---- source ------------------------------------------------------------------------------------------------

    async def serve(self, request: ServeRequest) -> AsyncIterator[TransferEvent]:
        if self.layout is None:
            raise FailedPrecondition("this replica does not serve prefix pulls (CHATMESH_PREFIX_PULLS, or a backend "
                                     "without transfer)")
        if request.layout != self.layout:
            raise FailedPrecondition(f"KV layouts differ: this replica's is {_describe(self.layout)}, the "
                                     f"puller's {_describe(request.layout)}")
        if self.serving >= self.cfg.max_serving:
            raise ResourceExhausted(f"this replica serves {self.serving} pulls already "
                                    f"(CHATMESH_PREFIX_PULL_MAX_SERVING); prefill instead")
        pinned = self.blocks.pin(request.hashes, request.salt)
        self.serving += 1
        delivered = False
        try:
            yield TransferStarted(len(pinned), self.layout.block_bytes)
            if not pinned:
                return
            await self._barrier()
            per = blocks_per_chunk(self.payload_bytes, request.max_message_bytes)
            for i in range(0, len(pinned), per):
                part = pinned[i:i + per]
                self._check_held(part)
                data = await self._settled(lambda: self._export(part))
                self._check_held(part)  # not evicted for deletion while it was read
                self.served_blocks += len(data)
                self.served_bytes += len(data) * self.layout.block_bytes
                yield TransferChunk(data)
            delivered = True
        finally:
            self.serving -= 1
            self.blocks.unpin(pinned)
            if delivered:  # the conversation lives on the puller now: these are the next to go here
                self.blocks.demote(pinned)

    def _check_held(self, part: Sequence[PinnedBlock]) -> None:
        if not all(self.blocks.still_holds(p) for p in part):
            raise PrefixEvicted("a block of the prefix was evicted during the transfer")

    def _export(self, part: Sequence[PinnedBlock]) -> tuple[KvBlockData, ...]:
        """Transfer thread: the pinned blocks' payloads and digests."""
        payloads = self.executor.export_blocks([(p.tier, p.block) for p in part])
        out = tuple(KvBlockData(p.hash, payload, digest(p.hash, payload)) for p, payload in zip(part, payloads))
        if self.tamper is not None:
            out = tuple(self.tamper(b) for b in out)
        return out


def _describe(layout: KvLayout) -> str:
    return (f"{layout.backend} {layout.model.model_id} {layout.dtype} blocks of {layout.block_size} tokens "
            f"({layout.block_bytes} bytes)")
