"""Hosts on one machine: network namespaces joined by a bridge, with optional one-way link delay (tc netem).

Each host is a namespace with an `eth0` veth whose peer (`p-<host>`) sits on `br0` in a fifth "switch" namespace,
so the root namespace is never touched. The switch itself has an address on the bridge (`router`), where a
user-space relay can listen. Used by the split-host benchmark (specmesh_bench/split.py) and the multi-host
chaos test (tests/chaos/test_multihost.py). Needs root (CAP_NET_ADMIN) and iproute2; `tc` with the kernel's netem
qdisc for delays.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

ROUTER = 254  # the switch namespace's own address on the bridge: <subnet>.254
TAG_PATTERN = r"smh(\d+)x\d+-[\w-]+"  # namespaces are named smh<pid of the creator>x<nonce>-<host>


class MeshUnavailable(Exception):
    """Network namespaces, veths, bridges or netem cannot be made here."""


def run_tool(*argv: str) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MeshUnavailable(f"`{' '.join(argv)}` failed: {e}") from e
    if done.returncode != 0:
        raise MeshUnavailable(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def ip(*args: str) -> str:
    return run_tool("ip", *args)


def tc_path() -> str | None:
    return shutil.which("tc") or next((p for p in ("/usr/sbin/tc", "/sbin/tc") if os.access(p, os.X_OK)), None)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here (None: they can, as far as can be told without building them)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


class Mesh:
    """One namespace per host (`hosts`: name -> last octet of its address in `subnet`.0/24), on one bridge."""

    def __init__(self, hosts: Mapping[str, int], subnet: str, cwd: Path | None = None) -> None:
        self.hosts, self.subnet, self.cwd = dict(hosts), subnet, cwd
        self.tag = f"smh{os.getpid()}x{time.monotonic_ns() % 100000}"
        self.switch = f"{self.tag}-sw"
        self.namespaces: list[str] = []
        self.processes: list[subprocess.Popen] = []

    def ns(self, host: str) -> str:
        return self.switch if host == "router" else f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{ROUTER if host == 'router' else self.hosts[host]}"

    def _add_ns(self, name: str) -> None:
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def build(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise MeshUnavailable(reason)
        self._add_ns(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "addr", "add", f"{self.address('router')}/24", "dev", "br0")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for host, last in self.hosts.items():
            name, port = self.ns(host), f"p-{host}"
            self._add_ns(name)
            ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
            ip("-n", self.switch, "link", "set", port, "master", "br0")
            ip("-n", self.switch, "link", "set", port, "up")
            ip("-n", name, "addr", "add", f"{self.subnet}.{last}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")

    def cut(self, host: str) -> None:
        """Take the host's switch port down: its packets are dropped silently, in both directions."""
        ip("-n", self.switch, "link", "set", f"p-{host}", "down")

    def set_delay(self, host: str, delay_ms: float) -> None:
        """One-way delay on everything the host sends (netem on its eth0's egress); 0 removes it. Delaying every
        host's egress by d gives each host-to-host path d one way, 2d round trip."""
        tc = tc_path()
        if tc is None:
            raise MeshUnavailable("the `tc` command (iproute2) is not installed")
        if delay_ms > 0:
            run_tool("ip", "netns", "exec", self.ns(host), tc, "qdisc", "replace", "dev", "eth0", "root", "netem",
                     "delay", f"{delay_ms}ms")
        else:
            try:
                run_tool("ip", "netns", "exec", self.ns(host), tc, "qdisc", "del", "dev", "eth0", "root")
            except MeshUnavailable:
                pass  # no qdisc was set: nothing to remove

    def netem_unavailable_reason(self) -> str | None:
        """Why `tc netem` cannot delay this mesh's links (None: it can), tried on the first host's link."""
        host = next(iter(self.hosts))
        try:
            self.set_delay(host, 1)
        except MeshUnavailable as e:
            return f"tc netem does not work here ({e}); the kernel needs sch_netem (`modprobe sch_netem`)"
        self.set_delay(host, 0)
        return None

    def popen(self, host: str, argv: list[str], log_path: str, cpus: set[int] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start argv inside the host's namespace (stderr to log_path), pinned to `cpus` when given."""
        log = open(log_path, "ab")
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None  # inherited through `ip netns exec`'s exec
        try:
            process = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], cwd=self.cwd, stderr=log,
                                       preexec_fn=pin, **kwargs)
        finally:
            log.close()  # the child holds its own copy
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self.namespaces):
            # Anything still inside was started here (ip netns exec execs in place): end it by pid.
            try:
                pids = [int(p) for p in ip("netns", "pids", name).split()]
            except MeshUnavailable:
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                ip("netns", "del", name)  # deleting a namespace deletes its veth ends and so their peers
            except MeshUnavailable as e:
                print(f"warning: could not delete namespace {name}: {e}", file=sys.stderr)
        self.namespaces.clear()

    def __enter__(self) -> "Mesh":
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def remove_stale_namespaces() -> None:
    """Namespaces of an earlier mesh whose creator died without closing it (SIGKILL): removed when that process is
    gone and nothing runs inside them any more."""
    try:
        names = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
    except MeshUnavailable:
        return
    for name in names:
        match = re.fullmatch(TAG_PATTERN, name)
        if not match or Path(f"/proc/{match.group(1)}").exists():
            continue
        try:
            if not ip("netns", "pids", name).split():
                ip("netns", "del", name)
        except MeshUnavailable:
            pass
