"""The one place a chatmesh process opens a gRPC channel to another service.

Whatever every hop needs is added here, once: today the tracing interceptors (only when tracing is on:
`chatmesh.mesh.tracing`), so the current trace context travels in each call's metadata. Open every
service-to-service channel through `open_channel`, never `grpc.aio.insecure_channel` directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from chatmesh.mesh import tracing


def open_channel(address: str, options: Sequence[tuple[str, int | str]] = ()) -> grpc.aio.Channel:
    interceptors = tracing.client_interceptors()
    return grpc.aio.insecure_channel(address, options=list(options) or None, interceptors=interceptors or None)
