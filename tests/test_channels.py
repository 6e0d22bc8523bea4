"""Targets for several addresses (gRPC's static ipv4:/ipv6: resolver), passed-through schemes, clear refusals."""

from __future__ import annotations

import json

import pytest

from chatmesh.mesh import channels
from chatmesh.mesh.errors import InvalidArgument


def test_targets() -> None:
    assert channels.target_for("127.0.0.1:50051") == "127.0.0.1:50051"
    assert channels.target_for("chat.internal:50051") == "chat.internal:50051"
    assert channels.target_for("10.0.0.1:1, 10.0.0.2:2") == "ipv4:10.0.0.1:1,10.0.0.2:2"
    assert channels.target_for("localhost:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channels.target_for("[::1]:1,[::2]:2") == "ipv6:[::1]:1,[::2]:2"
    assert channels.target_for("dns:///chat.internal:50051") == "dns:///chat.internal:50051"


@pytest.mark.parametrize("bad", ["", "a.example:1,b.example:2", "10.0.0.1:1,[::1]:2", "10.0.0.1,10.0.0.2:1"])
def test_bad_targets_say_what_to_write(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        channels.target_for(bad)


def test_balanced_options_retry_only_the_named_methods() -> None:
    options = dict(channels.balanced_options("chatmesh.v1.ChatService", ("SendTurn",)))
    config = json.loads(str(options["grpc.service_config"]))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["methodConfig"][0]["name"] == [{"service": "chatmesh.v1.ChatService", "method": "SendTurn"}]
    assert "grpc.max_reconnect_backoff_ms" not in options  # open_channel adds RECONNECT to every channel


def test_a_plaintext_list_is_checked_address_by_address() -> None:
    assert channels.addresses_of("ipv4:127.0.0.1:1,127.0.0.1:2") == ["127.0.0.1:1", "127.0.0.1:2"]
    assert channels.addresses_of("dns:///chat:1") == ["dns:///chat:1"]
