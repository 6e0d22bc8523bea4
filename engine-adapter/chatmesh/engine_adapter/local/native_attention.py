"""The native decode-attention kernel (decode_attention.cpp): built once per machine, loaded into torch.ops.

What: decode attention reads each sequence's K/V blocks in place, walking its block table, and widens them
(int8 with their scales, bfloat16, float16; float32 as is) to fp32 in registers, one (sequence, KV head) per task
on torch's thread pool. The PyTorch path (model.py) gathers every decoding sequence's blocks and widens them to
fp32 in memory (4x the bytes for int8) before small matmuls; at batch 16 over ~3,000 tokens of context that was
more than half of a decode step.

Build: `./dev setup` runs this module (else the first `load()` on a machine does): it compiles the source with
the system C++ compiler ($CXX, else g++) against the installed torch's headers and libraries (7-15 s on two
cores; `-march=native`, so the library is keyed by the CPU's feature flags too) into CHATMESH_LOCAL_KERNEL_DIR
(default ~/.cache/chatmesh/kernels), under a name hashing the source, the flags, the compiler and torch versions;
later loads reuse it. Concurrent first loads (a mesh starting several replicas) take a file lock, so one compiles
and the others wait and load its result. No ninja or setuptools is involved. When no compiler is found or
compilation fails, `load()` logs a warning and returns None, and decode attention stays on the PyTorch path (same
results, slower).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from chatmesh.engine_adapter.local import settings as local_settings
from chatmesh.mesh import logs
from chatmesh.mesh.config import Config

log = logs.get("chatmesh.engine.local")

SOURCE = Path(__file__).with_name("decode_attention.cpp")
HEAD_DIM = 64  # the head dimension the kernel is written for
MAX_GROUP = 4  # query heads per KV head it accepts
COMPILE_TIMEOUT_S = 300


class DecodeKernel:
    """torch.ops.chatmesh_local.decode, typed: decode attention over one layer of a KVPool, in place."""

    def __init__(self, path: Path):
        self.path = path

    @staticmethod
    def supports(kv_heads: int, group: int, head_dim: int) -> bool:
        return head_dim == HEAD_DIM and 1 <= group <= MAX_GROUP and kv_heads >= 1

    def __call__(self, q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None, v: torch.Tensor,
                 v_scale: torch.Tensor | None, tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                 scale: float) -> torch.Tensor:
        """q [B, kv, g, 64] fp32; k, v [kv, slots, 64] (one layer of a KVPool: int8, bfloat16, float16 or
        float32), with k_scale, v_scale [kv, slots] fp32 for int8 (else None); tables [B, width] int32 block ids;
        lens [B] int32 context lengths. Returns [B, kv, g, 64]."""
        out: torch.Tensor = torch.ops.chatmesh_local.decode(q, k, k_scale, v, v_scale, tables, lens,
                                                            block_size, scale)
        return out


def load(cache_dir: str | Path | None = None) -> DecodeKernel | None:
    """The kernel, compiled into `cache_dir` (default: the CHATMESH_LOCAL_KERNEL_DIR setting) if not there yet;
    None (with a warning logged) when it cannot be built."""
    folder = Path(cache_dir) if cache_dir is not None else Path(Config()[local_settings.KERNEL_DIR])
    return _load(folder.resolve(), os.environ.get("CXX", "g++"))


_LOADED: dict[str, DecodeKernel] = {}  # by build key: a process registers the op once, whichever folder it came from


@functools.cache
def _load(folder: Path, compiler: str) -> DecodeKernel | None:
    try:
        cxx = shutil.which(compiler)
        if cxx is None:
            raise _BuildError(f"no C++ compiler {compiler!r} on PATH")
        key = _build_key(cxx)
        if key in _LOADED:
            return _LOADED[key]
        path = _build(folder, cxx, key)
        torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    except (OSError, subprocess.SubprocessError, RuntimeError, _BuildError) as err:
        log.warning("native decode attention unavailable; decode attention runs on the slower PyTorch path",
                    reason=str(err)[-2000:], compiler=compiler)
        return None
    kernel = _LOADED[key] = DecodeKernel(path)
    return kernel


class _BuildError(Exception):
    pass


def _flags(torch_dir: Path) -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib = torch_dir / "lib"
    return ["-O3", "-march=native", "-fopenmp", "-std=c++20", "-fPIC", "-shared", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}",
            f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build_key(cxx: str) -> str:
    """What the library depends on: source, flags, compiler (path and version), torch, CPU."""
    torch_dir = Path(torch.__file__).parent
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    return hashlib.sha256("\0".join([SOURCE.read_text(), torch.__version__, str(torch_dir), cxx, version,
                                     *_flags(torch_dir), platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]


def _build(folder: Path, cxx: str, key: str) -> Path:
    flags = _flags(Path(torch.__file__).parent)
    target = folder / f"decode_attention-{key}.so"
    if target.is_file():
        log.info("native decode attention: cached build", path=str(target))
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling the same key
        if target.is_file():
            return target
        log.info("native decode attention: compiling once for this machine", compiler=cxx, path=str(target))
        t0 = time.perf_counter()
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            done = subprocess.run([cxx, str(SOURCE), "-o", tmp, *flags], capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_S)
            if done.returncode != 0:
                raise _BuildError(f"{cxx} exited {done.returncode}: {done.stderr.strip()}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("native decode attention: compiled", seconds=round(time.perf_counter() - t0, 1))
    return target


if __name__ == "__main__":  # `./dev setup` builds the kernel here, so the first `chatmesh up` need not
    logs.configure("setup", json=False)
    load()
