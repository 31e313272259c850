"""deploy/: Dockerfiles, docker-compose and Kubernetes manifests, validated offline (no Docker engine, no cluster, no
network).

* Every Kubernetes object is validated against the Kubernetes OpenAPI schemas shipped by `kubernetes-validate`
  (strict: unknown fields are errors), for the oldest Kubernetes version we support and the newest the package ships.
* Every command line (compose `command`, Dockerfile ENTRYPOINT + CMD, Kubernetes container args) goes through the real
  CLI: each flag must appear in `<module> <subcommand> --help`, and the whole line must parse with the real argument
  parser. Both run in-process through the same `main(argv)` that `python -m <module>` calls (a subprocess would spend
  ~15 s importing torch per command; this test process has it imported already).
* Cross-references: Service selectors and target ports, probe ports, the coordinator's DNS targets, HPA target,
  volumes, the token Secret, the models pulled vs. served, the torch pin vs. pyproject.toml.
* The compose healthchecks run for real against a live tiny worker (SERVING -> 0, NOT_SERVING -> 1, down -> 1).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from specmesh.runtime import catalog
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
from tests.helpers import check_command, cli_help, help_flags, help_subcommands

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
MANIFESTS = K8S / "manifests"
SECRET_EXAMPLE = K8S / "secret-token.example.yaml"
COMPOSE_FILES = [DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.gpu.yml"]
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda"]
WHEELS = DEPLOY / "wheels"  # optional local wheels for the CPU image, git-ignored but for its README

NAMESPACE = "specmesh"
# Oldest Kubernetes we support (native gRPC probes are GA since 1.27, autoscaling/v2 since 1.23) and the newest
# schema set kubernetes-validate ships (catches APIs removed since).
OLDEST_K8S = "1.30"
NON_ROOT_UID = 10001
WORKER_PORTS = {"drafter": 50051, "verifier": 50052}
SUFFIX_DRAFTER_PORT = 50053


# ---------------------------------------------------------------------------------------------------------- loading

def load_yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@functools.cache
def k8s_objects() -> tuple[tuple[str, dict], ...]:
    """(file name, object) for every object in manifests/ (what kustomization.yaml applies)."""
    return tuple((path.name, doc) for path in sorted(MANIFESTS.glob("*.yaml")) for doc in load_yaml_docs(path))


def k8s_object(kind: str, name: str) -> dict:
    hits = [o for _, o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected exactly one {kind}/{name} in {MANIFESTS}, found {len(hits)}"
    return hits[0]


def deployments() -> list[dict]:
    return [o for _, o in k8s_objects() if o["kind"] == "Deployment"]


def pod_containers(deployment: dict) -> list[dict]:
    spec = deployment["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def main_container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{deployment['metadata']['name']}: expected one container"
    return containers[0]


@functools.cache
def compose(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined, comments dropped, ARG defaults substituted."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, f"{path.name}: dangling line continuation"
    args: dict[str, str] = {}
    out = []
    for line in lines:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip()
        rest = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest)
        out.append((instruction, rest.strip()))
    return out


def dockerfile_exec_form(path: Path, instruction: str) -> list[str]:
    values = [rest for ins, rest in parse_dockerfile(path) if ins == instruction]
    assert values, f"{path.name} has no {instruction}"
    value = json.loads(values[-1])  # exec form: a JSON array, so signals reach python directly
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{path.name}: {instruction} exec form"
    return value


# ------------------------------------------------------------------------------------------------- the real CLIs
# check_command and the --help readers are shared with README.md's commands: tests/helpers.py.

def all_command_lines() -> list[tuple[str, list[str]]]:
    """(where, python -m argv) for every command line in deploy/."""
    lines = []
    for path in DOCKERFILES:
        lines.append((f"{path.name} CMD", dockerfile_exec_form(path, "CMD")))
    for path in COMPOSE_FILES:
        for name, service in compose(path)["services"].items():
            if "command" in service:
                lines.append((f"{path.name} service {name}", service["command"]))
    for file, obj in k8s_objects():
        if obj["kind"] == "Deployment":
            for c in pod_containers(obj):
                lines.append((f"{file} {obj['metadata']['name']}/{c['name']}", c["args"]))
    return lines


COMMAND_LINES = all_command_lines()


@pytest.mark.timeout(120)  # a parse that no longer stops (see check_command) would start a server: fail, not hang
@pytest.mark.parametrize("where,argv", COMMAND_LINES, ids=[w for w, _ in COMMAND_LINES])
def test_command_lines_use_real_cli_flags(where, argv, monkeypatch):
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), \
        f"{where}: use the exec form, a list of strings (ports quoted in YAML): {argv!r}"
    args = check_command(argv, where, monkeypatch)
    if getattr(args, "command", None) == "serve" and argv[0] in WORKER_PORTS:
        assert args.model in catalog.CATALOG, f"{where}: --model {args.model!r} is not a catalog model"
        assert args.host == "0.0.0.0", f"{where}: a containerised worker must bind 0.0.0.0, not {args.host}"
        port = SUFFIX_DRAFTER_PORT if getattr(args, "method", None) == "suffix" else WORKER_PORTS[argv[0]]
        assert args.port == port, f"{where}: {argv[0]} port {args.port}"
    if getattr(args, "models_command", None) == "pull":
        assert set(args.name) <= set(catalog.CATALOG), f"{where}: unknown models {args.name}"


def test_cli_help_is_available_for_every_role():
    for module in ("verifier", "drafter"):
        text = cli_help(module, ("serve",))
        assert text is not None and "--model" in help_flags(text) and "--token-file" in help_flags(text)
    assert "pull" in help_subcommands(cli_help("coordinator", ("models",)))


# ------------------------------------------------------------------------------------------------------ Dockerfiles

def test_dockerfiles():
    torch_pin = next(d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                     if d.replace(" ", "").startswith("torch=="))
    for path in DOCKERFILES:
        instructions = parse_dockerfile(path)
        text = " ".join(f"{i} {r}" for i, r in instructions)
        froms = [r.split()[0] for i, r in instructions if i == "FROM"]
        if path.name == "Dockerfile":
            assert froms and all(f.startswith("python:3.11-slim") for f in froms), f"{path.name}: FROM {froms}"
            assert "--index-url https://download.pytorch.org/whl/cpu" in text, f"{path.name}: CPU torch index"
        else:
            assert froms and all(f.startswith("nvidia/cuda:") for f in froms), f"{path.name}: FROM {froms}"
        # The same torch as pyproject.toml, installed before the project so pip keeps that build.
        assert re.search(rf'pip install "?{re.escape(torch_pin)}"?\s', text), \
            f"{path.name}: does not install {torch_pin} (pyproject.toml's pin)"
        assert text.index(torch_pin) < text.index("pip install ."), f"{path.name}: torch must come before the project"
        users = [r for i, r in instructions if i == "USER"]
        assert users and users[-1].split(":")[0] == str(NON_ROOT_UID), f"{path.name}: must end as USER {NON_ROOT_UID}"
        assert dockerfile_exec_form(path, "ENTRYPOINT") == ["python", "-m"], path.name
        envs = " ".join(r for i, r in instructions if i == "ENV")
        assert "SPECMESH_CACHE_DIR=/cache" in envs, f"{path.name}: model cache must be /cache"
        # COPY sources exist in the build context (the repository root) and survive the .dockerignore.
        ignore = (DEPLOY / f"{path.name}.dockerignore").read_text().split()
        for ins, rest in instructions:
            if ins == "COPY" and not rest.startswith("--from"):
                for src in rest.split()[:-1]:
                    assert (REPO / src).exists(), f"{path.name}: COPY {src}: not in the repository"
                    assert f"!{src}" in ignore or f"!{src}/" in ignore, f"{path.name}.dockerignore excludes {src}"


# --------------------------------------------------------------------------------------------------- docker compose

def test_compose_fleet():
    spec = compose(DEPLOY / "docker-compose.yml")
    services = spec["services"]
    roles = {name: s["command"][0] for name, s in services.items()}
    subcommands = {name: s["command"][1] for name, s in services.items()}
    suffix = [n for n in services if roles[n] == "drafter" and "suffix" in services[n]["command"]]
    drafters = [n for n in services if roles[n] == "drafter" and n not in suffix]
    verifiers = [n for n in services if roles[n] == "verifier"]
    coordinators = [n for n in services if roles[n] == "coordinator" and subcommands[n] == "serve"]
    assert len(drafters) == 1 and len(suffix) == 1 and len(verifiers) == 2 and len(coordinators) == 1, roles
    # The suffix drafter reads the target's tokenizer: the verifiers' model.
    model = services[verifiers[0]]["command"][services[verifiers[0]]["command"].index("--model") + 1]
    assert services[suffix[0]]["command"][services[suffix[0]]["command"].index("--model") + 1] == model

    for name, service in services.items():
        assert "model-cache:/cache" in service["volumes"], f"{name}: shared model cache volume at /cache"
        token = service["environment"]["SPECMESH_TOKEN"]
        assert token.startswith("${SPECMESH_TOKEN"), f"{name}: the token must come from the environment, not the file"
        for dep, cond in service.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
    assert "model-cache" in spec["volumes"]

    # One-shot pull of every model the workers serve, awaited by the workers.
    pulls = [s for s in services.values() if s["command"][:3] == ["coordinator", "models", "pull"]]
    assert len(pulls) == 1
    pulled = set(pulls[0]["command"][3:])
    for name in drafters + suffix + verifiers:
        command = services[name]["command"]
        assert command[command.index("--model") + 1] in pulled, f"{name}: model not pulled by the models service"
        assert services[name]["depends_on"]["models"]["condition"] == "service_completed_successfully"
        port = command[command.index("--port") + 1]
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"] and f"127.0.0.1:{port}'" in test[3], \
            f"{name}: healthcheck must probe its own port {port}"

    coordinator = services[coordinators[0]]
    command = coordinator["command"]
    assert "127.0.0.1:8000:8000" in coordinator["ports"]
    assert command[command.index("--port") + 1] == "8000"
    targets = {(flag, command[i + 1]) for i, flag in enumerate(command)
               if flag in ("--verifier", "--drafter", "--suffix-drafter")}
    expected = {("--verifier", f"{n}:50052") for n in verifiers} | {("--drafter", f"{n}:50051") for n in drafters} \
        | {("--suffix-drafter", f"{n}:50053") for n in suffix}
    assert targets == expected, "the coordinator must reach every worker service on its port"
    for name in drafters + suffix + verifiers:
        assert coordinator["depends_on"][name]["condition"] == "service_healthy"
    compile(coordinator["healthcheck"]["test"][3], "coordinator healthcheck", "exec")


def test_compose_gpu_override():
    base = compose(DEPLOY / "docker-compose.yml")["services"]
    override = compose(DEPLOY / "docker-compose.gpu.yml")["services"]
    assert set(override) <= set(base)
    for name, service in override.items():
        assert service["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
        command = service["command"]
        assert command[command.index("--device") + 1] == "cuda"
        # Same role, model and port as the service it overrides: only the device differs.
        assert [a for a in command if a != "cuda"] == [a for a in base[name]["command"] if a != "cpu"]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def worker_healthchecks() -> dict[str, str]:
    services = compose(DEPLOY / "docker-compose.yml")["services"]
    return {name: s["healthcheck"]["test"][3] for name, s in services.items()
            if s["command"][0] in WORKER_PORTS}


def run_healthcheck(code: str, port: int) -> subprocess.CompletedProcess:
    code = re.sub(r"127\.0\.0\.1:(\d+|PORT)", f"127.0.0.1:{port}", code)
    # `python` in the image is the venv's; here the same venv's interpreter.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_compose_worker_healthchecks_against_a_live_worker(tiny_target):
    from grpc_health.v1 import health_pb2
    from verifier.service import run_server

    checks = set(re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", c) for c in worker_healthchecks().values())
    assert len(checks) == 1, "drafter and verifier healthchecks should differ only in the port"
    code = checks.pop()
    with run_server(tiny_target, port=0) as server:
        ok = run_healthcheck(code, server.port)
        assert ok.returncode == 0, f"healthcheck failed against a SERVING worker: {ok.stderr}"
        server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # as while loading or draining
        try:
            loading = run_healthcheck(code, server.port)
        finally:
            server.health.set("", health_pb2.HealthCheckResponse.SERVING)
        assert loading.returncode != 0, "healthcheck passed a NOT_SERVING worker"
        port = server.port
    down = run_healthcheck(code, port)
    assert down.returncode != 0, "healthcheck passed with no worker listening"


# ------------------------------------------------------------------------------------------------------- Kubernetes

def kubernetes_versions() -> list[str]:
    kv = pytest.importorskip("kubernetes_validate.utils",
                             reason="kubernetes-validate (a [test] extra) is not installed")
    newest = kv.major_minor(kv.latest_version())
    shipped = {kv.major_minor(v) for v in kv.all_versions()}
    assert OLDEST_K8S in shipped, f"kubernetes-validate no longer ships {OLDEST_K8S} schemas: {sorted(shipped)}"
    return sorted({OLDEST_K8S, newest})


def test_kubernetes_manifests_validate_against_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (a [test] extra) is not installed")
    objects = [*k8s_objects(), *((SECRET_EXAMPLE.name, o) for o in load_yaml_docs(SECRET_EXAMPLE))]
    assert objects
    errors = []
    for version in kubernetes_versions():
        for file, obj in objects:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as e:
                where = ".".join(str(p) for p in e.path)
                errors.append(f"{file} {obj['kind']}/{obj['metadata']['name']} (k8s {version}) at {where}: {e.message}")
            except kv.SchemaNotFoundError as e:
                errors.append(f"{file}: {e.message}")
    assert not errors, "\n".join(errors)


def test_kustomization_applies_every_manifest_in_one_namespace():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == NAMESPACE
    listed = {Path(r).name for r in kustomization["resources"]}
    assert listed == {p.name for p in MANIFESTS.glob("*.yaml")}, "kustomization.yaml resources != manifests/*.yaml"
    assert all((K8S / r).is_file() for r in kustomization["resources"])
    # `kubectl apply -f manifests/` goes alphabetically: the Namespace must come first.
    assert sorted(MANIFESTS.glob("*.yaml"))[0].name.startswith("00-")
    assert [o["kind"] for o in load_yaml_docs(sorted(MANIFESTS.glob("*.yaml"))[0])] == ["Namespace"]
    for file, obj in k8s_objects():
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["name"] == NAMESPACE
        else:
            assert obj["metadata"].get("namespace") == NAMESPACE, f"{file} {obj['kind']}: namespace {NAMESPACE}"


def test_services_select_deployments_and_their_ports():
    for _, svc in k8s_objects():
        if svc["kind"] != "Service":
            continue
        selector = svc["spec"]["selector"]
        matches = [d for d in deployments() if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, f"Service {svc['metadata']['name']} selects {len(matches)} Deployments"
        ports = {p["name"]: p["containerPort"] for p in main_container(matches[0])["ports"]}
        for port in svc["spec"]["ports"]:
            assert ports.get(port["targetPort"]) == port["port"], \
                f"Service {svc['metadata']['name']}: targetPort {port['targetPort']} != container port {port['port']}"
    for d in deployments():
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()


def worker_arg(container: dict, flag: str) -> str:
    args = container["args"]
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("role", sorted(WORKER_PORTS))
def test_worker_deployments(role):
    deployment = k8s_object("Deployment", role)
    container = main_container(deployment)
    port = WORKER_PORTS[role]
    assert container["image"].startswith("specmesh-cuda:")
    assert int(worker_arg(container, "--port")) == port
    assert worker_arg(container, "--device") == "cuda"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"] == port
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Kubernetes' native gRPC probes on the worker's port; the startup probe covers a first model load.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": port}, f"{role} {probe}"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, f"{role}: startup probe under 10 min"
    grace = float(worker_arg(container, "--grace"))
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace
    # The model pulled by the init container is the model served.
    model = worker_arg(container, "--model")
    assert model == {"drafter": DEFAULT_DRAFT_MODEL, "verifier": DEFAULT_TARGET_MODEL}[role]
    init = deployment["spec"]["template"]["spec"]["initContainers"]
    assert [c["args"] for c in init] == [["coordinator", "models", "pull", model]]
    # Reached through a headless Service.
    svc = k8s_object("Service", f"{role}-headless")
    assert svc["spec"]["clusterIP"] == "None"


def test_verifier_autoscaler():
    hpa = k8s_object("HorizontalPodAutoscaler", "verifier")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "verifier"}
    assert "replicas" not in k8s_object("Deployment", "verifier")["spec"], "the HPA owns the verifier count"
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    pdb = k8s_object("PodDisruptionBudget", "verifier")
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]


def test_coordinator_deployment():
    deployment = k8s_object("Deployment", "coordinator")
    container = main_container(deployment)
    args = container["args"]
    assert args[:2] == ["coordinator", "serve"]
    assert container["image"].startswith("specmesh:")
    # --verifier / --drafter / --suffix-drafter name the headless Services, in this namespace, on the workers' ports.
    for role, port in {**WORKER_PORTS, "suffix-drafter": SUFFIX_DRAFTER_PORT}.items():
        svc = k8s_object("Service", f"{role}-headless")
        assert worker_arg(container, f"--{role}") == \
            f"dns:///{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{svc['spec']['ports'][0]['port']}"
        assert svc["spec"]["ports"][0]["port"] == port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": int(worker_arg(container, "--port")), "metrics": 9100}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    svc = k8s_object("Service", "coordinator")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
    init = deployment["spec"]["template"]["spec"]["initContainers"]
    # The coordinator loads the target's tokenizer from the cache.
    assert [c["args"] for c in init] == [["coordinator", "models", "pull", DEFAULT_TARGET_MODEL]]


def test_suffix_drafter_deployment():
    """Model-free on the CPU image: the target's tokenizer from the cache, one replica (its tree is per process)."""
    deployment = k8s_object("Deployment", "suffix-drafter")
    container = main_container(deployment)
    assert container["image"].startswith("specmesh:") and "nvidia.com/gpu" not in str(container["resources"])
    assert container["args"][:4] == ["drafter", "serve", "--method", "suffix"]
    assert worker_arg(container, "--model") == DEFAULT_TARGET_MODEL
    assert int(worker_arg(container, "--port")) == SUFFIX_DRAFTER_PORT
    assert deployment["spec"]["replicas"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": SUFFIX_DRAFTER_PORT}, probe
    init = deployment["spec"]["template"]["spec"]["initContainers"]
    assert [c["args"] for c in init] == [["coordinator", "models", "pull", DEFAULT_TARGET_MODEL]]


@pytest.mark.parametrize("name", ["coordinator", "drafter", "verifier", "suffix-drafter"])
def test_prometheus_scraping(name):
    deployment = k8s_object("Deployment", name)
    container = main_container(deployment)
    port = int(worker_arg(container, "--metrics-port"))
    # Reachable from Prometheus: not the 127.0.0.1 default.
    assert worker_arg(container, "--metrics-host") == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                           "prometheus.io/path": "/metrics"}


def test_environment_variables_are_not_mistaken_for_flags():
    """Every SPECMESH_<FLAG> environment variable sets a flag (specmesh/ops/config.py), so Kubernetes' Docker-link
    variables must stay off (a Service named `specmesh` would inject SPECMESH_PORT=tcp://...) and the variables we set
    must be the documented ones."""
    allowed = {"SPECMESH_TOKEN", "SPECMESH_TOKEN_FILE", "SPECMESH_CACHE_DIR"}
    for d in deployments():
        pod = d["spec"]["template"]["spec"]
        assert pod.get("enableServiceLinks") is False, f"{d['metadata']['name']}: set enableServiceLinks: false"
        for c in pod_containers(d):
            names = {e["name"] for e in c.get("env", [])}
            assert names <= allowed, f"{d['metadata']['name']}/{c['name']}: unexpected environment {names - allowed}"
    for name, service in compose(DEPLOY / "docker-compose.yml")["services"].items():
        assert set(service["environment"]) <= allowed, name
    for path in DOCKERFILES:
        envs = " ".join(r for i, r in parse_dockerfile(path) if i == "ENV")
        assert set(re.findall(r"\bSPECMESH_\w+", envs)) <= allowed, path.name


def test_pods_share_cache_token_and_run_as_non_root():
    secret = load_yaml_docs(SECRET_EXAMPLE)
    assert [s["kind"] for s in secret] == ["Secret"]
    secret_name = secret[0]["metadata"]["name"]
    (token_key,) = secret[0]["stringData"]
    assert "REPLACE" in secret[0]["stringData"][token_key], "the example must hold an obvious placeholder"
    assert not any(o["kind"] == "Secret" for _, o in k8s_objects()), "never apply a token Secret from a template"
    pvcs = {o["metadata"]["name"] for _, o in k8s_objects() if o["kind"] == "PersistentVolumeClaim"}
    for d in deployments():
        name = d["metadata"]["name"]
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == NON_ROOT_UID == pod["securityContext"]["fsGroup"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] in pvcs
        assert volumes["token"]["secret"]["secretName"] == secret_name
        assert volumes["token"]["secret"]["defaultMode"] == 0o440, "owner root, group fsGroup: group-readable only"
        for c in pod_containers(d):
            mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            assert mounts["model-cache"] == "/cache", f"{name}/{c['name']}: cache at $SPECMESH_CACHE_DIR"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert "command" not in c, f"{name}/{c['name']}: keep the image's `python -m` ENTRYPOINT; use args"
        container = main_container(d)
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert env["SPECMESH_TOKEN_FILE"] == f"{mounts['token']}/{token_key}", f"{name}: token file path"


def test_deploy_readme_covers_every_file():
    readme = (DEPLOY / "README.md").read_text()
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_relative_to(WHEELS) and path != WHEELS / "README.md":
            continue  # git-ignored local wheels (deploy/wheels/README.md)
        if path.is_file() and path != DEPLOY / "README.md" and not path.name.endswith(".dockerignore"):
            assert path.name in readme, f"deploy/README.md does not mention {path.relative_to(DEPLOY)}"
    assert "wheels/" in readme and "scripts/deploy_smoke.py" in readme
    assert "no docker engine" in readme.lower()


# ------------------------------------------------------------------------- scripts/deploy_smoke.py (offline: its plan)

@functools.cache
def deploy_smoke():
    """scripts/deploy_smoke.py as a module (it is a script, not a package member)."""
    spec = importlib.util.spec_from_file_location("deploy_smoke", REPO / "scripts" / "deploy_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_deploy_smoke_arguments():
    smoke = deploy_smoke()
    args = smoke.parse_args([])
    assert args.prompts == args.concurrency == len(smoke.PROMPTS) >= 2
    assert {kind for kind, _ in smoke.PROMPTS} == {"completion", "chat"}, "both endpoints"
    assert args.max_tokens <= 64 and args.warmup and args.recovery and not args.keep and not args.plan
    assert args.base_image == smoke.DEFAULT_BASE_IMAGE and args.torch_wheel == "auto"
    args = smoke.parse_args(["--prompts", "1", "--max-tokens", "8", "--no-recovery", "--keep", "--no-warmup",
                             "--base-image", "python:3.11-slim", "--concurrency", "2"])
    assert (args.prompts, args.concurrency, args.max_tokens) == (1, 2, 8)
    assert not args.recovery and not args.warmup and args.keep
    for bad in (["--max-tokens", "0"], ["--prompts", str(len(smoke.PROMPTS) + 1)], ["--kill"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            smoke.parse_args(bad)


def test_deploy_smoke_plan_follows_the_deploy_files():
    smoke = deploy_smoke()
    plan = smoke.make_plan(smoke.parse_args(["--compose", "podman-compose", "--base-image", "base:1"]))
    services = compose(DEPLOY / "docker-compose.yml")["services"]
    assert plan.image == services["coordinator"]["image"] and plan.project == "specmesh"
    # Every service once, after everything it depends on; the coordinator last, alone.
    stage_of = {name: i for i, stage in enumerate(plan.stages) for name in stage}
    assert sorted(stage_of) == sorted(services) and sum(map(len, plan.stages)) == len(services)
    for name, service in services.items():
        for dep in service.get("depends_on", {}):
            assert stage_of[dep] < stage_of[name], f"{name} starts before its dependency {dep}"
    assert plan.stages[-1] == [plan.coordinator] == ["coordinator"]
    assert [s for s in plan.services.values() if s.one_shot] == [plan.services["models"]]
    assert sorted(plan.verifiers) == ["verifier-1", "verifier-2"] and plan.drafters == ["drafter", "suffix-drafter"]
    assert plan.http_url == "http://127.0.0.1:8000" and plan.metrics_url == "http://127.0.0.1:9100/metrics"
    assert set(plan.models) == {DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL}
    assert plan.volume == "specmesh_model-cache"
    # The build: the compose file's Dockerfile and context, its ignore file, the base as the Dockerfile's ARG.
    build = plan.build_command
    assert build[:2] == ["podman", "build"] and Path(build[-1]) == REPO
    assert Path(build[build.index("-f") + 1]) == DEPLOY / "Dockerfile"
    assert Path(build[build.index("--ignorefile") + 1]) == DEPLOY / "Dockerfile.dockerignore"
    assert build[build.index("--build-arg") + 1] == "PYTHON_IMAGE=base:1"
    assert build[build.index("-t") + 1] == plan.image
    assert "PYTHON_IMAGE" in [r.partition("=")[0] for i, r in parse_dockerfile(DEPLOY / "Dockerfile") if i == "ARG"]
    up = plan.up_command(["models"])
    assert up[0] == "podman-compose" and up[up.index("--in-pod") + 1] == "false"
    assert Path(up[up.index("-f") + 1]) == DEPLOY / "docker-compose.yml"
    assert up[-4:] == ["up", "-d", "--no-build", "models"]
    # The cache files it seeds belong to the image's user; the torch it fetches is pyproject's pin.
    assert smoke.IMAGE_UID == NON_ROOT_UID
    torch_pin = next(d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                     if d.replace(" ", "").startswith("torch=="))
    assert torch_pin.replace(" ", "") == f"torch=={smoke.TORCH_PIN}"


def test_deploy_smoke_plan_runs_nothing(monkeypatch, capsys):
    smoke = deploy_smoke()

    def refuse(*args, **kwargs):
        raise AssertionError(f"--plan ran {args}")

    monkeypatch.setattr(smoke.subprocess, "run", refuse)
    monkeypatch.setattr(smoke.subprocess, "Popen", refuse)
    assert smoke.main(["--plan", "--compose", "podman-compose"]) == 0
    out = capsys.readouterr().out
    assert "podman build -f" in out and "up -d --no-build coordinator" in out and "temperature 0" in out


def test_deploy_smoke_is_a_make_target_outside_make_test():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^deploy-smoke:.*\n(\t.*\n)*\t.*scripts/deploy_smoke\.py", makefile, re.M)
    assert "deploy-smoke" in re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
    # pytest collects tests/ only (pyproject testpaths): the smoke itself never runs in `make test`.
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"] == \
        ["tests"]


# ------------------------------------------------------------------------------- Ray: deploy/ray/, KubeRay RayService

RAY_CONFIG = DEPLOY / "ray" / "specmesh.yaml"
RAYSERVICE = K8S / "rayservice.yaml"


def serve_applications(config: dict) -> dict[str, dict]:
    return {app["name"]: app for app in config["applications"]}


def test_ray_serve_config_builds_a_valid_app():
    """deploy/ray/specmesh.yaml: Serve's own schema (with the ray extra), and the app's arguments through
    specmesh.rayserve.config (coordinator serve's real parser for serve_args)."""
    from specmesh.rayserve.config import RayAppConfig
    config = yaml.safe_load(RAY_CONFIG.read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "specmesh.rayserve.app:build_app" and app["route_prefix"] == "/"
    parsed = RayAppConfig.from_args(app["args"])
    assert parsed.args.target_model == DEFAULT_TARGET_MODEL and parsed.args.draft_model == DEFAULT_DRAFT_MODEL
    assert parsed.scaling.max_replicas > parsed.scaling.min_replicas, "the verifier deployment autoscales"
    if importlib.util.find_spec("ray") is not None:
        from ray.serve import Application
        from ray.serve.schema import ServeDeploySchema

        from specmesh.rayserve.app import build_app
        ServeDeploySchema.model_validate(config)
        assert isinstance(build_app(app["args"]), Application)  # what `serve run` builds (nothing is started)


def test_rayservice_runs_the_same_app():
    (service,) = load_yaml_docs(RAYSERVICE)
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    assert service["metadata"]["namespace"] == NAMESPACE
    from specmesh.rayserve.config import RayAppConfig
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    local = serve_applications(yaml.safe_load(RAY_CONFIG.read_text()))
    for name, app in serve_applications(serve_config).items():
        assert app["import_path"] == local[name]["import_path"] and app["route_prefix"] == local[name]["route_prefix"]
        parsed = RayAppConfig.from_args(app["args"])
        assert parsed.args.target_model == DEFAULT_TARGET_MODEL and parsed.args.device == "cuda"
        assert parsed.verifier.num_gpus == 1, "GPU verifiers declare their GPU to Ray"
        token_file = parsed.args.token_file
    if importlib.util.find_spec("ray") is not None:
        from ray.serve.schema import ServeDeploySchema
        ServeDeploySchema.model_validate(serve_config)
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0", "the Ray of the ray extra (pyproject.toml)"
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ray"]
    assert pins == [f"ray[serve]=={cluster['rayVersion']}"]
    # Every pod: the same cache volume and token Secret as the other manifests, mounted where the app reads them.
    templates = [cluster["headGroupSpec"]["template"], *[g["template"] for g in cluster["workerGroupSpecs"]]]
    for template in templates:
        pod = template["spec"]
        assert pod["securityContext"]["runAsUser"] == NON_ROOT_UID and pod["enableServiceLinks"] is False
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "specmesh-model-cache"
        assert volumes["token"]["secret"]["secretName"] == "specmesh-token"
        (container,) = pod["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert token_file == f"{mounts['token']}/token" and mounts["model-cache"] == "/cache"
    assert {"serve": 8000} .items() <= {p["name"]: p["containerPort"] for p in
                                        cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}.items()
    gpu_group = cluster["workerGroupSpecs"][0]
    assert gpu_group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu_group["minReplicas"] <= gpu_group["replicas"] <= gpu_group["maxReplicas"]


def test_rayservice_pod_templates_validate_against_schemas():
    """The RayService itself is a KubeRay custom resource (no schema here); its pod templates are Kubernetes'
    PodTemplateSpec, validated as such."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (a [test] extra) is not installed")
    (service,) = load_yaml_docs(RAYSERVICE)
    cluster = service["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"],
                 **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}}
    errors = []
    for version in kubernetes_versions():
        for name, template in templates.items():
            obj = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name, "namespace": NAMESPACE},
                   "template": template}
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as e:
                errors.append(f"{name} (k8s {version}) at {'.'.join(map(str, e.path))}: {e.message}")
    assert not errors, "\n".join(errors)


def test_ray_smoke_is_a_make_target():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^ray-smoke:.*\n(\t.*\n)*\t.*scripts/ray_smoke\.py", makefile, re.M)
    assert "ray-smoke" in re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
