"""The cost policy's starting point: the workers' own measured costs (their Info), as a CostEstimate."""

from __future__ import annotations

import math

from coordinator.drafting.costs import PRIOR_ACCEPTANCE, CostEstimate


def measures_costs_later(info) -> bool:
    """A worker that runs a model but reports no costs in its Info (0): it has not measured them yet. A worker measures
    them after SERVING when they are not cached (specmesh/worker/cost_probe.py); a drafter without a model has none."""
    if info is None or not getattr(info, "engine", ""):
        return False
    return (info.verify_base_s if info.role == "verifier" else info.draft_per_token_s) <= 0


def cost_prior(verifier_info, drafter_info, round_trips: dict[str, float] | None = None) -> CostEstimate | None:
    """The workers' measured costs, plus the measured round trip to each (`round_trips`, seconds by role), as the
    cost policy's starting point. None when either worker reports none (not measured yet, or an older worker): a
    draft model that reports 0 s per token has not measured it, and a prior with free drafts would draft long.
    Round trips count in whole milliseconds, rounded down: on loopback or a LAN they are noise (and would make k,
    and so a seeded sampled generation, depend on timing); across hosts they are what every round pays."""
    if drafter_info is None or verifier_info.verify_base_s <= 0 or measures_costs_later(drafter_info):
        return None
    whole_ms = {role: math.floor(s * 1000) / 1000 for role, s in (round_trips or {}).items()}
    # The measured curve when the verifier sends one (older verifiers send only the line), drafts ascending from 0.
    curve = tuple(sorted((c.drafts, max(c.seconds, 0.0)) for c in getattr(verifier_info, "verify_costs", ())))
    return CostEstimate(PRIOR_ACCEPTANCE, max(drafter_info.draft_per_token_s, 0.0), verifier_info.verify_base_s,
                        max(verifier_info.verify_per_draft_s, 0.0), draft_round_trip_s=whole_ms.get("drafter", 0.0),
                        verify_round_trip_s=whole_ms.get("verifier", 0.0),
                        verify_curve=curve if curve and curve[0][0] == 0 else (),
                        # Target-only generations stream (Decode): the round trip is paid once, not per token.
                        target_streams=True)
