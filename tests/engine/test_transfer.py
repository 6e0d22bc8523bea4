"""Prefix transfer between two engine cores (sim, virtual time), the puller reaching the source through a direct
port (the gRPC one is tests/engine/test_pull_service.py): what is pulled and counted, and every failure falling
back to prefill with nothing reserved left behind."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import pytest

from chatmesh.engine_adapter.backend import (
    Delta,
    Finished,
    GenerateEvent,
    GenerateParams,
    KvBlockData,
    PrefixEvicted,
    PullOutcome,
    PullSource,
    ServeRequest,
    Started,
    TransferEvent,
)
from chatmesh.engine_adapter.block_manager import BlockConfig
from chatmesh.engine_adapter.engine import EngineCore, StepReport, VirtualClock
from chatmesh.engine_adapter.roofline import H100_FP8
from chatmesh.engine_adapter.scheduler import SchedulerConfig
from chatmesh.engine_adapter.sim import SimExecutor
from chatmesh.engine_adapter.text import PASSAGE, WordCodec
from chatmesh.engine_adapter.transfer import PullConfig, PullFailed, PullRequest
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.router.link import Link

BS = 32
SYSTEM = list(range(1000, 1064))  # two shared blocks
CONV = ConversationId("c-1")


def salt_of(owner: OwnerId) -> bytes:
    return b"salt:" + owner.encode()


class DirectPeer:
    """A PrefixPeer calling the source core in-process, as the source's servicer would (salt from the owner)."""

    def __init__(self, cores: dict[str, EngineCore]) -> None:
        self.cores = cores
        self.stall = False

    async def pull(self, source: PullSource, request: PullRequest, timeout_s: float
                   ) -> AsyncGenerator[TransferEvent, None]:
        core = self.cores.get(source.address)
        if core is None:
            raise PullFailed(PullOutcome.UNAVAILABLE, "connection refused")
        if self.stall:
            await asyncio.sleep(3600)
        serve = ServeRequest(salt_of(request.owner_id), request.hashes, request.layout, request.max_message_bytes)
        try:
            async for event in core.serve_prefix(serve):
                yield event
        except PrefixEvicted as err:
            raise PullFailed(PullOutcome.EVICTED, str(err)) from None


def _core(replica: str, steps: list[StepReport] | None = None, device: int = 512, timeout_s: float = 5.0
          ) -> EngineCore:
    codec = WordCodec()
    executor = SimExecutor(H100_FP8, codec.encode(PASSAGE), BS, link=Link())
    return EngineCore(executor, BlockConfig(BS, device, 0), SchedulerConfig(64, 512, 64), codec, replica_id=replica,
                      clock=VirtualClock(), on_step=steps.append if steps is not None else None,
                      pulls=PullConfig(timeout_s=timeout_s))


Pair = tuple[EngineCore, EngineCore, list[StepReport], DirectPeer]


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    steps: list[StepReport] = []
    a, b = _core("a"), _core("b", steps)
    peer = DirectPeer({"a:1": a, "b:1": b})
    a.transfers.peer = b.transfers.peer = peer
    await a.start()
    await b.start()
    yield a, b, steps, peer
    await a.close()
    await b.close()


def _params(prompt: list[int], owner: str = "alice", source: str | None = "a:1", seed: int = 3) -> GenerateParams:
    o = OwnerId(owner)
    return GenerateParams(tuple(prompt), 6, cache_salt=salt_of(o), conversation_id=CONV, owner_id=o,
                          platform_prefix_tokens=len(SYSTEM), sampling=dataclasses.replace(
                              GenerateParams((1,), 1).sampling, seed=seed),
                          source=PullSource("a", source) if source else None)


async def _run(core: EngineCore, params: GenerateParams) -> tuple[Started, list[int], Finished]:
    events: list[GenerateEvent] = [e async for e in core.generate(params)]
    first, last = events[0], events[-1]
    assert isinstance(first, Started) and isinstance(last, Finished)
    return first, [t for e in events if isinstance(e, Delta) for t in e.token_ids], last


HISTORY = SYSTEM + list(range(2000, 2200))  # turn 1: 264 tokens (8 full blocks, 6 of them private)


def _turn2() -> list[int]:
    return HISTORY + list(range(3000, 3040))  # the history, then a new message


async def test_a_moved_turn_pulls_its_history_and_prefills_only_the_new_message(pair: Pair) -> None:
    a, b, steps, _ = pair
    await _run(a, _params(HISTORY, source=None))
    held_by_a = a.blocks.stats().device_cached
    first_b = len(steps)
    started, ids, finished = await _run(b, _params(_turn2()))
    pull = started.pull
    assert pull is not None and pull.outcome is PullOutcome.PULLED
    # b's own cache had nothing, not even the shared system prompt: every full block of the history came along
    assert started.cached_tokens == 0 and started.pulled_tokens == (len(HISTORY) // BS) * BS
    assert pull.first_block == 0 and pull.blocks == len(HISTORY) // BS
    assert pull.bytes == pull.blocks * BS * H100_FP8.plan.kv_bytes_per_token
    assert sum(s.prefill_tokens for s in steps[first_b:]) == len(_turn2()) - started.pulled_tokens
    assert finished.usage.cached_prompt_tokens == started.pulled_tokens
    # the same reply as the home replica gives from its own cache
    home, home_ids, _ = await _run(a, _params(_turn2(), source=None))
    assert home.cached_tokens == (len(HISTORY) // BS) * BS and ids == home_ids
    sa, sb = a.stats().transfer, b.stats().transfer
    assert sa.served_blocks == pull.blocks and sb.pulls == 1 and sb.failed_pulls == 0
    assert sb.pulled_tokens == started.pulled_tokens and sb.pulled_bytes == pull.bytes
    assert sa.serves and sb.receives and sa.layout == sb.layout
    assert a.blocks.stats().device_cached >= held_by_a  # the source's pins are all released
    a.blocks.check()
    b.blocks.check()


async def test_the_modelled_link_time_is_part_of_the_pull(pair: Pair) -> None:
    a, b, _, _ = pair
    await _run(a, _params(HISTORY, source=None))
    clock = b.clock
    assert isinstance(clock, VirtualClock)
    before = clock.t
    started, _, _ = await _run(b, _params(_turn2()))
    assert started.pull is not None
    link_s = Link().transfer_s(started.pull.bytes)
    assert link_s > 0 and clock.t - before >= link_s


async def test_a_second_turn_pulls_only_what_the_puller_lacks(pair: Pair) -> None:
    a, b, _, _ = pair
    await _run(a, _params(HISTORY, source=None))
    await _run(b, _params(SYSTEM + [5], source=None))  # b has the system prompt itself
    started, _, _ = await _run(b, _params(_turn2()))
    assert started.pull is not None and started.pull.first_block == len(SYSTEM) // BS
    assert started.cached_tokens == len(SYSTEM) and started.pulled_tokens == (len(HISTORY) // BS) * BS - len(SYSTEM)
    again, _, _ = await _run(b, _params(_turn2()))
    assert again.pull is not None and again.pull.outcome is PullOutcome.NOT_NEEDED and again.pulled_tokens == 0


@pytest.mark.parametrize("case", ["source_gone", "other_owner", "evicted_before", "corrupt", "evicted_during",
                                  "deadline"])
async def test_every_failed_pull_falls_back_to_prefill(pair: Pair, case: str) -> None:
    a, b, steps, peer = pair
    await _run(a, _params(HISTORY, source=None))
    await _run(b, _params(SYSTEM + [5], source=None))  # b holds the shared prefix: only private blocks are asked
    params = _params(_turn2())
    expected = {"source_gone": PullOutcome.UNAVAILABLE, "other_owner": PullOutcome.NOT_HELD,
                "evicted_before": PullOutcome.NOT_HELD, "corrupt": PullOutcome.CORRUPT,
                "evicted_during": PullOutcome.EVICTED, "deadline": PullOutcome.DEADLINE}[case]
    match case:
        case "source_gone":
            params = dataclasses.replace(params, source=PullSource("a", "gone:1"))
        case "other_owner":  # mallory names alice's blocks (their hashes, as if he knew her salt and tokens)
            params = dataclasses.replace(params, owner_id=OwnerId("mallory"))
        case "evicted_before":
            assert await a.evict_conversation(CONV) > 0
        case "corrupt":
            def flip(block: KvBlockData) -> KvBlockData:
                return dataclasses.replace(block, digest=bytes([block.digest[0] ^ 1]) + block.digest[1:])
            a.transfers.tamper = flip
        case "evicted_during":
            def evict(block: KvBlockData) -> KvBlockData:
                a.blocks.evict_conversation(CONV)
                return block
            a.transfers.tamper = evict
        case "deadline":
            b.transfers.cfg = PullConfig(timeout_s=0.05)
            peer.stall = True
    first_b = len(steps)
    started, ids, finished = await _run(b, params)
    assert started.pull is not None and started.pull.outcome is expected, started.pull
    assert started.pulled_tokens == 0 and started.pull.blocks == 0
    assert started.cached_tokens == len(SYSTEM)
    assert sum(s.prefill_tokens for s in steps[first_b:]) == len(_turn2()) - len(SYSTEM)
    assert len(ids) == finished.usage.output_tokens == 6
    b.blocks.check()
    assert b.blocks.available_blocks == b.blocks.cfg.device_blocks  # nothing reserved or pinned is left
    assert a.transfers.serving == 0
    a.blocks.check()
    assert b.stats().transfer.failed_pulls == 1
    assert dict(b.stats().transfer.outcomes) == {expected.value: 1}


class _SlowImport(SimExecutor):
    """Imports on the transfer thread take a while; records when each began and ended."""

    def __init__(self) -> None:
        codec = WordCodec()
        super().__init__(H100_FP8, codec.encode(PASSAGE), BS, link=Link())
        self.began = threading.Event()
        self.ended = threading.Event()

    def import_blocks(self, blocks: Sequence[int], payloads: Sequence[bytes]) -> None:
        self.began.set()
        time.sleep(0.3)
        self.ended.set()


async def test_a_pull_cancelled_mid_import_frees_its_blocks_only_after_the_write_ended(pair: Pair) -> None:
    a, _, _, peer = pair
    slow = _SlowImport()
    b = EngineCore(slow, BlockConfig(BS, 512, 0), SchedulerConfig(64, 512, 64), WordCodec(), replica_id="slow",
                   clock=VirtualClock(), offload=True)  # block data on the transfer thread
    b.transfers.peer = peer
    await b.start()
    try:
        await _run(a, _params(HISTORY, source=None))
        pulling = asyncio.create_task(b.transfers.pull(_params(_turn2())))
        while not slow.began.is_set():
            await asyncio.sleep(0.01)
        pulling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pulling
        assert slow.ended.is_set()  # the reserved blocks went back only once nothing could still write them
        b.blocks.check()
        assert b.blocks.available_blocks == 512
    finally:
        await b.close()
