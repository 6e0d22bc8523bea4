"""Prefix transfer on the `local` backend (issue 29): pulling a prefix's KV from another engine against
prefilling it, at 1k, 4k and 8k tokens, side by side in one run.

Two `local` engines (SmolLM2-135M, int8 KV) on loopback, mutual TLS between them: the SOURCE is a separate
`chatmesh serve engine` process; the PULLER is an engine core in this process. Each round, for each size, in
interleaved order:
- prefill: the puller generates one token after a fresh random prompt of n tokens (nothing cached): the time is
  n tokens of prefill (in the engine's steps of CHATMESH_STEP_TOKEN_BUDGET, 256) and one sampled token;
- pull: the source computes another fresh n-token prompt (not timed), then the puller pulls its full blocks but
  the one holding the last token ((n - 1) // 16 of 16 tokens: what admission would look up; 8,176 of 8,192 at 8k,
  the model's whole context)
  (`Transfers.pull` over GrpcPrefixPeer, exactly what a moved turn does before its prefill, the turn's owner
  token forwarded): wall time from the request to the last block imported, bytes moved, and the CPU both
  processes spent on it (the puller: this process's CPU time during the pull; the source: its /proc counters),
  per pulled block.
Ratios are per round (pull / prefill at the same size, same round), so the machine's load shifts both sides.

    flock /work/coord/bench.lock .venv/bin/python -m bench.prefix_transfer --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from chatmesh.engine_adapter import service as engine_service
from chatmesh.engine_adapter.backend import GenerateParams, PullOutcome, PullSource
from chatmesh.engine_adapter.local.backend import build_local, load_model
from chatmesh.engine_adapter.executor import SamplingParams
from chatmesh.mesh import identity as ident
from chatmesh.mesh import pki, tls, tokens
from chatmesh.mesh.config import Config
from chatmesh.mesh.ids import ConversationId, OwnerId
from chatmesh.mesh.trust import Trust
from chatmesh.model.settings import MODEL_DIR

SECRET = "bench-prefix-transfer"
BS = 16
OWNER = OwnerId("bench-owner")


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _clock_ticks()


def _env(certs: Path) -> dict[str, str]:
    return {"CHATMESH_ENGINE": "local", "CHATMESH_BLOCK_SIZE": str(BS), "CHATMESH_DEVICE_BLOCKS": "4096",
            "CHATMESH_HOST_BLOCKS": "0", "CHATMESH_CACHE_SALT_SECRET": SECRET,
            "CHATMESH_PREFIX_PULL_TIMEOUT_MS": "120000", "CHATMESH_DATA_DIR": str(certs.parent),
            "CHATMESH_MESH_PLAINTEXT": "false", "CHATMESH_ENGINE_METRICS_PORT": "0"}


async def _wait_serving(trust: Trust, address: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    from chatmesh.mesh.channels import open_channel
    from chatmesh.v1 import generate_pb2, generate_pb2_grpc
    import grpc

    channel = open_channel(trust, address, "engine")
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"source engine exited: {log.read_text()[-2000:]}")
            try:
                await generate_pb2_grpc.GenerateServiceStub(channel).GetStats(generate_pb2.GetStatsRequest(),
                                                                             timeout=2)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)
        raise SystemExit("source engine did not start")
    finally:
        await channel.close(None)


async def _generate_on_source(trust: Trust, address: str, prompt: list[int], conversation: str) -> None:
    """The source computes (and caches) a prompt: a turn as chat sends it, with chat's token."""
    from chatmesh.mesh.channels import open_channel
    from chatmesh.v1 import generate_pb2, generate_pb2_grpc

    channel = open_channel(trust, address, "engine")
    try:
        request = generate_pb2.GenerateRequest(
            request_id=str(uuid.uuid4()), conversation_id=conversation, turn_id=str(uuid.uuid4()),
            prompt_token_ids=prompt, owner_id=OWNER, max_tokens=1)
        async for _ in generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=600,
                                                                               metadata=tokens.forwarded()):
            pass
    finally:
        await channel.close(None)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


async def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    certs = work / "certs"
    pki.ensure(certs)
    env = _env(certs)
    port = 50000 + random.randrange(10000)
    address = f"127.0.0.1:{port}"
    log = work / "source.log"
    source = subprocess.Popen([sys.executable, "-m", "chatmesh.mesh.cli", "serve", "engine"],
                              env={**os.environ, **env, "CHATMESH_LISTEN": address, "CHATMESH_REPLICA_ID": "source"},
                              stdout=log.open("wb"), stderr=subprocess.STDOUT)
    engine_trust = Trust.from_files(tls.TlsFiles.in_folder(certs, ident.ENGINE), ident.ENGINE,
                                    certs / pki.TOKEN_PUBLIC_KEYS_FILE)
    chat_trust = Trust.from_files(tls.TlsFiles.in_folder(certs, ident.CHAT), ident.CHAT, None)
    issuer = tokens.Issuer(tokens.watch_keys(pki.private_keys_file(certs)), 900)
    try:
        cfg = Config(env={**env, "CHATMESH_REPLICA_ID": "puller"})
        model = load_model(cfg[MODEL_DIR])
        puller = build_local(cfg, model=model)
        peer = engine_service.GrpcPrefixPeer(engine_trust)  # dials the source as spiffe://chatmesh/engine
        puller.transfers.peer = peer
        await puller.start()
        await _wait_serving(chat_trust, address, source, log)
        salt = engine_service.OwnerSalts(SECRET.encode()).of(OWNER)
        rng = random.Random(args.seed)
        sizes = [int(s) for s in args.sizes.split(",")]
        rows: dict[int, dict[str, list[float]]] = {n: {"prefill": [], "pull": [], "ratio": [], "bytes_per_token": [],
                                                       "puller_cpu_ms_per_block": [],
                                                       "source_cpu_ms_per_block": []} for n in sizes}
        print(f"# load before: {os.getloadavg()}", flush=True)
        for r in range(args.rounds):
            order = sizes if r % 2 == 0 else list(reversed(sizes))
            for n in order:
                tokens.current.set(issuer.mint(OWNER, presenter=ident.CHAT).token)  # what chat forwards on a turn
                # prefill n tokens here (a fresh prompt: nothing cached)
                fresh = _prompt(rng, n)
                t0 = time.perf_counter()
                async for _ in puller.generate(GenerateParams(tuple(fresh), 1, cache_salt=salt, owner_id=OWNER,
                                                              sampling=SamplingParams())):
                    pass
                prefill_s = time.perf_counter() - t0
                # pull n tokens' blocks the source computed
                conversation = str(uuid.uuid4())
                prompt = _prompt(rng, n)
                await _generate_on_source(chat_trust, address, prompt, conversation)
                params = GenerateParams(tuple(prompt), 1, cache_salt=salt, owner_id=OWNER,
                                        conversation_id=ConversationId(conversation),
                                        source=PullSource("source", address))
                cpu0, src0 = time.process_time(), proc_cpu_s(source.pid)
                report = await puller.transfers.pull(params)
                cpu1, src1 = time.process_time(), proc_cpu_s(source.pid)
                if report.outcome is not PullOutcome.PULLED or report.blocks != (n - 1) // BS:
                    raise SystemExit(f"pull of {n} tokens: {report}")
                row = rows[n]
                row["prefill"].append(prefill_s)
                row["pull"].append(report.seconds)
                row["ratio"].append(report.seconds / prefill_s)
                row["bytes_per_token"].append(report.bytes / (report.blocks * BS))
                row["puller_cpu_ms_per_block"].append((cpu1 - cpu0) * 1000 / report.blocks)
                row["source_cpu_ms_per_block"].append((src1 - src0) * 1000 / report.blocks)
                print(f"round {r} n={n}: prefill {prefill_s:.3f} s, pull {report.seconds:.4f} s "
                      f"({report.bytes / 1e6:.1f} MB), ratio {report.seconds / prefill_s:.4f}, CPU/block puller "
                      f"{(cpu1 - cpu0) * 1000 / report.blocks:.2f} ms source {(src1 - src0) * 1000 / report.blocks:.2f} "
                      f"ms", flush=True)
        print(f"# load after: {os.getloadavg()}")
        print("| prefix | prefill (median) | pull (median) | pull / prefill (median of rounds) | bytes per token | "
              "CPU per pulled block: puller | source |")
        print("|---|---|---|---|---|---|---|")
        for n in sizes:
            row = rows[n]
            med = {k: statistics.median(v) for k, v in row.items()}
            print(f"| {n:,} tokens | {med['prefill']:.2f} s | {med['pull'] * 1000:.0f} ms | {med['ratio']:.3f}x "
                  f"(min {min(row['ratio']):.3f}, max {max(row['ratio']):.3f}) | {med['bytes_per_token']:,.0f} B | "
                  f"{med['puller_cpu_ms_per_block']:.2f} ms | {med['source_cpu_ms_per_block']:.2f} ms |")
        await puller.close()
        await peer.close()
    finally:
        source.send_signal(signal.SIGKILL)
        source.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="1024,4096,8192", help="prefix sizes in tokens, comma separated")
    parser.add_argument("--seed", type=int, default=29)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
