"""Hosts for the multi-host test: Linux network namespaces on one bridge, each with its own address and a hosts
file that plays the cluster's DNS.

    hub namespace (`<tag>-hub`)      the bridge `br0` (a switch); every host's cable ends here, as `p<n>`
    host namespace (`<tag>-<host>`)  `eth0` with 10.x.y.<n>/24, loopback; its processes see only this stack
    the root namespace               attached too (`<tag>` = 10.x.y.1), so the test itself is a client host

The bridge lives in a namespace of its own, so the root namespace's firewall (bridge netfilter, a FORWARD policy
left by Docker) never sees the hosts' traffic. Names resolve through `/etc/netns/<ns>/hosts`, which
`ip netns exec` bind-mounts over /etc/hosts (with a resolv.conf pointing at nothing, so an unknown name fails at
once instead of waiting for an outside resolver). A process is started with `ip netns exec NS ...`, which execs
the command in place: the pid the test holds is the service's own, and taking a host away kills exactly those
pids. `unplug`/`plug` set the host's switch port down/up (its cable pulled: no carrier, nothing delivered).

Every name carries the test process's pid (`cmnet<pid>`), so parallel runs never collide; `close` removes the
namespaces, the root-side link and /etc/netns/<ns>, and `sweep` removes what a killed run (a dead pid) left,
its processes included.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

PREFIX = "cmnet"
ETC_NETNS = Path("/etc/netns")
STALE = re.compile(rf"^{PREFIX}(\d+)(-|$)")


def run(*argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or out.returncode}")
    return out


def unusable() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add is refused here: {made.stderr.strip()}"
    try:
        veth = run("ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0", check=False)
        if veth.returncode != 0:
            return f"veth pairs are refused here: {veth.stderr.strip()}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Removes namespaces, root links and /etc/netns folders of earlier runs whose process is gone, ending the
    processes still running in those namespaces first (a run killed outright leaves its services behind, and a
    deleted namespace lives on while a process holds it)."""
    removed = []
    for line in run("ip", "netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if (m := STALE.match(name)) and not _alive(int(m.group(1))):
            for pid in run("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in run("ip", "-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if (m := STALE.match(name)) and not _alive(int(m.group(1))):
            run("ip", "link", "del", name, check=False)
            removed.append(name)
    if ETC_NETNS.is_dir():
        for folder in ETC_NETNS.iterdir():
            if (m := STALE.match(folder.name)) and not _alive(int(m.group(1))):
                shutil.rmtree(folder, ignore_errors=True)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that no address or route of the root namespace overlaps."""
    used = [ipaddress.IPv4Network(word, strict=False)
            for line in run("ip", "-4", "-o", "addr", "show").stdout.splitlines() + run("ip", "-4", "route").stdout
            .splitlines() for word in line.split() if re.fullmatch(r"\d+\.\d+\.\d+\.\d+(/\d+)?", word)]
    pool = list(ipaddress.IPv4Network("10.200.0.0/13").subnets(new_prefix=24))
    random.Random(os.getpid()).shuffle(pool)
    for net in pool:
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free /24 in 10.200.0.0/13")


@dataclass
class Host:
    """One machine: a namespace with one address, the names it answers to, the processes running on it."""

    name: str
    netns: str
    ip: str
    port: str  # its switch port in the hub
    names: tuple[str, ...]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


class Network:
    def __init__(self, tag: str | None = None):
        self.tag = tag or f"{PREFIX}{os.getpid()}"
        self.hub = f"{self.tag}-hub"
        self.hosts: dict[str, Host] = {}
        self.subnet = ipaddress.IPv4Network("0.0.0.0/32")
        self.opened = False

    @property
    def root_ip(self) -> str:
        return str(self.subnet.network_address + 1)

    def open(self) -> None:
        sweep()
        self.opened = True
        self.subnet = _free_subnet()
        run("ip", "netns", "add", self.hub)
        run("ip", "-n", self.hub, "link", "set", "lo", "up")
        run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.hub, "link", "set", "br0", "up")
        # the root namespace's cable: its end here is the only name in the root namespace (hence the tag)
        run("ip", "link", "add", self.tag, "type", "veth", "peer", "name", "p0", "netns", self.hub)
        run("ip", "-n", self.hub, "link", "set", "p0", "master", "br0", "up")
        run("ip", "addr", "add", f"{self.root_ip}/{self.subnet.prefixlen}", "dev", self.tag)
        run("ip", "link", "set", self.tag, "up")

    def add_host(self, name: str, names: Sequence[str] = ()) -> Host:
        n = len(self.hosts) + 2
        ip = str(self.subnet.network_address + n)
        netns, port = f"{self.tag}-{name}", f"p{n}"
        run("ip", "netns", "add", netns)
        run("ip", "-n", netns, "link", "set", "lo", "up")
        run("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        run("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
        run("ip", "-n", netns, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", "eth0")
        run("ip", "-n", netns, "link", "set", "eth0", "up")
        host = Host(name, netns, ip, port, tuple(names))
        self.hosts[name] = host
        return host

    def hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{h.ip} {' '.join(h.names)}" for h in self.hosts.values() if h.names]
        return "\n".join(lines) + "\n"

    def publish_names(self) -> None:
        """Writes every host's /etc/netns/<ns>/hosts: the same table everywhere, like a cluster's DNS."""
        text = self.hosts_file()
        for host in self.hosts.values():
            folder = ETC_NETNS / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(text)
            (folder / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def spawn(self, host: Host, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: IO[bytes]
              ) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *argv], env=dict(env), cwd=cwd,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        host.procs.append(proc)
        return proc

    def exec(self, host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Runs a command on `host` to its end (a Job, a client command)."""
        return subprocess.run(["ip", "netns", "exec", host.netns, *argv], env=None if env is None else dict(env),
                              cwd=cwd, capture_output=True, text=True, timeout=timeout)

    def kill(self, host: Host, sig: signal.Signals = signal.SIGKILL, wait_s: float = 10) -> None:
        """Ends every process started on `host`, by its pid (and its process group: postgres' children)."""
        for proc in host.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        for proc in host.procs:
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        host.procs.clear()

    def unplug(self, host: Host) -> None:
        run("ip", "-n", self.hub, "link", "set", host.port, "down")

    def plug(self, host: Host) -> None:
        run("ip", "-n", self.hub, "link", "set", host.port, "up")

    def close(self) -> None:
        """Stops every process (SIGTERM, then SIGKILL) and removes everything `open` and `add_host` made."""
        if not self.opened:
            return
        for host in self.hosts.values():
            self.kill(host, signal.SIGTERM, wait_s=5)
        for host in self.hosts.values():
            run("ip", "netns", "del", host.netns, check=False)
            shutil.rmtree(ETC_NETNS / host.netns, ignore_errors=True)
        run("ip", "netns", "del", self.hub, check=False)
        run("ip", "link", "del", self.tag, check=False)  # gone with the hub already; this is for a half-made one
        self.opened = False

    def leftovers(self) -> list[str]:
        """What of this network still exists (empty after `close`)."""
        names = [n.split()[0] for n in run("ip", "netns", "list").stdout.splitlines() if n.startswith(self.tag)]
        links = [line for line in run("ip", "-o", "link", "show").stdout.splitlines() if f" {self.tag}" in line]
        folders = [str(p) for p in ETC_NETNS.glob(f"{self.tag}-*")] if ETC_NETNS.is_dir() else []
        return names + links + folders
