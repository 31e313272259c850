"""The verifier deployment's autoscaling policy: Serve's own ongoing-requests rule, on the generations replicas serve.

A generation's verifier traffic is gRPC straight to the replica's worker (one session, many calls), so Serve's
count of ongoing requests (requests through Serve handles) never sees it. Each verifier replica reports the
sessions it holds instead (`record_autoscaling_stats`, workers.py), Serve averages them over `look_back_period_s`,
and this policy applies the rule of Serve's default policy to them: desired replicas = total ongoing /
target_ongoing_requests. Serve wraps it with the rest of autoscaling_config (min/max replicas, up- and downscale
delays, smoothing factors) and carries out the decision: it starts and stops the replicas.
"""

from __future__ import annotations

ONGOING_GENERATIONS = "specmesh_ongoing_generations"


def ongoing_generations_policy(ctx) -> tuple[float, dict]:
    """(desired replicas, policy state) from a ray.serve.config.AutoscalingContext."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    per_replica = (ctx.aggregated_metrics or {}).get(ONGOING_GENERATIONS, {})
    total = sum(per_replica.values())
    return total / ctx.config.get_target_ongoing_requests(), {}
