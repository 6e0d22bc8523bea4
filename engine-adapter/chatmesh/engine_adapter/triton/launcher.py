"""Starts a real Triton Inference Server on this machine, for tests and for `chatmesh up` with CHATMESH_ENGINE=triton.

Where the server comes from: the PyPI package `nvidia-pytriton` ships the tritonserver binary (2.51), the
Python backend (`libtriton_python.so`, `triton_python_backend_utils.py`) and a backend stub per Python version.
Triton looks for a backend in `<backend-directory>/<name>/`, so the launcher assembles one in its work folder:
`backends/python/` holding the library, the utils module and the stub for the running Python (the stub must sit
beside the library, and Triton chmods it, so it is copied rather than linked).

Environment the stub needs (each one a measured failure without it):
- LD_LIBRARY_PATH: the package's `nvidia_pytriton.libs` (the server's own shared libraries), and the running
  Python's LIBDIR: a pyenv Python's stub otherwise loads a mismatched libpython and fails with `_recursion_count`;
- PATH: this environment's `bin` first, so the stub's embedded interpreter resolves the virtual environment and
  its site-packages (numpy, chatmesh) when it imports a model.py.

Ports are ephemeral (picked free, then bound by tritonserver; a lost race is retried). Readiness is the server's
own gRPC `ServerReady` + `ModelReady`. `stop()` sends SIGTERM, waits, then kills the whole process group (the
server and its stubs): no tritonserver outlives the launcher, and on Linux the server also gets SIGTERM when
the launching process dies without stopping it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from chatmesh.engine_adapter.triton.tls import TritonTls
from chatmesh.mesh import logs

log = logs.get("chatmesh.triton.launcher")

_PY = f"{sys.version_info.major}.{sys.version_info.minor}"


class TritonMissing(RuntimeError):
    """No tritonserver can be started here; the message says why (tests skip with it)."""


class TritonStartFailed(RuntimeError):
    """tritonserver started but did not become ready; the message carries the tail of its log."""


@dataclass(frozen=True)
class TritonInstall:
    """The pieces of a tritonserver installation the launcher assembles."""

    server_bin: Path
    python_backend: Path  # folder holding libtriton_python.so and triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub for this Python version
    libs: Path  # the package's bundled shared libraries

    @classmethod
    def find(cls) -> TritonInstall:
        """The tritonserver inside nvidia-pytriton, or TritonMissing naming what is absent."""
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise TritonMissing("nvidia-pytriton is not installed (pip install 'chatmesh[triton]')")
        root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
        install = cls(
            server_bin=root / "bin" / "tritonserver",
            python_backend=root / "backends" / "python",
            stub=root / "python_backend_stubs" / _PY / "triton_python_backend_stub",
            libs=root.parent.parent / "nvidia_pytriton.libs",
        )
        for path in (install.server_bin, install.python_backend / "libtriton_python.so", install.stub, install.libs):
            if not path.exists():
                raise TritonMissing(f"{path} is missing from the nvidia-pytriton install")
        return install

    def prepare_backends(self, dest: Path) -> Path:
        """Assembles `dest/python/` (library, utils, stub); returns `dest`, the --backend-directory."""
        folder = dest / "python"
        folder.mkdir(parents=True, exist_ok=True)
        for src in (self.python_backend / "libtriton_python.so",
                    self.python_backend / "triton_python_backend_utils.py", self.stub):
            target = folder / src.name
            if not target.exists() or target.stat().st_size != src.stat().st_size:
                shutil.copy2(src, target)
        (folder / self.stub.name).chmod(0o755)
        return dest

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The child environment: bundled libs and the Python LIBDIR on LD_LIBRARY_PATH, the venv's bin on PATH."""
        env = dict(os.environ if base is None else base)
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        lib_paths = [str(self.libs), libdir, env.get("LD_LIBRARY_PATH", "")]
        env["LD_LIBRARY_PATH"] = ":".join(p for p in lib_paths if p)
        env["PATH"] = ":".join(p for p in (str(Path(sys.prefix) / "bin"), env.get("PATH", "")) if p)
        env.pop("PYTHONHOME", None)
        return env


def _die_with_parent() -> None:
    """In the child before exec: Linux sends it SIGTERM when the launching process dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class TritonPorts:
    grpc: int
    http: int
    metrics: int

    @classmethod
    def pick(cls) -> TritonPorts:
        picked: set[int] = set()
        while len(picked) < 3:
            picked.add(_free_port())
        grpc, http, metrics = sorted(picked)
        return cls(grpc, http, metrics)


class TritonServer:
    """One tritonserver process serving a model repository on loopback.

    Use as a context manager, or call `start()` / `stop()`. `address` is the gRPC `host:port` for tritonclient.
    """

    def __init__(self, repository: Path, *, models: Sequence[str] = (), work_dir: Path | None = None,
                 ready_timeout_s: float = 60.0, log_verbose: int = 0, install: TritonInstall | None = None,
                 tls: TritonTls | None = None):
        self.repository = repository
        self.tls = tls  # mutual TLS on the gRPC endpoint (tls.py); None: plaintext on loopback
        self.models = tuple(models)
        self.ready_timeout_s = ready_timeout_s
        self.log_verbose = log_verbose
        self._install = install
        self._own_work_dir = work_dir is None
        self.work_dir = work_dir if work_dir is not None else Path(tempfile.mkdtemp(prefix="chatmesh-triton-"))
        self.ports: TritonPorts | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        if self.ports is None:
            raise RuntimeError("tritonserver is not started")
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "tritonserver.log"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, attempts: int = 3) -> TritonServer:
        """Starts the server and blocks until it and its models are ready."""
        for attempt in range(1, attempts + 1):
            self._spawn_new()
            if self._ready_or_retry(attempt, attempts):
                return self
        raise AssertionError("unreachable")

    async def start_async(self, attempts: int = 3) -> TritonServer:
        """`start` for an event loop: the process is spawned from the loop's thread (the parent-death signal
        follows the spawning thread, and a worker thread may exit before the process does); the wait runs in a
        worker thread."""
        for attempt in range(1, attempts + 1):
            self._spawn_new()
            if await asyncio.to_thread(self._ready_or_retry, attempt, attempts):
                return self
        raise AssertionError("unreachable")

    def _spawn_new(self) -> None:
        install = self._install or TritonInstall.find()
        backends = install.prepare_backends(self.work_dir / "backends")
        self.ports = TritonPorts.pick()
        self._spawn(install, backends, install.environment())

    def _ready_or_retry(self, attempt: int, attempts: int) -> bool:
        try:
            self._wait_ready()
        except TritonStartFailed as err:
            self._terminate()
            if "already in use" not in str(err) or attempt == attempts:
                raise
            return False
        log.info("triton_ready", address=self.address, pid=self.pid, attempt=attempt)
        return True

    def _spawn(self, install: TritonInstall, backends: Path, env: dict[str, str]) -> None:
        assert self.ports is not None
        args = [
            str(install.server_bin),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.ports.grpc}",
            f"--http-port={self.ports.http}",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={self.ports.metrics}",
            "--allow-http=false",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            "--exit-timeout-secs=5",
            f"--log-verbose={self.log_verbose}",
            # each server's shared-memory regions get their own prefix, so concurrent servers never collide
            f"--backend-config=python,shm-region-prefix-name=chatmesh{os.getpid()}p{self.ports.grpc}",
        ]
        if self.tls is not None:
            args.extend(self.tls.server_args())
        if self.models:
            args.append("--model-control-mode=explicit")
            args.extend(f"--load-model={name}" for name in self.models)
        with open(self.log_path, "ab") as out:
            self._proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_die_with_parent)

    def _wait_ready(self) -> None:
        import tritonclient.grpc as grpcclient

        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        client = grpcclient.InferenceServerClient(self.address, **self.client_kwargs())
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise TritonStartFailed(f"tritonserver exited with {self._proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.is_server_ready() and all(client.is_model_ready(m) for m in self.models):
                        return
                except Exception:  # noqa: BLE001  (not listening yet: any client error means "poll again")
                    pass
                time.sleep(0.05)
        finally:
            client.close()
        raise TritonStartFailed(f"tritonserver not ready after {self.ready_timeout_s} s:\n{self.log_tail()}")

    def client_kwargs(self) -> dict[str, Any]:
        """What a tritonclient InferenceServerClient needs to reach this server (its TLS, when it has one)."""
        return self.tls.client_kwargs() if self.tls is not None else {}

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _terminate(self, grace_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("triton_kill", pid=proc.pid)
        # the stubs are children of the server, in its process group: none may outlive it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def stop(self) -> None:
        """Stops the server and its stubs; removes the work folder when the launcher made it."""
        self._terminate()
        if self._own_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

