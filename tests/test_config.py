"""Configuration: flags over environment over defaults, and clear errors for bad values."""

from __future__ import annotations

import pytest

from chatmesh.mesh import settings
from chatmesh.mesh.config import Config


def test_flag_beats_environment_beats_default() -> None:
    assert Config(env={})[settings.GATEWAY_PORT] == 8080
    assert Config(env={"CHATMESH_GATEWAY_PORT": "9000"})[settings.GATEWAY_PORT] == 9000
    cfg = Config(env={"CHATMESH_GATEWAY_PORT": "9000"}, flags={"gateway_port": "9100"})
    assert cfg[settings.GATEWAY_PORT] == 9100


def test_bad_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="CHATMESH_GATEWAY_PORT"):
        Config(env={"CHATMESH_GATEWAY_PORT": "eighty"})[settings.GATEWAY_PORT]
    with pytest.raises(ValueError, match="one of debug, info"):
        Config(env={"CHATMESH_LOG_LEVEL": "loud"})[settings.LOG_LEVEL]


def test_unread_names_what_no_config_of_the_process_resolved() -> None:
    cfg = Config(env={"CHATMESH_GATEWAY_PORT": "9000", "CHATMESH_GATEWAY_PROT": "9000", "PATH": "/bin"})
    cfg[settings.GATEWAY_PORT]
    assert cfg.unread() == ["CHATMESH_GATEWAY_PROT"]  # a misspelling stays unread; PATH is not a setting
