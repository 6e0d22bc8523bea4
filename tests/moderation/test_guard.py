"""The guard-model backend on the real tritonserver (from nvidia-pytriton, CPU), serving the embedded classifier
behind the guard tensor contract; skipped when tritonserver cannot run here."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import grpc
import pytest

from chatmesh.mesh.errors import Unavailable
from chatmesh.moderation.classifier import profanity_model
from chatmesh.moderation.guard import MODEL_NAME, TritonGuard, render_repository
from chatmesh.moderation.moderator import Moderator
from chatmesh.moderation.policy import Action, load, parse
from chatmesh.v1 import moderate_pb2, moderate_pb2_grpc
from tests.conftest import free_port, need
from tests.moderation.conftest import running

GUARD_POLICY = {"categories": {"guard_profanity": {"model": "guard:profanity", "flag_at": 0.5, "block_at": 0.9}}}


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from chatmesh.engine_adapter.triton.launcher import TritonInstall, TritonMissing, TritonServer

    try:
        install = TritonInstall.find()
    except TritonMissing as err:
        need(False, f"tritonserver ({err})")
        raise
    server = TritonServer(render_repository(tmp_path_factory.mktemp("guard")), models=[MODEL_NAME],
                          install=install)
    server.start()
    try:
        yield server.address
    finally:
        server.stop()


def test_guard_scores_match_the_embedded_classifier(triton: str) -> None:
    guard = TritonGuard(triton)
    try:
        assert guard.labels == ("profanity",)
        for text in ("How do I sort a list?", "you are an idiot", "what the hell"):
            assert guard.score(text)["profanity"] == pytest.approx(profanity_model().score(text), abs=1e-5)
    finally:
        guard.close()


def test_policy_categories_read_the_guard_and_see_split_phrases(triton: str) -> None:
    guard = TritonGuard(triton)
    moderator = Moderator(parse(GUARD_POLICY), profanity_model(), guard)
    assert moderator.check_input("Please summarise this article.").action is Action.ALLOW
    check = moderator.open_output()
    assert check.check("Honestly, you are an id").action is Action.ALLOW
    verdict = check.check("iot.")
    assert verdict.action is Action.BLOCK and verdict.categories[0].category == "guard_profanity"
    guard.close()


def test_replies_checked_together_share_one_batched_guard_call(triton: str) -> None:
    guard = TritonGuard(triton)
    moderator = Moderator(parse(GUARD_POLICY), profanity_model(), guard)
    checks = [moderator.open_output() for _ in range(70)]  # more than one request's max batch
    first = moderator.check_outputs([(c, "You are an id" if i % 2 else "Here is a") for i, c in enumerate(checks)])
    second = moderator.check_outputs([(c, "iot." if i % 2 else " list.") for i, c in enumerate(checks)])
    guard.close()
    assert all(v.action is Action.ALLOW for v in first)
    assert [v.action for v in second] == [Action.BLOCK if i % 2 else Action.ALLOW for i in range(70)]


def test_an_unknown_guard_model_is_unavailable(triton: str) -> None:
    with pytest.raises(Unavailable, match="no_such_model"):
        TritonGuard(triton, model="no_such_model")


async def test_service_with_the_guard_over_grpc(triton: str, tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(GUARD_POLICY))
    env = {"CHATMESH_MODERATION_GUARD_ADDRESS": triton, "CHATMESH_MODERATION_POLICY_FILE": str(policy)}
    async with running(env) as address:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = moderate_pb2_grpc.ModerateServiceStub(channel)
            reply = await stub.CheckInput(moderate_pb2.CheckInputRequest(text="you stupid idiot"))
    assert reply.verdict.action == moderate_pb2.MODERATION_ACTION_BLOCK
    assert reply.verdict.categories[0].category == "guard_profanity" and not reply.verdict.fallback


class FailingGuard:
    """A guard whose server has gone away."""

    labels: tuple[str, ...] = ("profanity",)

    def score(self, text: str) -> Mapping[str, float]:
        raise Unavailable(f"guard model {MODEL_NAME}: connection refused")

    def score_many(self, texts: Sequence[str]) -> list[Mapping[str, float]]:
        raise Unavailable(f"guard model {MODEL_NAME}: connection refused")


async def test_a_failing_guard_gets_the_failure_policy_and_says_why() -> None:
    moderator = Moderator(parse(GUARD_POLICY), profanity_model(), FailingGuard())
    env = {"CHATMESH_MODERATION_INPUT_FAILURE": "closed", "CHATMESH_MODERATION_CHECK_THREAD": "1"}
    async with running(env, moderator) as address:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = moderate_pb2_grpc.ModerateServiceStub(channel)
            reply = await stub.CheckInput(moderate_pb2.CheckInputRequest(text="hello"))
    assert reply.verdict.fallback and reply.verdict.action == moderate_pb2.MODERATION_ACTION_BLOCK
    assert "check failed (Unavailable)" in reply.verdict.reason


def test_no_guard_server_at_the_address_is_unavailable() -> None:
    with pytest.raises(Unavailable):
        TritonGuard(f"127.0.0.1:{free_port()}")


def test_the_default_policy_needs_no_guard() -> None:
    assert not any(m.startswith("guard:") for m in load().models)
