"""The Ray Serve application's settings: what `build_app` takes (a Serve config file's `args`), validated without Ray.

`serve_args` are `coordinator serve` flags, parsed by that command's own parser: the same model, drafting, admission,
resilience and security flags, with the same defaults. Flags about where the workers are or where HTTP listens are
refused there: Ray finds the workers, and Serve's proxy listens (`http_options` of the Serve config).
Each role then has its Ray resources (`num_cpus`, `num_gpus`, custom `resources`) and the verifier its autoscaling.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

# `coordinator serve` flags with no meaning here, and why.
REFUSED_SERVE_FLAGS = {
    "--verifier": "Ray finds the verifier replicas",
    "--drafter": "Ray finds the drafter replicas",
    "--suffix-drafter": "not deployed on Ray yet",
    "--suffix": "not deployed on Ray yet",
    "--host": "Serve's proxy listens for HTTP (http_options in the Serve config)",
    "--port": "Serve's proxy listens for HTTP (http_options in the Serve config)",
}


def parse_serve_args(serve_args: str | list[str]) -> argparse.Namespace:
    """`coordinator serve` flags (a list, or one string split like a shell would) through that command's parser; a
    ValueError naming the flag for anything it refuses."""
    from coordinator.cli import LEAF_PARSERS, build_parser
    argv = shlex.split(serve_args) if isinstance(serve_args, str) else [str(a) for a in serve_args]
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in REFUSED_SERVE_FLAGS:
            raise ValueError(f"serve_args: {flag} cannot be used on Ray: {REFUSED_SERVE_FLAGS[flag]}")
    if "serve" not in LEAF_PARSERS:
        build_parser()
    parser = LEAF_PARSERS["serve"]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = parser.parse_args(argv)
    except SystemExit:
        message = errors.getvalue().strip().splitlines()
        raise ValueError(f"serve_args: {message[-1] if message else 'cannot be parsed'}") from None
    if args.draft_tokens is not None and not 0 <= args.draft_tokens <= 64:
        raise ValueError(f"serve_args: --draft-tokens must be in 0..64, got {args.draft_tokens}")
    return args


def _resources(value: Any, where: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}.resources must be a mapping of resource name to amount, got {value!r}")
    out = []
    for name, amount in value.items():
        if not isinstance(amount, (int, float)) or amount < 0:
            raise ValueError(f"{where}.resources[{name!r}] must be a number >= 0, got {amount!r}")
        out.append((str(name), float(amount)))
    return tuple(sorted(out))


@dataclass(frozen=True)
class Placement:
    """What one replica of a role asks Ray for."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: tuple[tuple[str, float], ...] = ()  # custom resources, e.g. (("specmesh_verifier", 1.0),)

    def __post_init__(self) -> None:
        if not self.num_cpus >= 0:
            raise ValueError(f"num_cpus must be >= 0, got {self.num_cpus}")
        if not self.num_gpus >= 0:
            raise ValueError(f"num_gpus must be >= 0, got {self.num_gpus}")

    def ray_actor_options(self) -> dict:
        options: dict = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


@dataclass(frozen=True)
class VerifierScaling:
    """Serve's autoscaling_config for the verifier deployment. The load is the generations a replica serves (its
    open sessions), Serve's ongoing requests for a fleet whose requests travel over gRPC (autoscaling.py)."""

    min_replicas: int = 1
    max_replicas: int = 2
    initial_replicas: int | None = None
    target_ongoing_requests: float = 2.0  # generations per verifier replica
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    look_back_period_s: float = 5.0
    metrics_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"verifier replicas: need 1 <= min_replicas <= max_replicas, got {self.min_replicas} "
                             f"and {self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas must be within min_replicas..max_replicas, got {self.initial_replicas}")
        for name in ("target_ongoing_requests", "look_back_period_s", "metrics_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def autoscaling_config(self) -> dict:
        config = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                  "target_ongoing_requests": self.target_ongoing_requests,
                  "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                  "look_back_period_s": self.look_back_period_s, "metrics_interval_s": self.metrics_interval_s,
                  "policy": {"policy_function": "specmesh.rayserve.autoscaling:ongoing_generations_policy"}}
        if self.initial_replicas is not None:
            config["initial_replicas"] = self.initial_replicas
        return config


@dataclass(frozen=True)
class WorkerSettings:
    """How each worker replica runs its worker, beyond the model flags of serve_args."""

    threads: int | None = None  # CPU threads of the model (default: the worker's own choice)
    grace_s: float = 10.0  # when Ray stops a replica: seconds its calls in flight may finish (sessions move on)
    host: str = "node"  # the gRPC address to bind: "node" = the IP Ray knows this node by
    inject_latency_s: float = 0.0  # testing: each Propose/Verify waits this long first (`serve --inject-latency`)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not self.inject_latency_s >= 0:
            raise ValueError(f"inject_latency_s must be >= 0, got {self.inject_latency_s}")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")


@dataclass(frozen=True)
class RayAppConfig:
    serve_args: tuple[str, ...] = ()
    verifier: Placement = field(default_factory=Placement)
    drafter: Placement = field(default_factory=Placement)
    coordinator: Placement = field(default_factory=lambda: Placement(num_cpus=0.5))
    scaling: VerifierScaling = field(default_factory=VerifierScaling)
    drafter_replicas: int = 1
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    discovery_interval_s: float = 1.0  # how often the coordinator asks Ray for the live replicas

    def __post_init__(self) -> None:
        parse_serve_args(list(self.serve_args))  # refuses what the coordinator would
        if self.drafter_replicas < 1:
            raise ValueError(f"drafter_replicas must be >= 1, got {self.drafter_replicas}")
        if not self.discovery_interval_s > 0:
            raise ValueError(f"discovery_interval_s must be > 0, got {self.discovery_interval_s}")

    @property
    def args(self) -> argparse.Namespace:
        return parse_serve_args(list(self.serve_args))

    @property
    def drafts(self) -> bool:
        return self.args.draft_tokens != 0

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> RayAppConfig:
        """From a Serve config's `args` (or `serve run ... key=value`): every key known, every value checked."""
        args = dict(args or {})
        known = {f.name for f in fields(cls)} - {"scaling"} | {"verifier_scaling"}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        serve_args = args.get("serve_args", ())
        serve_args = tuple(shlex.split(serve_args) if isinstance(serve_args, str) else map(str, serve_args))
        kwargs: dict[str, Any] = {"serve_args": serve_args}
        for role in ("verifier", "drafter", "coordinator"):
            if role in args:
                kwargs[role] = _placement(args[role], role)
        scaling = args.get("verifier_scaling")
        if scaling is not None:
            kwargs["scaling"] = _dataclass(VerifierScaling, scaling, "verifier_scaling")
        if "worker" in args:
            kwargs["worker"] = _dataclass(WorkerSettings, args["worker"], "worker")
        for name in ("drafter_replicas", "discovery_interval_s"):
            if name in args:
                kwargs[name] = args[name]
        return cls(**kwargs)


def _dataclass(kind, value: Any, where: str):
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping, got {value!r}")
    names = {f.name for f in fields(kind)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    try:
        return kind(**value)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None


def _placement(value: Any, where: str) -> Placement:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping, got {value!r}")
    value = dict(value)
    if "resources" in value:
        value["resources"] = _resources(value["resources"], where)
    return _dataclass(Placement, value, where)
