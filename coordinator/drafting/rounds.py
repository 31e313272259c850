"""What one round of the loop measured: the input of every draft-length policy and estimator."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundRecord:
    """What one round of the loop measured: the input of every draft-length policy."""

    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    bet_won: bool | None = None  # pipelining: whether the next round's draft came from this round's bet; None: no bet
    # Which draft source drafted the round (hybrid drafting: "suffix" or "model"; "" for a single drafter or no
    # drafts): what is measured of a source (slowdown, acceptance) is learned for that source alone.
    source: str = ""
