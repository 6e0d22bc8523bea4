"""chatmesh's Triton Python-backend model (`chatmesh_llm`): one engine `Backend` behind Triton's decoupled tensors.

Why our own model: the stock TensorRT-LLM `llmapi` model takes text and has no cache-salt input; chatmesh sends
token ids (its context builder owns the prompt, I3) and the owner's salt (I1). The model is decoupled: one Triton
request streams started / delta / finished responses (wire.py), and control requests (stats, evict) answer once.

What runs inside (`engine` parameter of config.pbtxt):
- `trtllm`: TensorRT-LLM's LLM API, PyTorch backend (trtllm.py), configured by the rendered llm_config.json;
- `sim` / `local`: chatmesh's own engine backend (the same `build_backend` GenerateService uses in-process), so a
  machine without a GPU serves the same tensors;
- `auto` (default): `trtllm` where `tensorrt_llm` imports, else `fallback_engine`.

Threads: Triton calls `execute` on the stub's main thread; it only schedules one coroutine per request on the
engine's own asyncio loop (a daemon thread) and returns. Responses are queued, in order, to a sender thread: a
send is an IPC round trip to the server, and the engine loop should keep stepping meanwhile. A watcher thread asks
Triton every `cancel_check_ms` (50) whether each open request was cancelled (the client cancelled its stream or went
away) and cancels its coroutine, which closes the backend's event iterator: the sequence is aborted and its KV
blocks freed (I5). Every request gets exactly one response flagged COMPLETE_FINAL, whatever happens, and is
never asked `is_cancelled()` after it (see `_send_loop`).

The model takes `pb_utils` (triton_python_backend_utils, which exists only inside the stub) as an argument, so this
module imports anywhere and is type-checked; triton_models/chatmesh_llm/1/model.py is the two-line shim Triton loads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import os
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, assert_never

import numpy as np

from chatmesh.engine_adapter.backend import Backend, Delta, Finished, GenerateEvent, Started
from chatmesh.engine_adapter.triton import wire
from chatmesh.mesh.errors import CoreError
from chatmesh.mesh.ids import parse_conversation_id

DEFAULT_CANCEL_CHECK_MS = 50
T = TypeVar("T")


def engine_choice(requested: str, fallback: str) -> str:
    """The engine to run: `auto` means TensorRT-LLM where it imports, else the fallback."""
    if requested != "auto":
        return requested
    return "trtllm" if importlib.util.find_spec("tensorrt_llm") is not None else fallback


def parse_engine_env(text: str) -> dict[str, str]:
    """`CHATMESH_A=1;CHATMESH_B=x` (config.pbtxt's engine_env) as a dict; only CHATMESH_* names are taken."""
    out: dict[str, str] = {}
    for item in text.split(";"):
        name, sep, value = item.strip().partition("=")
        if sep and name.startswith("CHATMESH_"):
            out[name] = value
    return out


def build_engine(parameters: Mapping[str, str], model_dir: str) -> Backend:
    """The Backend the model serves, from config.pbtxt's parameters."""
    engine = engine_choice(parameters.get("engine", "auto"), parameters.get("fallback_engine", "sim"))
    if engine == "trtllm":
        from chatmesh.engine_adapter.triton.trtllm import TrtLlmBackend

        path = parameters.get("llm_config", "llm_config.json")
        return TrtLlmBackend.from_file(path if os.path.isabs(path) else os.path.join(model_dir, path))
    from chatmesh.engine_adapter.service import build_backend
    from chatmesh.mesh.config import Config

    env = {k: v for k, v in os.environ.items() if k.startswith("CHATMESH_")}
    env.update(parse_engine_env(parameters.get("engine_env", "")))
    env["CHATMESH_ENGINE"] = engine
    backend: Backend = build_backend(Config(env=env))
    return backend


async def _settle(timeout_s: float = 5.0) -> None:
    """Waits for the loop's other tasks (requests being answered) to finish."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


async def _close(events: AsyncIterator[GenerateEvent]) -> None:
    """Closes a backend's event iterator (an async generator): its cleanup cancels the sequence."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


@dataclass
class _Open:
    """A request being served: Triton's request object and the coroutine serving it."""

    request: Any
    task: concurrent.futures.Future[None]


class ChatmeshModel:
    """The TritonPythonModel body; `pb_utils` is Triton's triton_python_backend_utils module."""

    def __init__(self, pb_utils: Any):
        self.pb = pb_utils
        self.backend: Backend | None = None
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="chatmesh-engine", daemon=True)
        self._open: dict[int, _Open] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch_cancellation, name="chatmesh-cancel", daemon=True)
        self._outbox: queue.SimpleQueue[tuple[int, Any, Any, bool] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="chatmesh-send", daemon=True)
        self._cancel_check_s = DEFAULT_CANCEL_CHECK_MS / 1000
        self._next_key = 0
        self._stats_version = 0
        self._epoch = uuid.uuid4().hex

    # ---- Triton's entry points -------------------------------------------------------------------------------

    def initialize(self, args: Mapping[str, str]) -> None:
        config = json.loads(args["model_config"])
        if not self.pb.using_decoupled_model_transaction_policy(config):
            raise self.pb.TritonModelException("chatmesh_llm must be decoupled (model_transaction_policy)")
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self._cancel_check_s = float(parameters.get("cancel_check_ms") or DEFAULT_CANCEL_CHECK_MS) / 1000
        model_dir = args.get("model_repository", "")  # the model's folder: llm_config.json sits beside config.pbtxt
        self._loop_thread.start()
        self.backend = self._call(self._build_and_start(parameters, model_dir))
        self._watcher.start()
        self._sender.start()
        self.pb.Logger.log_info(f"chatmesh_llm: serving the {self.backend.name} engine")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            with self._lock:
                key = self._next_key
                self._next_key += 1
                # the lock is held until the entry exists, so its removal (with the final send) always comes after
                self._open[key] = _Open(request, asyncio.run_coroutine_threadsafe(self._serve(key, request),
                                                                                  self.loop))
        return None

    def finalize(self) -> None:
        self._stopping.set()
        if self.backend is not None:
            try:
                self._call(self.backend.close())  # open generations finish CANCELLED...
                self._call(_settle())  # ...and their coroutines queue their final responses
            except Exception as err:  # noqa: BLE001  (shutting down: log and go on stopping)
                self.pb.Logger.log_error(f"chatmesh_llm: engine close failed: {type(err).__name__}")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=5)
        self._outbox.put(None)
        self._sender.join(timeout=5)

    # ---- serving ---------------------------------------------------------------------------------------------

    async def _build_and_start(self, parameters: Mapping[str, str], model_dir: str) -> Backend:
        backend = build_engine(parameters, model_dir)
        await backend.start()
        return backend

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _snapshot(self) -> wire.Snapshot:
        """The engine's stats now (called on the engine loop only, so the version counter needs no lock)."""
        assert self.backend is not None
        self._stats_version += 1
        return wire.Snapshot(self._epoch, self._stats_version, self.backend.stats(), self.backend.model)

    def _get(self, request: Any) -> wire.Getter:
        def get(name: str) -> wire.Array | None:
            tensor = self.pb.get_input_tensor_by_name(request, name)
            if tensor is None:
                return None
            arr: wire.Array = tensor.as_numpy()
            return arr

        return get

    def _response(self, tensors: Mapping[str, wire.Array]) -> Any:
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor(k, np.ascontiguousarray(v))
                                                         for k, v in tensors.items()])

    async def _serve(self, key: int, request: Any) -> None:
        sender = request.get_response_sender()
        final_sent = False
        events: AsyncIterator[GenerateEvent] | None = None

        def send(tensors: Mapping[str, wire.Array], final: bool = False) -> None:
            nonlocal final_sent
            self._outbox.put((key, sender, self._response(tensors), final))
            final_sent = final_sent or final

        try:
            assert self.backend is not None
            get = self._get(request)
            try:
                command = wire.command_of(get)
                match command:
                    case wire.Command.GENERATE:
                        events = self.backend.generate(wire.params_of(get))
                        event = await anext(events, None)  # admission errors surface here, before any event
                    case wire.Command.STATS:
                        send(wire.stats_tensors(self._snapshot()), final=True)
                        return
                    case wire.Command.EVICT_CONVERSATION:
                        conversation = parse_conversation_id(wire.text_of(get, "conversation_id"))
                        owner_salt = wire.bytes_of(get, "cache_salt") or None  # the deleting owner's blocks only
                        send(wire.evicted_tensors(await self.backend.evict_conversation(conversation, owner_salt)),
                             final=True)
                        return
                    case wire.Command.EVICT_SALT:
                        salt = wire.bytes_of(get, "cache_salt")
                        send(wire.evicted_tensors(await self.backend.evict_salt(salt)), final=True)
                        return
                    case wire.Command.RESIDENCY:
                        residency = self.backend.residency(wire.cursor_of(get))
                        send(wire.residency_tensors(self._epoch, residency), final=True)
                        return
                    case _:
                        assert_never(command)
            except CoreError as err:
                send(wire.error_tensors(err), final=True)
                return
            while event is not None:
                match event:
                    case Finished():
                        await _close(events)  # the sequence is released before the stats that ride on Finished
                        send(wire.event_tensors(event, self._snapshot()), final=True)
                        return
                    case Started():
                        snapshot = self._snapshot()
                        after = await anext(events, None)
                        if isinstance(after, Delta):  # the usual case: one response for the first token
                            send(wire.first_tensors(event, after, snapshot))
                            event = await anext(events, None)
                        else:
                            send(wire.event_tensors(event, snapshot))
                            event = after
                    case Delta():
                        send(wire.event_tensors(event))
                        event = await anext(events, None)
                    case _:
                        assert_never(event)
            raise RuntimeError("the engine's event stream ended without a Finished event")
        except asyncio.CancelledError:
            pass  # the client cancelled its stream: closing `events` below aborts the sequence
        except Exception as err:  # noqa: BLE001  (answered as an error response, never lost)
            self.pb.Logger.log_error(f"chatmesh_llm: request failed: {type(err).__name__}")
            if not final_sent:
                send(wire.error_tensors(err), final=True)
        finally:
            if events is not None:
                await _close(events)
            if not final_sent:
                self._outbox.put((key, sender, None, True))

    def _send_loop(self) -> None:
        """Sends responses in order, off the engine loop (each send is an IPC round trip to the server).

        A request leaves `_open` here, under the lock, in the same critical section as its final send: Triton
        frees the request's response factory on that send, and asking a freed request `is_cancelled()`
        crashes tritonserver (a segfault in TRITONBACKEND_ResponseFactoryIsCancelled, seen under 8 concurrent
        streams), so the watcher may only ask requests still in `_open`, and only under the same lock."""
        while (item := self._outbox.get()) is not None:
            key, sender, response, final = item
            if final:
                with self._lock:
                    self._open.pop(key, None)
                    self._send(sender, response, final)
            else:
                self._send(sender, response, final)

    def _send(self, sender: Any, response: Any, final: bool) -> None:
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            if response is None:
                sender.send(flags=flags)
            else:
                sender.send(response, flags=flags)
        except Exception as err:  # noqa: BLE001  (the request was cancelled and released meanwhile)
            self.pb.Logger.log_verbose(f"chatmesh_llm: send failed: {type(err).__name__}")

    def _watch_cancellation(self) -> None:
        while not self._stopping.wait(self._cancel_check_s):
            with self._lock:  # no final send (which frees a request) can happen while we ask
                cancelled = [entry for entry in self._open.values() if self._is_cancelled(entry.request)]
            for entry in cancelled:
                entry.task.cancel()  # a concurrent future: cancelling it cancels the coroutine on the loop

    def _is_cancelled(self, request: Any) -> bool:
        try:
            return bool(request.is_cancelled())
        except Exception:  # noqa: BLE001  (an error asking means the request is gone: stop its work)
            return True
