"""The drafting decision: whether to draft, how far, and from which draft source. One module a concern:

    rounds.py       RoundRecord: what one round of the loop measured (the input of everything below)
    costs.py        the cost model: CostEstimate (what a round with k drafts commits and costs), DraftingOff
    priors.py       the cost model's starting point: the workers' measured costs from their Info
    estimators.py   what the rounds measured: acceptance, survival, the bet's hit rate, drafting slowdown
    policies.py     the policies choosing k: fixed, heuristic (HF's +2/-1), cost; POLICIES by name; DraftLength,
                    a generation's bounds on k and the policy deciding within them
    learned.py      what is learned across generations, per draft source, and how it fades
    hybrid.py       hybrid drafting: the suffix drafter's draft where it has one, the draft model's where that pays

Everything here is pure (no gRPC, no clocks except where a module says so), so each piece is unit-testable.
"""

from coordinator.drafting.costs import PLAUSIBLE_ACCEPTANCE, PRIOR_ACCEPTANCE, CostEstimate, CostsPending, DraftingOff
from coordinator.drafting.policies import DEFAULT_POLICY, POLICIES, DraftLength
from coordinator.drafting.rounds import RoundRecord

__all__ = ["PLAUSIBLE_ACCEPTANCE", "PRIOR_ACCEPTANCE", "CostEstimate", "CostsPending", "DraftingOff", "DraftLength",
           "DEFAULT_POLICY", "POLICIES", "RoundRecord"]
