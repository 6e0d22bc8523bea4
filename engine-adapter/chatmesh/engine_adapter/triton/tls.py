"""Mutual TLS between the engine and Triton, where Triton allows it.

Triton's gRPC endpoint speaks mutual TLS (`--grpc-use-ssl-mutual` with `--grpc-server-cert`, `--grpc-server-key`
and `--grpc-root-cert`: it then requires a client certificate signed by that root), and tritonclient takes gRPC
channel credentials. Triton is part of the engine's workload (its sidecar in a pod, or the process the engine
starts itself), so it serves the engine's own mesh certificate, `spiffe://chatmesh/engine` with the DNS name
`engine.chatmesh`, which is the name the engine's client verifies; the engine presents the same certificate as
its client certificate.

What Triton does not allow, and so is not done:
- identities: Triton accepts any client certificate the root signed, so any mesh identity, not only the engine,
  could call it directly (its gRPC port should not be reachable from other workloads: a sidecar listens on
  loopback, a locally started Triton on 127.0.0.1);
- rotation: Triton reads its certificate files once, at start; a rotated engine certificate reaches Triton when
  it restarts (the engine's own client channel also keeps the certificate it was made with).

`CHATMESH_TRITON_TLS` (settings.py): `auto` (default) is mutual TLS whenever the mesh runs mutual TLS, except
to a `CHATMESH_TRITON_ADDRESS` on loopback (a sidecar in the engine's pod, deploy/k8s's h100-triton overlay),
which stays plaintext as the mesh's own loopback rule allows; `on` is mutual TLS to any address; `off` is
plaintext, refused off loopback. In a plaintext mesh (CHATMESH_MESH_PLAINTEXT) Triton is plaintext too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from tritonclient.grpc import KeepAliveOptions
from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE

from chatmesh.engine_adapter.triton import settings
from chatmesh.mesh import identity as ident
from chatmesh.mesh import settings as mesh_settings
from chatmesh.mesh.config import Config
from chatmesh.mesh.tls import TlsFiles
from chatmesh.mesh.trust import TrustRefused, is_loopback, tls_files

SERVER_NAME = ident.server_name("engine")


@dataclass(frozen=True)
class TritonTls:
    """The engine's certificate, key and the mesh CA, as Triton serves them and the engine's client presents
    them."""

    files: TlsFiles
    server_name: str = SERVER_NAME

    def server_args(self) -> list[str]:
        """tritonserver flags: mutual TLS on its gRPC endpoint."""
        return ["--grpc-use-ssl=true", "--grpc-use-ssl-mutual=true", f"--grpc-server-cert={self.files.cert}",
                f"--grpc-server-key={self.files.key}", f"--grpc-root-cert={self.files.ca}"]

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of tritonclient's InferenceServerClient (sync and asyncio): mutual TLS credentials,
        the server name to verify, and tritonclient's own default channel options."""
        keepalive = KeepAliveOptions()
        credentials = grpc.ssl_channel_credentials(self.files.ca.read_bytes(), self.files.key.read_bytes(),
                                                   self.files.cert.read_bytes())
        return {"creds": credentials, "channel_args": [
            ("grpc.ssl_target_name_override", self.server_name),
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ]}


def from_config(cfg: Config, address: str) -> TritonTls | None:
    """TLS toward Triton at `address` (empty: a Triton this engine starts), or None for plaintext."""
    mode = cfg[settings.TRITON_TLS]
    if cfg[mesh_settings.MESH_PLAINTEXT] or mode == "off" or (mode == "auto" and address and is_loopback(address)):
        if address and not is_loopback(address):
            raise TrustRefused(f"Triton at {address} in plaintext refused: plaintext is for loopback only; set "
                               f"CHATMESH_TRITON_TLS=on (mutual TLS with the engine's mesh certificate)")
        return None
    files = tls_files(cfg, ident.ENGINE)
    missing = [str(p) for p in (files.ca, files.cert, files.key) if not p.is_file()]
    if missing:
        raise TrustRefused(f"mutual TLS toward Triton needs {', '.join(missing)} (the engine's mesh certificate)")
    return TritonTls(files)
