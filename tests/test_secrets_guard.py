"""The production guard (chatmesh.mesh.secrets_guard): `chatmesh serve` refuses a non-loopback address while a
secret the service uses is at its development default, and names the setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chatmesh.mesh.config import Config
from chatmesh.mesh.secrets_guard import DevelopmentSecrets, defaults_in_use, refuse_development_secrets


def test_the_guard_names_each_default_secret_off_loopback() -> None:
    defaults = Config(env={})
    assert defaults_in_use(defaults, "engine") == ["CHATMESH_CACHE_SALT_SECRET"]  # it derives the cache salts
    assert defaults_in_use(defaults, "chat") == []
    assert defaults_in_use(defaults, "gateway") == ["CHATMESH_KEY_PEPPER"]
    assert defaults_in_use(defaults, "store") == []
    for loopback in ("127.0.0.1:50051", "[::1]:50051", "localhost:50051", "127.0.0.1"):
        refuse_development_secrets(defaults, "engine", loopback)
    with pytest.raises(DevelopmentSecrets, match="CHATMESH_CACHE_SALT_SECRET"):
        refuse_development_secrets(defaults, "engine", "0.0.0.0:50054")
    with pytest.raises(DevelopmentSecrets, match="CHATMESH_KEY_PEPPER"):
        refuse_development_secrets(defaults, "gateway", "10.0.0.5")
    refuse_development_secrets(Config(env={"CHATMESH_CACHE_SALT_SECRET": "ours"}), "engine", "0.0.0.0:50054")
    refuse_development_secrets(defaults, "store", "0.0.0.0:50052")  # uses neither


@pytest.mark.parametrize(("service", "env", "setting"), [
    ("engine", {"CHATMESH_LISTEN": "0.0.0.0:0", "CHATMESH_ENGINE": "sim"}, "CHATMESH_CACHE_SALT_SECRET"),
    ("gateway", {"CHATMESH_HOST": "0.0.0.0", "CHATMESH_AUTH": "required", "CHATMESH_GATEWAY_PORT": "0"},
     "CHATMESH_KEY_PEPPER"),
])
def test_serve_refuses_to_start_and_says_which_setting(service: str, env: dict[str, str], setting: str,
                                                        tmp_path: object) -> None:
    full = {**os.environ, "CHATMESH_MESH_PLAINTEXT": "false", "CHATMESH_DATA_DIR": str(tmp_path), **env}
    full.pop("CHATMESH_CACHE_SALT_SECRET", None)
    full.pop("CHATMESH_KEY_PEPPER", None)
    # mutual TLS (off loopback) with development certificates, so only the secrets stand in the way
    subprocess.run([sys.executable, "-m", "chatmesh.mesh.cli", "certs"], env=full, check=True, capture_output=True,
                   timeout=60)
    done = subprocess.run([sys.executable, "-m", "chatmesh.mesh.cli", "serve", service], env=full,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert setting in done.stderr and "startup_refused" in done.stderr


@pytest.mark.parametrize("public", [
    {"CHATMESH_PUBLIC_ORIGIN": "https://chat.example.com"}, {"CHATMESH_SECURE_COOKIES": "true"},
    {"CHATMESH_FORWARDED_ALLOW_IPS": "127.0.0.1"}])
def test_a_gateway_configured_for_the_public_refuses_the_development_pepper_on_loopback_too(
        public: dict[str, str]) -> None:
    """Issue 30: a loopback bind behind a proxy serving a public https origin took the development pepper (so
    device cookies could be forged and the login throttle skipped)."""
    from chatmesh.gateway.app import StartupRefused, check_bind

    with pytest.raises(StartupRefused, match="CHATMESH_KEY_PEPPER") as refused:
        check_bind(Config(env={"CHATMESH_HOST": "127.0.0.1", **public}))
    assert next(iter(public)) in str(refused.value)
    check_bind(Config(env={"CHATMESH_HOST": "127.0.0.1", "CHATMESH_KEY_PEPPER": "ours", **public}))
    check_bind(Config(env={"CHATMESH_HOST": "127.0.0.1", "CHATMESH_PUBLIC_ORIGIN": "http://localhost:8080"}))
