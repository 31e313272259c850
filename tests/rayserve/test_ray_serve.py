"""specmesh on Ray Serve (specmesh/rayserve/): the application's arguments and autoscaling rule offline, and the smoke
run of scripts/ray_smoke.py for real on tiny models: a Ray cluster of three nodes on this machine, concurrent
requests through the `openai` client, a verifier's node killed mid-generation (outputs must equal the fault-free
pass, and Ray must bring the replica back), verifier autoscaling 1 -> 2 -> 1, and the overhead against `coordinator
serve` on the same workers. The run needs the `ray` extra (`make setup EXTRAS=test,ray`) and is skipped without it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specmesh.rayserve.autoscaling import ONGOING_GENERATIONS, ongoing_generations_policy
from specmesh.rayserve.config import RayAppConfig, VerifierScaling

REPO = Path(__file__).resolve().parents[2]
HAVE_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None


def smoke_module():
    spec = importlib.util.spec_from_file_location("ray_smoke", REPO / "scripts" / "ray_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_app_arguments_take_coordinator_serve_flags():
    config = RayAppConfig.from_args({
        "serve_args": "--target-model tiny-random-qwen2 --draft-model tiny-random-qwen2-b --draft-tokens 0",
        "verifier": {"num_cpus": 2, "num_gpus": 1, "resources": {"specmesh_verifier": 1}},
        "verifier_scaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}})
    assert config.args.target_model == "tiny-random-qwen2" and not config.drafts
    assert config.verifier.ray_actor_options() == {"num_cpus": 2, "num_gpus": 1, "resources": {"specmesh_verifier": 1}}
    autoscaling = config.scaling.autoscaling_config()
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"], autoscaling["target_ongoing_requests"]) == \
        (1, 3, 4)
    assert autoscaling["policy"]["policy_function"] == "specmesh.rayserve.autoscaling:ongoing_generations_policy"
    # The defaults of coordinator serve's own parser.
    assert RayAppConfig().args.draft_policy == RayAppConfig.from_args({}).args.draft_policy


@pytest.mark.parametrize("args,message", [
    ({"serve_args": ["--verifier", "10.0.0.5:50052"]}, "Ray finds the verifier replicas"),
    ({"serve_args": "--port 9000"}, "Serve's proxy listens"),
    ({"serve_args": "--no-such-flag"}, "unrecognized arguments"),
    ({"serve_args": "--draft-tokens 99"}, "0..64"),
    ({"verifier": {"num_cpus": -1}}, "num_cpus must be >= 0"),
    ({"verifier": {"resources": {"gpu_slot": "one"}}}, "must be a number"),
    ({"verifier_scaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas <= max_replicas"),
    ({"verifier_scaling": {"target_ongoing": 1}}, "unknown key"),
    ({"worker": {"threads": 0}}, "threads must be >= 1"),
    ({"replicas": 2}, "unknown argument"),
])
def test_bad_app_arguments_are_refused_with_the_cause(args, message):
    with pytest.raises(ValueError, match=message):
        RayAppConfig.from_args(args)


def test_autoscaling_policy_is_serves_rule_on_ongoing_generations():
    config = SimpleNamespace(get_target_ongoing_requests=lambda: 2.0)

    def context(per_replica, current=1, target=1):
        return SimpleNamespace(current_num_replicas=current, target_num_replicas=target, config=config,
                               aggregated_metrics={ONGOING_GENERATIONS: per_replica})

    assert ongoing_generations_policy(context({"r1": 3.0}))[0] == 1.5  # Serve rounds up: 2 replicas
    assert ongoing_generations_policy(context({"r1": 1.0, "r2": 0.0}, current=2))[0] == 0.5  # down to 1
    assert ongoing_generations_policy(context({}, current=0, target=1))[0] == 1  # nothing running yet
    assert ongoing_generations_policy(SimpleNamespace(current_num_replicas=1, target_num_replicas=1, config=config,
                                                      aggregated_metrics=None))[0] == 0


def test_scaling_defaults_are_valid():
    VerifierScaling()
    with pytest.raises(ValueError):
        VerifierScaling(initial_replicas=5)


@pytest.mark.skipif(not HAVE_RAY, reason="the ray extra is not installed (make setup EXTRAS=test,ray)")
@pytest.mark.timeout(600)
def test_smoke_on_tiny_models(tmp_path, capsys):
    smoke = smoke_module()
    out = tmp_path / "result.json"
    status = smoke.main(["--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2-b",
                         "--dtype", "float64", "--max-tokens", "32", "--inject-latency", "0.15",
                         "--downscale-delay", "20", "--overhead-rounds", "2", "--overhead-tokens", "16",
                         "--out", str(out)])
    import json
    summary = json.loads(out.read_text())
    assert status == 0 and summary["pass"], summary
    assert summary["failed_requests"] == 0 and summary["mismatches"] == 0
    assert summary["replica_back_s"] is not None and summary["in_coordinator_pool_s"] is not None
    assert summary["kill"]["sessions"][summary["kill"]["address"]] >= 1, "the killed verifier was busy"
    counts = [count for _, count in summary["replica_events"]]
    assert 1 in counts and 2 in counts and counts[-1] == 1, f"autoscaling 1 -> 2 -> 1 not seen: {counts}"
    assert summary["overhead"]["same_text"]
