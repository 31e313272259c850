"""A Ray cluster of several nodes on one machine, for trying the Ray deployment and for its smoke test.

Each node is a real `ray start --block` (the head with `--head`, the others with `--address`), with its own raylet,
CPU count and custom resources, so that Ray places replicas on different raylets as on separate hosts. Every node
gets its own loopback address (127.0.0.2, 127.0.0.3, ...: Ray rewrites 127.0.0.1 to the machine's network address,
and a node's IP must name it) and its own ports, so nothing listens on a network address Ray chose itself and no
traffic leaves the machine. `kill_node` is a machine's loss: SIGKILL to the node's raylet, its workers and agents.
Stopping ends every process of every node: SIGTERM to each `ray start --block` (which stops its node), then SIGKILL
to anything left of the processes it started.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

OBJECT_STORE_BYTES = 200 * 1024 * 1024  # per node; Ray's default is 30% of the machine's memory per node
WORKER_PORTS_PER_NODE = 200
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class NodeSpec:
    name: str
    num_cpus: float
    resources: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.num_cpus >= 0:
            raise ValueError(f"{self.name}: num_cpus must be >= 0, got {self.num_cpus}")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PortBlock:
    """Ports for the cluster's processes, handed out in order from a random block below the kernel's ephemeral
    range (where other processes' port-0 sockets would take them between now and the node's start), each free on
    every address (Ray's servers bind the wildcard address)."""

    LOW, HIGH = 10000, 30000

    def __init__(self, size: int) -> None:
        self._next = random.randrange(self.LOW, self.HIGH - 4 * size)
        self._limit = self._next + 4 * size

    def take(self, count: int = 1) -> int:
        """The first of `count` consecutive free ports."""
        while self._next + count <= self._limit:
            first, self._next = self._next, self._next + count
            if all(self._free(port) for port in range(first, first + count)):
                return first
        raise RuntimeError("no free ports left in the cluster's block")

    @staticmethod
    def _free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
        return True


def children_of() -> dict[int, list[int]]:
    """Every process's children, from /proc (parent pid -> child pids)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    tree, found, todo = children_of(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot): with the pid, names one process even after pids are
    reused."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def snapshot(pids: list[int]) -> set[tuple[int, int]]:
    return {(pid, started) for pid in pids if (started := start_time(pid)) is not None}


def kill_all(processes: set[tuple[int, int]]) -> None:
    """SIGKILL each (pid, start time) that is still that process."""
    for pid, started in sorted(processes):
        if start_time(pid) != started:
            continue  # gone, and the pid perhaps someone else's now
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class LocalNode:
    def __init__(self, spec: NodeSpec, ip: str, process: subprocess.Popen, log_path: Path) -> None:
        self.spec, self.ip, self.process, self.log_path = spec, ip, process, log_path
        self.killed_at: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def pids(self) -> list[int]:
        """The node's processes: `ray start` and all it started (raylet, workers, agents, ...)."""
        return [self.process.pid, *descendants(self.process.pid)]

    def raylet_pid(self) -> int | None:
        return next((pid for pid in descendants(self.process.pid) if process_name(pid) == "raylet"), None)

    def kill(self) -> list[int]:
        """SIGKILL the whole node at once (raylet first, then its workers and the rest): a lost machine."""
        raylet = self.raylet_pid()
        pids = self.pids()
        self.killed_at = time.monotonic()
        if raylet is not None:
            kill_all(snapshot([raylet]))
        kill_all(snapshot(pids))
        self.process.wait()
        return pids


class LocalRayCluster:
    """A head and worker nodes on loopback addresses. A context manager: every process is gone after it."""

    def __init__(self, nodes: list[NodeSpec], temp_dir: str | None = None, env: Mapping[str, str] | None = None,
                 first_ip: int = 2) -> None:
        if not nodes:
            raise ValueError("a cluster needs a head node")
        self.specs = nodes
        self._own_temp = temp_dir is None
        self.temp_dir = temp_dir or tempfile.mkdtemp(prefix="specmesh-ray-")
        self.env = dict(os.environ if env is None else env, RAY_USAGE_STATS_ENABLED="0")
        self.ips = [f"127.0.0.{first_ip + i}" for i in range(len(nodes))]
        self.ports = PortBlock(len(nodes) * (WORKER_PORTS_PER_NODE + 8) + 1)
        self.gcs_port = self.ports.take()
        self.address = f"{self.ips[0]}:{self.gcs_port}"
        self.nodes: list[LocalNode] = []

    def _command(self, index: int, spec: NodeSpec) -> list[str]:
        import json
        ip, port = self.ips[index], self.ports.take
        low = port(WORKER_PORTS_PER_NODE)
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--node-ip-address", ip,
                   "--num-cpus", str(spec.num_cpus), "--resources", json.dumps(dict(spec.resources)),
                   "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats",
                   "--node-manager-port", str(port()), "--object-manager-port", str(port()),
                   "--runtime-env-agent-port", str(port()), "--metrics-export-port", str(port()),
                   "--dashboard-agent-grpc-port", str(port()), "--dashboard-agent-listen-port", str(port()),
                   "--min-worker-port", str(low), "--max-worker-port", str(low + WORKER_PORTS_PER_NODE - 1)]
        if index == 0:
            command += ["--head", "--port", str(self.gcs_port), "--include-dashboard", "false",
                        "--ray-client-server-port", str(port()), "--temp-dir", self.temp_dir]
        else:
            command += ["--address", self.address]
        return command

    def _start_node(self, index: int) -> LocalNode:
        spec = self.specs[index]
        log_path = Path(self.temp_dir) / f"node-{spec.name}.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(self._command(index, spec), stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=self.env, process_group=0)
        node = LocalNode(spec, self.ips[index], process, log_path)
        self.nodes.append(node)
        return node

    def _wait_started(self, node: LocalNode, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node.process.poll() is not None:
                raise RuntimeError(f"ray node {node.name} exited ({node.process.returncode}):\n{self.log_tail(node)}")
            if "--block" in node.log_path.read_text(errors="replace"):  # printed once the node is up
                return
            time.sleep(0.2)
        raise RuntimeError(f"ray node {node.name} did not start in {timeout_s:.0f} s:\n{self.log_tail(node)}")

    @staticmethod
    def log_tail(node: LocalNode, lines: int = 20) -> str:
        return "\n".join(node.log_path.read_text(errors="replace").splitlines()[-lines:])

    def start(self) -> LocalRayCluster:
        # One node at a time: on a small, busy machine nodes started together time out registering with the GCS.
        for index in range(len(self.specs)):
            for attempt in (1, 2):
                node = self._start_node(index)
                try:
                    self._wait_started(node, START_TIMEOUT_S)
                    break
                except RuntimeError:
                    self.nodes.remove(node)
                    kill_all(snapshot(node.pids()))
                    if index == 0 or attempt == 2:
                        raise
        return self

    def node(self, name: str) -> LocalNode:
        return next(n for n in self.nodes if n.name == name)

    def node_by_ip(self, ip: str) -> LocalNode | None:
        return next((n for n in self.nodes if n.ip == ip), None)

    def stop(self) -> None:
        """Every node stopped (workers first), then whatever any of them left behind killed."""
        left = snapshot([pid for node in self.nodes for pid in node.pids()])
        for node in reversed(self.nodes):
            if node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for node in self.nodes:
            try:
                node.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        left |= snapshot([pid for node in self.nodes for pid in node.pids()])
        kill_all(left)
        for node in self.nodes:
            if node.process.poll() is None:
                node.process.wait()
        if self._own_temp:
            import shutil
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
