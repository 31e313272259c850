"""The Ray Serve application: `build_app(args)`, an application builder.

    serve run deploy/ray/specmesh.yaml                       # the config file names specmesh.rayserve.app:build_app
    serve run specmesh.rayserve.app:build_app serve_args="--target-model qwen2.5-coder-1.5b-instruct"

`args` (config.RayAppConfig.from_args): `serve_args` (`coordinator serve` flags), `verifier`/`drafter`/`coordinator`
placements (num_cpus, num_gpus, resources), `verifier_scaling` (Serve's autoscaling_config), `drafter_replicas`,
`worker` (threads, grace_s, host), `discovery_interval_s`.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from specmesh.rayserve.config import RayAppConfig
from specmesh.rayserve.ingress import CoordinatorIngress
from specmesh.rayserve.workers import DrafterReplica, VerifierReplica

# Serve's own request limit per replica: the workers never receive requests through Serve (only `describe`), and
# the ingress admits generations itself (--max-concurrent-requests, --max-queue).
MAX_ONGOING_REQUESTS = 1000


def model_options(args, model: str) -> dict:
    """A worker's run_server options from `coordinator serve` flags (what its local workers would get)."""
    return {"model": model, "engine": args.engine, "device": args.device, "dtype": args.dtype}


def build(config: RayAppConfig) -> Application:
    args = config.args
    # Each replica reads the token where it runs ($SPECMESH_TOKEN or the file, as containers do): it never travels in
    # the application's arguments.
    token_file = args.token_file
    graceful = config.worker.grace_s + 5
    verifier = serve.deployment(VerifierReplica).options(
        name="verifier", ray_actor_options=config.verifier.ray_actor_options(),
        autoscaling_config=config.scaling.autoscaling_config(), max_ongoing_requests=MAX_ONGOING_REQUESTS,
        graceful_shutdown_timeout_s=graceful, health_check_period_s=5.0,
    ).bind(model_options(args, args.target_model), config.worker, token_file)
    drafter = None
    if config.drafts:
        drafter = serve.deployment(DrafterReplica).options(
            name="drafter", ray_actor_options=config.drafter.ray_actor_options(),
            num_replicas=config.drafter_replicas, max_ongoing_requests=MAX_ONGOING_REQUESTS,
            graceful_shutdown_timeout_s=graceful, health_check_period_s=5.0,
        ).bind(model_options(args, args.draft_model), config.worker, token_file)
    return serve.deployment(CoordinatorIngress).options(
        name="coordinator", ray_actor_options=config.coordinator.ray_actor_options(), num_replicas=1,
        max_ongoing_requests=MAX_ONGOING_REQUESTS, graceful_shutdown_timeout_s=args.grace + 5,
    ).bind(verifier, drafter, args, config.discovery_interval_s)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Serve's application builder: the args of a Serve config file (or `serve run ... key=value`)."""
    return build(RayAppConfig.from_args(args))
