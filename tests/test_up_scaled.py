"""`chatmesh up --engines N --chats N`: several engine replicas and chat processes on one host."""

from __future__ import annotations

import pytest

from chatmesh.mesh.config import Config
from chatmesh.mesh.up import MeshError, scaled


def test_replicas_and_chat_processes_listen_ten_ports_apart() -> None:
    env, extra = scaled(Config(env={}), engines=3, chats=2)
    assert env == {"CHATMESH_REPLICAS": "engine-0=127.0.0.1:50054,engine-1=127.0.0.1:50064,engine-2=127.0.0.1:50074",
                   "CHATMESH_CHAT_ADDRESSES": "127.0.0.1:50051,127.0.0.1:50061"}
    assert [(x.name, x.service, x.address, dict(x.env)) for x in extra] == [
        ("engine-1", "engine", "127.0.0.1:50064", {"CHATMESH_REPLICA_ID": "engine-1"}),
        ("engine-2", "engine", "127.0.0.1:50074", {"CHATMESH_REPLICA_ID": "engine-2"}),
        ("chat-1", "chat", "127.0.0.1:50061", {"CHATMESH_CHAT_INSTANCE_ID": "chat-1"})]


def test_one_of_each_changes_nothing_and_a_replica_list_is_not_overridden() -> None:
    assert scaled(Config(env={}), 1, 1) == ({}, [])
    with pytest.raises(MeshError, match="CHATMESH_REPLICAS"):
        scaled(Config(env={"CHATMESH_REPLICAS": "a=h:1"}), 2, 1)
    with pytest.raises(MeshError, match="at least 1"):
        scaled(Config(env={}), 0, 1)
