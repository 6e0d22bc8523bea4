"""The moderation client over real gRPC: outcomes from the policy, and the failure policy when the service is
down, slow or goes away mid-reply."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
import pytest
from prometheus_client import CollectorRegistry

from chatmesh.mesh.channels import open_channel
from chatmesh.mesh.config import Config
from chatmesh.mesh.trust import Trust
from chatmesh.mesh.errors import InvalidArgument
from chatmesh.moderation.classifier import profanity_model
from chatmesh.moderation.client import DecidedBy, FailurePolicy, ModerationClient, failures_counter
from chatmesh.moderation.moderator import Moderator, OutputCheck, Verdict
from chatmesh.moderation.policy import Action, FailureMode, load
from tests.conftest import free_port
from tests.moderation.conftest import running

CONV = "0b6f3c9e-4c1e-4d53-9a43-8f0f5a1c2d3e"


def client(address: str, registry: CollectorRegistry, **env: str) -> ModerationClient:
    cfg = Config(env={"CHATMESH_MESH_PLAINTEXT": "true", "CHATMESH_MODERATION_ADDRESS": address, "CHATMESH_MODERATION_CLIENT_TIMEOUT_MS": "10000", **env})
    return ModerationClient.from_config(cfg, registry)


def failures(registry: CollectorRegistry, direction: str, reason: str) -> float:
    value = registry.get_sample_value("chatmesh_moderation_client_failures_total",
                                      {"direction": direction, "reason": reason})
    return value or 0.0


async def test_outcomes_come_from_the_policy_when_the_service_is_up() -> None:
    registry = CollectorRegistry()
    async with running() as address:
        moderation = client(address, registry)
        benign = await moderation.check_input("What is a good name for a cat?", CONV)
        assert benign.action is Action.ALLOW and benign.decided_by is DecidedBy.POLICY
        card = await moderation.check_input("charge 4111-1111-1111-1111 please", CONV)
        assert card.blocked and [c.category for c in card.categories] == ["payment_card"]
        async with moderation.output(CONV) as session:
            first = await session.check("Well, you are such a lo")
            second = await session.check("ser, frankly.")
            third = await session.check(" Here is the answer.", final=True)
        assert [first.action, second.action, third.action] == [Action.ALLOW, Action.BLOCK, Action.ALLOW]
        await moderation.close()
    assert failures(registry, "input", "unavailable") == 0


async def test_service_down_applies_each_directions_policy_and_says_why() -> None:
    registry = CollectorRegistry()
    moderation = client(f"127.0.0.1:{free_port()}", registry, CHATMESH_MODERATION_INPUT_FAILURE="closed",
                        CHATMESH_MODERATION_OUTPUT_FAILURE="open")
    outcome = await moderation.check_input("hello there", CONV)
    assert outcome.blocked and outcome.decided_by is DecidedBy.CLIENT_FAILURE_POLICY
    assert "UNAVAILABLE" in outcome.reason and "input failing closed" in outcome.reason
    assert failures(registry, "input", "unavailable") == 1
    async with moderation.output(CONV) as session:
        chunk = await session.check("Here is")
        later = await session.check(" the answer.")
    for o in (chunk, later):
        assert o.action is Action.ALLOW and o.fallback and "output failing open" in o.reason
    assert "UNAVAILABLE" in chunk.reason
    assert failures(registry, "output", "unavailable") + failures(registry, "output", "broken") == 2
    await moderation.close()


async def test_an_input_check_waits_for_a_service_that_is_starting() -> None:
    """A moderation restart that a check runs into (nothing listening yet, then the channel's reconnect backoff)
    is waited for, within CHATMESH_MODERATION_CLIENT_CONNECT_WAIT_MS: the check gets a verdict, not the failure
    policy (an outage longer than the wait still gets it: the test above)."""
    registry = CollectorRegistry()
    address = f"127.0.0.1:{free_port()}"
    policy = FailurePolicy(FailureMode.CLOSED, FailureMode.OPEN, 10.0, failures_counter(registry),
                           connect_wait_s=60.0)
    channel = open_channel(Trust.insecure(), address, "moderation")  # the test's, to see its connection state
    moderation = ModerationClient(channel, policy, own_channel=True)
    check = asyncio.create_task(moderation.check_input("What is a good name for a cat?", CONV))
    state = channel.get_state(try_to_connect=True)
    while state is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:  # its first connection attempt is refused
        await asyncio.wait_for(channel.wait_for_state_change(state), 10)
        state = channel.get_state()
    assert not check.done()  # and the check waits on
    async with running(address=address):
        outcome = await check
    assert outcome.action is Action.ALLOW and outcome.decided_by is DecidedBy.POLICY
    assert failures(registry, "input", "unavailable") == 0
    await moderation.close()


async def test_service_down_fail_open_input_and_fail_closed_output() -> None:
    registry = CollectorRegistry()
    moderation = client(f"127.0.0.1:{free_port()}", registry, CHATMESH_MODERATION_INPUT_FAILURE="open",
                        CHATMESH_MODERATION_OUTPUT_FAILURE="closed")
    assert (await moderation.check_input("hello", CONV)).action is Action.ALLOW
    async with moderation.output(CONV) as session:
        assert (await session.check("Hello")).blocked
    await moderation.close()


class SlowModerator(Moderator):
    def check_input(self, text: str) -> Verdict:
        time.sleep(0.5)
        return super().check_input(text)

    def check_outputs(self, chunks: Sequence[tuple[OutputCheck, str]]) -> list[Verdict]:
        time.sleep(0.5)
        return super().check_outputs(chunks)


async def test_slow_service_hits_the_client_timeout() -> None:
    registry = CollectorRegistry()
    async with running({"CHATMESH_MODERATION_CHECK_DEADLINE_MS": "5000", "CHATMESH_MODERATION_CHECK_THREAD": "1"},
                       SlowModerator(load(), profanity_model())) as address:
        moderation = client(address, registry, CHATMESH_MODERATION_CLIENT_TIMEOUT_MS="50",
                            CHATMESH_MODERATION_INPUT_FAILURE="closed")
        outcome = await moderation.check_input("hello", CONV)
        await moderation.close()
    assert outcome.blocked and outcome.decided_by is DecidedBy.CLIENT_FAILURE_POLICY
    assert "DEADLINE_EXCEEDED" in outcome.reason
    assert failures(registry, "input", "deadline") == 1


async def test_slow_output_check_hits_the_client_timeout_per_chunk() -> None:
    registry = CollectorRegistry()
    async with running({"CHATMESH_MODERATION_CHECK_DEADLINE_MS": "5000", "CHATMESH_MODERATION_CHECK_THREAD": "1"},
                       SlowModerator(load(), profanity_model())) as address:
        moderation = client(address, registry, CHATMESH_MODERATION_CLIENT_TIMEOUT_MS="50",
                            CHATMESH_MODERATION_OUTPUT_FAILURE="closed")
        async with moderation.output(CONV) as session:
            outcome = await session.check("Here is the answer")
        await moderation.close()
    assert outcome.blocked and outcome.decided_by is DecidedBy.CLIENT_FAILURE_POLICY
    assert "did not answer within 50 ms" in outcome.reason and "output failing closed" in outcome.reason
    assert failures(registry, "output", "deadline") == 1


async def test_service_going_away_mid_reply_fails_over() -> None:
    registry = CollectorRegistry()
    async with running() as address:
        moderation = client(address, registry, CHATMESH_MODERATION_OUTPUT_FAILURE="closed")
        session = moderation.output(CONV)
        assert (await session.check("The first part")).decided_by is DecidedBy.POLICY
    after = await session.check(" and the rest.")
    assert after.blocked and after.decided_by is DecidedBy.CLIENT_FAILURE_POLICY
    assert "output failing closed" in after.reason
    await session.close()
    await moderation.close()


async def test_concurrent_sessions_share_one_stream_without_mixing_windows() -> None:
    import asyncio

    registry = CollectorRegistry()
    async with running() as address:
        moderation = client(address, registry)

        async def reply(n: int) -> list[Action]:
            chunks = ["Honestly, you are such a lo", "ser. Bye"] if n % 2 else ["Here is a lo", "ng answer."]
            async with moderation.output(CONV) as session:
                return [(await session.check(c)).action for c in chunks]

        results = await asyncio.gather(*(reply(n) for n in range(40)))
        await moderation.close()
    for n, actions in enumerate(results):
        assert actions == ([Action.ALLOW, Action.BLOCK] if n % 2 else [Action.ALLOW, Action.ALLOW]), n


async def test_an_oversized_output_chunk_is_refused_without_breaking_other_replies() -> None:
    registry = CollectorRegistry()
    async with running({"CHATMESH_MAX_MESSAGE_BYTES": "1000"}) as address:
        moderation = client(address, registry, CHATMESH_MAX_MESSAGE_BYTES="1000")
        async with moderation.output(CONV) as other, moderation.output(CONV) as bad:
            assert (await other.check("You are such a lo")).action is Action.ALLOW
            with pytest.raises(InvalidArgument):
                await bad.check("x" * 1001)
            after = await other.check("ser.")
        await moderation.close()
    assert after.blocked and after.decided_by is DecidedBy.POLICY  # the shared stream and its window survived


async def test_a_replys_first_chunk_does_not_linger_later_chunks_do() -> None:
    import asyncio

    registry = CollectorRegistry()
    async with running() as address:
        # A linger far longer than any check: only a chunk that skips it can answer quickly.
        moderation = client(address, registry, CHATMESH_MODERATION_CLIENT_BATCH_MS="3000")
        async with moderation.output(CONV) as session:
            first = await asyncio.wait_for(session.check("Here is a "), timeout=2.0)
            second = asyncio.ensure_future(session.check("long answer."))
            done, _ = await asyncio.wait({second}, timeout=1.0)
            assert not done  # held to share a message with other replies' chunks
            assert (await second).action is Action.ALLOW
        await moderation.close()
    assert first.action is Action.ALLOW and not first.fallback


async def test_a_pasted_document_is_judged_not_failed_over_at_the_default_deadlines() -> None:
    """The message size policy accepts 1 MiB; the check time limits scale with the text (per 32 KiB), so a long
    paste gets a verdict from the policy instead of the input's fail-closed policy (it was blocked as late)."""
    registry = CollectorRegistry()
    prose = "The committee reviewed the quarterly figures and agreed to revisit the plan in spring. " * 7000
    async with running({"CHATMESH_MODERATION_CHECK_DEADLINE_MS": "50"}) as address:
        moderation = ModerationClient.from_config(Config(env={"CHATMESH_MESH_PLAINTEXT": "true",
                                                              "CHATMESH_MODERATION_ADDRESS": address}), registry)
        benign = await moderation.check_input(prose, CONV)
        card = await moderation.check_input(prose + " charge 4111-1111-1111-1111 please", CONV)
        await moderation.close()
    assert len(prose.encode()) > 600_000
    assert benign.action is Action.ALLOW and benign.decided_by is DecidedBy.POLICY and not benign.fallback
    assert card.blocked and card.decided_by is DecidedBy.POLICY
