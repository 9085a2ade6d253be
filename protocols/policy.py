"""What an island does with a round's result: a pure function of the result, its contribution's
staleness and the island's role. node/sync.py carries the plan out."""

from __future__ import annotations

import dataclasses
from typing import Literal

Action = Literal["take_swarm", "accumulate", "rebase", "apply"]


@dataclasses.dataclass(frozen=True)
class Plan:
    action: Action
    """take_swarm: a satellite's progress is with an island now: take the swarm's fragment as its
    base. accumulate: apply nothing; the tokens count towards the next contribution. rebase:
    take an island's agreed fragment and apply the round to it (if none comes:
    `after_failed_rebase`). apply: the outer step with the round's result."""
    policy: str
    """What the round's `sync` event says."""
    advance_round: bool = True
    """apply: the fragment's round counter moves to the round's (not for a stale base kept)."""
    alone: bool = False
    """apply: the island's own update (the round did not average)."""
    mix_local: bool = True
    """apply: mix the local values now; False: a stale member's base is about to be replaced by
    the group's (the consensus round), so it mixes after that."""
    settle: bool = False
    """apply: the members' bases agreed: nothing applied alone is left between them."""
    heal: bool = False
    """apply: the group's bases disagreed: average them once more (a consensus round)."""


def after_round(outcome: str, deposited: bool, consensus: bool, staleness: int, satellite: bool) -> Plan:
    """The plan for a round's result. `deposited`: a satellite left its contribution with an
    island; `consensus`: the members' agreed values differed; `staleness`: rounds of this fragment
    the island missed before this one."""
    if deposited:
        return Plan("take_swarm", "deposited")
    if outcome != "ok" and satellite:
        # a satellite does not apply its own update alone: it contributes it at its next round
        return Plan("accumulate", "accumulate")
    if outcome == "ok" and staleness and not consensus:
        # averaged, but against a base the swarm no longer has; its own progress stays in its local values
        return Plan("rebase", "rebased")
    ok = outcome == "ok"
    return Plan(
        "apply", "averaged" if ok else "own_update", alone=not ok, mix_local=not (consensus and staleness > 0),
        settle=ok and not consensus, heal=consensus,
    )


def after_failed_rebase(satellite: bool) -> Plan:
    """No island's fragment came to rebase on: a satellite keeps accumulating; an island applies
    the round to its stale base, and its next round counts ~0 again."""
    if satellite:
        return Plan("accumulate", "accumulate")
    return Plan("apply", "averaged", advance_round=False)


def holds_swarm_base(outcome: str, policy: str, staleness: int, consensus: str | None) -> bool:
    """Whether, after a round of a fragment, an island holds the swarm's agreed values of it: a
    round that averaged with others and was not stale (its base was the swarm's), or one after
    which it took an island's values (a rebase) or the group's (a consensus round). An island
    that joined without the swarm's state holds only its own initial values until then, and
    gives no joiner its state meanwhile (node/island.py)."""
    if outcome != "ok":
        return False
    return policy == "rebased" or consensus == "ok" or (policy == "averaged" and staleness == 0)
