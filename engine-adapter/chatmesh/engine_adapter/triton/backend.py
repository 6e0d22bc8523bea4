"""The `triton` backend: GenerateService's `Backend` forwarded to chatmesh's model on Triton Inference Server.

Transport: tritonclient's asyncio gRPC client, one `ModelStreamInfer` stream per generation (so cancelling one
generation cancels one stream and nothing else), on one shared channel. The request half of the stream stays open
until the generation finishes; responses are wire.py's started / delta / finished tensors. The channel speaks
mutual TLS with the engine's mesh certificate when tls.py says so (a Triton this backend starts serves it too).

Failure rules (the servicer maps the typed errors to gRPC statuses):
- Triton unreachable or answering UNAVAILABLE before the first token: retried `retries` times with a short
  backoff, then `Unavailable` naming the address. `Started` is held back until the first token (they arrive
  within one engine step of each other), so the caller never sees the abandoned attempt.
- Any other Triton-level error before the first token (model not loaded, deadline): `Unavailable` naming the
  address: this replica cannot serve, the router should try another.
- The model's own refusals arrive typed: `InvalidArgument`, `ResourceExhausted` (queue full), never retried.
- After the first token nothing is retried: the stream ends with `Finished(ERROR)` and what was produced.
- Deadline: `timeout_s` bounds the whole stream (gRPC deadline).
- Cancel: closing the event iterator cancels the gRPC call; Triton marks the request cancelled, the model aborts
  the sequence and frees its blocks (python_model.py).

Stats and readiness: a poller asks the model for its EngineStats every `stats_interval_s`; every Started and
Finished carries a fresh snapshot too, and a cancel triggers re-reads 50, 200 and 700 ms later (the model frees
the sequence within one cancel check, 50 ms by default). Snapshots are versioned, so a late one never overwrites a newer one.
Readiness is Triton's ModelReady for the model, refreshed by the same poller. The served model's identity
(`model`) is the one the model on Triton reports with its statistics: its own engine's profile. Residency (which
conversations' prefixes the model's engine caches, for the router) is read by the same poller with the
`residency` command and a cursor, into a local journal that this backend's own watchers read (`residency`); a
model that restarted (a new epoch) is read again from a full listing. A model whose engine cannot tell says so,
and so does this.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient

from chatmesh.engine_adapter.backend import (
    Delta,
    EngineStats,
    Finished,
    FinishReason,
    GenerateEvent,
    GenerateParams,
    PullOutcome,
    PullReport,
    Residency,
    ResumeRefused,
    ServeRequest,
    Started,
    TierStats,
    TransferEvent,
    TransferStats,
    Usage,
    cannot_transfer,
)
from chatmesh.engine_adapter import settings as engine_settings
from chatmesh.engine_adapter.residency import FROM_START, ResidencyJournal
from chatmesh.engine_adapter.triton import settings, wire
from chatmesh.engine_adapter.triton import tls as triton_tls
from chatmesh.engine_adapter.triton.tls import TritonTls
from chatmesh.engine_adapter.triton.launcher import TritonServer
from chatmesh.engine_adapter.triton.render import Deployment, render
from chatmesh.mesh import logs, tracing
from chatmesh.mesh import settings as mesh_settings
from chatmesh.mesh.config import Config, Setting
from chatmesh.mesh.errors import Unavailable
from chatmesh.mesh.ids import ConversationId, TurnId
from chatmesh.model import profile
from chatmesh.model import settings as model_settings
from chatmesh.model.profile import ModelIdentity

log = logs.get("chatmesh.triton.backend")

_INPUT_TYPES = {name: wire.CLIENT_DTYPE[dtype] for name, dtype, _ in wire.INPUTS}
RETRY_BACKOFF_S = (0.05, 0.2, 0.5)
DRAIN_S = 2.0  # a completed stream gets this long to end on its own
CANCEL_REFRESH_S = (0.1, 0.25, 0.7)  # after a cancel, stats are re-read at these delays (model check: 50 ms)
NOT_REPORTED = ModelIdentity("(not reported yet)", "")  # before the model's first statistics arrive


class _StreamFailed(Exception):
    """A Triton-level failure of one stream; `code` is the gRPC status when there is one."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


@dataclass(eq=False)  # kept in sets by identity
class _Cancel:
    """One generation's handle for `cancel_turn`: its Triton stream, once open, and whether it was cancelled."""

    call: Any = None
    requested: bool = False


@dataclass(frozen=True)
class TritonOptions:
    address: str
    model: str = wire.MODEL_NAME
    replica_id: str = "triton-0"
    timeout_s: float = 600.0
    retries: int = 2
    stats_interval_s: float = 1.0
    ready_timeout_s: float = 10.0  # how long start() waits for ModelReady before serving not-ready
    tls: TritonTls | None = None  # mutual TLS toward a remote Triton (tls.py); a started server brings its own


class TritonBackend:
    """A `Backend` whose engine runs inside Triton. `server`, when given, is started and stopped with it."""

    name = "triton"

    def __init__(self, options: TritonOptions, server: TritonServer | None = None):
        self.options = options
        self.server = server
        self._client: grpcclient.InferenceServerClient | None = None
        self._stats = EngineStats(options.replica_id, self.name, 0, 0, 0, TierStats(0, 0, 0), TierStats(0, 0, 0))
        self._draining = False
        self._model = NOT_REPORTED
        self._stats_epoch = ""
        self._stats_version = -1
        self._background: set[asyncio.Task[None]] = set()
        self._ready = False
        self._poller: asyncio.Task[None] | None = None
        self._turns: dict[tuple[bytes, TurnId], set[_Cancel]] = {}  # running generations, for cancel_turn
        self._residency = ResidencyJournal()  # the model's residency, mirrored
        self._residency_cursor = FROM_START
        self._residency_epoch = ""
        self._residency_supported = True

    @property
    def model(self) -> ModelIdentity:
        """What the model on Triton reports serving (its engine's profile), from its latest statistics."""
        return self._model

    @property
    def address(self) -> str:
        return self.server.address if self.server is not None else self.options.address

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.server is not None and not self.server.running():
            await self.server.start_async()
        tls = self.server.tls if self.server is not None else self.options.tls
        self._client = grpcclient.InferenceServerClient(self.address, **(tls.client_kwargs() if tls else {}))
        deadline = asyncio.get_running_loop().time() + self.options.ready_timeout_s
        while not await self._model_ready() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        self._poller = asyncio.create_task(self._poll())
        if not self._ready:
            # A remote Triton may still be loading a 70 B checkpoint: serve NOT ready (health, router) and let
            # the poller notice ModelReady, rather than fail the engine's start.
            log.warning("triton_not_ready", address=self.address, model=self.options.model,
                        waited_s=self.options.ready_timeout_s)
            return
        await self.refresh_stats()
        log.info("triton_backend_ready", address=self.address, model=self.options.model)

    async def close(self) -> None:
        self._ready = False
        background = list(self._background)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)

    def ready(self) -> bool:
        return self._ready

    async def _model_ready(self) -> bool:
        assert self._client is not None
        try:
            self._ready = bool(await self._client.is_model_ready(self.options.model, client_timeout=2.0))
        except Exception:  # noqa: BLE001  (any failure to answer means "not ready")
            self._ready = False
        return self._ready

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.options.stats_interval_s)
            was_ready = self._ready
            if await self._model_ready():
                if not was_ready:
                    log.info("triton_backend_ready", address=self.address, model=self.options.model)
                with contextlib.suppress(Unavailable):
                    await self.refresh_stats()
                    await self.refresh_residency()

    # ---- generation ------------------------------------------------------------------------------------------

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerateEvent]:
        if params.resumed_tokens and params.sampling.temperature > 0:
            # TensorRT-LLM draws from a per-request random state seeded once: a continuation would draw other
            # tokens than the reply it continues had. Greedy decoding continues as it is.
            raise ResumeRefused("the triton backend cannot continue a sampled reply exactly (TensorRT-LLM's sampler "
                                "state cannot be resumed); the turn is retried from its start")
        inputs = wire.request_tensors(params)
        prompt = len(params.prompt_token_ids)
        attempt = 0
        cancel = _Cancel()
        key = (params.cache_salt, params.turn_id) if params.turn_id is not None else None
        if key is not None:
            self._turns.setdefault(key, set()).add(cancel)
        try:
            async for event in self._generate(params, inputs, prompt, attempt, cancel):
                yield event
        finally:
            if key is not None and (running := self._turns.get(key)) is not None:
                running.discard(cancel)
                if not running:
                    del self._turns[key]

    def cancel_turn(self, salt: bytes, turn_id: TurnId) -> int:
        running = self._turns.pop((salt, turn_id), set())
        for cancel in running:
            cancel.requested = True
            if cancel.call is not None:
                cancel.call.cancel()  # Triton cancels the request; the model aborts it
        return len(running)

    async def _generate(self, params: GenerateParams, inputs: Mapping[str, wire.Array], prompt: int, attempt: int,
                        cancel: _Cancel) -> AsyncIterator[GenerateEvent]:
        while True:
            produced = 0
            streamed = False
            held: Started | None = None  # Started waits for the first token: until then a retry is invisible
            try:
                async with contextlib.aclosing(self._stream(inputs, cancel)) as responses:
                    async for get in responses:
                        for event in self._events(get, prompt):
                            if isinstance(event, Started):
                                held = event if params.source is None else dataclasses.replace(
                                    event, pull=PullReport(params.source.replica_id, PullOutcome.UNSUPPORTED))
                                continue
                            streamed = True
                            if held is not None:
                                yield held
                                held = None
                            if isinstance(event, Delta):
                                produced += len(event.token_ids)
                            yield event
                            if isinstance(event, Finished):
                                return
                raise _StreamFailed("the stream ended before the generation finished")
            except asyncio.CancelledError:
                self._refresh_soon()  # the caller cancelled: the model frees the sequence within a cancel check
                if not cancel.requested:
                    raise
                yield Finished(FinishReason.CANCELLED, Usage(prompt, 0, produced))  # cancel_turn's: ended here
                return
            except GeneratorExit:
                self._refresh_soon()
                raise
            except _StreamFailed as err:
                if cancel.requested:
                    self._refresh_soon()
                    yield Finished(FinishReason.CANCELLED, Usage(prompt, 0, produced))
                    return
                if streamed:
                    log.warning("triton_stream_failed", address=self.address, code=str(err.code), produced=produced)
                    yield Finished(FinishReason.ERROR, Usage(prompt, 0, produced), f"Triton at {self.address}: {err}")
                    return
                if err.code is grpc.StatusCode.UNAVAILABLE and attempt < self.options.retries:
                    await asyncio.sleep(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)])
                    attempt += 1
                    continue
                raise Unavailable(f"Triton at {self.address} is unavailable: {err}") from None

    def _events(self, get: wire.Getter, prompt_tokens: int) -> list[GenerateEvent]:
        """The events one response carries; the model's typed refusals are raised."""
        if wire.kind_of(get) is wire.WireEvent.ERROR:
            error = wire.error_of(get)
            if error is not None:
                raise error
            return [Finished(FinishReason.ERROR, Usage(prompt_tokens, 0, 0), wire.error_message_of(get))]
        self._take(wire.stats_of(get))
        return wire.events_of(get)

    async def _stream(self, inputs: Mapping[str, wire.Array], cancel: _Cancel | None = None
                      ) -> AsyncGenerator[wire.Getter, None]:
        """One request on its own stream; yields each response's outputs. Leaving early cancels the stream, as
        does `cancel_turn` (through `cancel`)."""
        if self._client is None:
            raise _StreamFailed("the backend is not started", grpc.StatusCode.UNAVAILABLE)
        done = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.options.model, "inputs": _infer_inputs(inputs)}
            await done.wait()  # keep the request half open until the last response

        # the turn's trace context (W3C traceparent) travels on to Triton, which continues it when its OpenTelemetry
        # trace mode is on (`--trace-config mode=opentelemetry`); empty when tracing is off
        call = self._client.stream_infer(requests(), stream_timeout=self.options.timeout_s,
                                         headers=tracing.inject({}) or None)
        if cancel is not None:
            cancel.call = call
        complete = False
        try:
            async for result, error in call:
                if error is not None:
                    raise _StreamFailed(str(error))
                kind = wire.kind_of(result.as_numpy)
                complete = kind not in (wire.WireEvent.STARTED, wire.WireEvent.DELTA, wire.WireEvent.FIRST)
                yield result.as_numpy
                if complete:
                    break  # that was the request's last response
        except grpc.aio.AioRpcError as err:
            raise _StreamFailed(_describe(err), err.code()) from None
        finally:
            done.set()  # half-close: Triton ends the stream once the request is complete
            if complete:
                await _drain(call)
            else:
                call.cancel()  # the caller left early: Triton cancels the request, the model aborts it

    async def _command(self, command: wire.Command, argument: bytes | str | int = b"", salt: bytes = b""
                       ) -> wire.Getter:
        try:
            async with contextlib.aclosing(self._stream(wire.command_tensors(command, argument, salt))) as responses:
                async for get in responses:
                    if wire.kind_of(get) is wire.WireEvent.ERROR:
                        error = wire.error_of(get)
                        raise error if error is not None else Unavailable(
                            f"Triton at {self.address}: {wire.error_message_of(get)}")
                    return get
        except _StreamFailed as err:
            raise Unavailable(f"Triton at {self.address} is unavailable: {err}") from None
        raise Unavailable(f"Triton at {self.address}: no answer to {command.value}")

    # ---- control ---------------------------------------------------------------------------------------------

    async def refresh_stats(self) -> EngineStats:
        """Reads the engine's statistics from the model now (stats() returns the latest read)."""
        self._take(wire.stats_of(await self._command(wire.Command.STATS)))
        return self._stats

    async def refresh_residency(self) -> None:
        """Reads what changed in the model's residency since the last read into the local journal."""
        if not self._residency_supported:
            return
        epoch, r = wire.residency_of(await self._command(wire.Command.RESIDENCY, self._residency_cursor))
        if r is None:
            self._residency_supported = False
            return
        if epoch != self._residency_epoch and self._residency_cursor != FROM_START:
            self._residency_epoch, self._residency_cursor = epoch, FROM_START  # the model restarted: list anew
            return await self.refresh_residency()
        self._residency_epoch, self._residency_cursor = epoch, r.version
        listed = dict(r.conversations)
        if r.full:
            for conversation in self._residency.held():
                if conversation not in listed:
                    self._residency.set(conversation, 0)
        for conversation, tokens in listed.items():
            self._residency.set(conversation, tokens)

    def residency(self, since: int) -> Residency | None:
        if not self._residency_supported:
            return None
        return Residency.of(self._residency.changes(since))

    def _refresh_soon(self) -> None:
        async def refresh() -> None:
            for delay in CANCEL_REFRESH_S:
                await asyncio.sleep(delay)
                with contextlib.suppress(Unavailable):
                    await self.refresh_stats()

        task = asyncio.get_running_loop().create_task(refresh())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def stats(self) -> EngineStats:
        return self._stats

    def _take(self, snapshot: wire.Snapshot | None) -> None:
        """Keeps the newest snapshot, as this replica's stats."""
        if snapshot is None:
            return
        if snapshot.epoch == self._stats_epoch and snapshot.version <= self._stats_version:
            return  # an older snapshot that arrived late
        self._stats_epoch, self._stats_version = snapshot.epoch, snapshot.version
        self._stats = dataclasses.replace(snapshot.stats, replica_id=self.options.replica_id, backend=self.name,
                                          transfer=TransferStats(), draining=self._draining)
        if snapshot.model is not None:
            self._model = snapshot.model

    async def evict_conversation(self, conversation_id: ConversationId, salt: bytes | None = None) -> int:
        return wire.blocks_evicted_of(await self._command(wire.Command.EVICT_CONVERSATION, conversation_id,
                                                          salt or b""))

    async def evict_salt(self, salt: bytes) -> int:
        return wire.blocks_evicted_of(await self._command(wire.Command.EVICT_SALT, salt))

    def serve_prefix(self, request: ServeRequest) -> AsyncIterator[TransferEvent]:
        raise cannot_transfer(self.name)  # its KV lives inside TensorRT-LLM (docs/triton.md); stats say so

    def mark_draining(self) -> None:
        self._draining = True
        self._stats = dataclasses.replace(self._stats, draining=True)


def _infer_inputs(tensors: Mapping[str, wire.Array]) -> list[Any]:
    out = []
    for name, value in tensors.items():
        item = grpcclient.InferInput(name, list(value.shape), _INPUT_TYPES[name])
        item.set_data_from_numpy(np.ascontiguousarray(value))
        out.append(item)
    return out


async def _drain(call: Any) -> None:
    """Lets a completed stream end by itself (cancelling it as it completes has crashed Triton 2.51 here)."""
    try:
        async with asyncio.timeout(DRAIN_S):
            async for _ in call:
                pass
    except (TimeoutError, grpc.aio.AioRpcError):
        call.cancel()


def _describe(err: grpc.aio.AioRpcError) -> str:
    return f"{err.code().name}: {err.details() or 'no details'}"


def repository_for(path: str, data_dir: str, replica_id: str) -> Path:
    return Path(path) if path else Path(data_dir).expanduser() / "triton" / replica_id / "repository"


def from_config(cfg: Config) -> TritonBackend:
    """The backend the settings describe; with no address, a local tritonserver it starts and stops itself."""
    options = TritonOptions(
        address=cfg[settings.TRITON_ADDRESS], model=cfg[settings.TRITON_MODEL],
        replica_id=cfg[engine_settings.REPLICA_ID], timeout_s=cfg[settings.TRITON_TIMEOUT_S],
        retries=cfg[settings.TRITON_RETRIES], stats_interval_s=cfg[settings.TRITON_STATS_INTERVAL_MS] / 1000,
        tls=triton_tls.from_config(cfg, cfg[settings.TRITON_ADDRESS]))
    if options.address:
        return TritonBackend(options)
    repository = repository_for(cfg[settings.TRITON_REPOSITORY], cfg[mesh_settings.DATA_DIR], options.replica_id)
    if not cfg[settings.TRITON_REPOSITORY]:
        engine_env = {k: v for k, v in cfg.as_env(_engine_settings()).items()
                      if k in {s.env for s in _engine_settings()} and k != engine_settings.ENGINE.env}
        render(Deployment.for_profile(profile.load(cfg), name=options.model, engine=cfg[settings.TRITON_ENGINE],
                                      engine_env=engine_env, replica_id=options.replica_id), repository)
    # a local engine inside the stub loads torch and the GGUF: over a minute on a busy 2-core machine
    return TritonBackend(options, TritonServer(repository, models=[options.model], ready_timeout_s=300,
                                               tls=options.tls))


def _engine_settings() -> list[Setting[Any]]:
    """What the engine inside a locally started Triton is configured by: the engine's settings and the model's."""
    return [v for m in (engine_settings, model_settings) for v in vars(m).values() if isinstance(v, Setting)]
