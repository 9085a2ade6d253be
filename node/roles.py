"""The roles of a node: an island, or a satellite in contact only in its windows. The island
core asks its role what to do where the two differ, instead of branching on a flag."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import Config
from .contact import ContactClock

if TYPE_CHECKING:
    from .island import IslandCore


class IslandRole:
    """An island: always reachable; it takes every round, serves its state to joiners and agrees
    the model with the others at the end."""

    satellite = False
    contact: ContactClock | None = None
    serves_state = True
    """Joiners may download this island's agreed values."""
    agrees_at_end = True
    """It takes part in the end-of-run agreement of the model."""

    def may_round(self, budget_s: float) -> bool:
        """Whether a round that needs `budget_s` seconds of contact may start now."""
        return True

    async def before_step(self, core: IslandCore, step: int) -> int:
        """The step to train from: an island moves its step counter only when it finds itself a
        window behind most of the others, between rounds (IslandCore.rejoin)."""
        if core.sync.quiet:
            return await core.rejoin(step)
        return step


class SatelliteRole:
    """A satellite: in contact only in its windows. It rounds only with enough contact left,
    accumulates instead of rounds it cannot take or that failed, serves no state (its agreed
    values are stale by design) and takes no part in the end-of-run agreement."""

    satellite = True
    serves_state = False  # its agreed values are stale by design: joiners take an island's
    agrees_at_end = False

    def __init__(self, contact: ContactClock):
        self.contact = contact
        self.was_in_contact: bool | None = None

    def may_round(self, budget_s: float) -> bool:
        return self.contact.can_round(budget_s)

    async def before_step(self, core: IslandCore, step: int) -> int:
        """On entering or leaving contact: say so, and refresh the records at once on entering;
        in contact with no round in flight, move to the islands' step."""
        in_contact = self.contact.in_contact()
        if in_contact != self.was_in_contact:
            self.was_in_contact = in_contact
            core.events.emit("contact", step=step, in_contact=in_contact, remaining_s=round(self.contact.remaining_s(), 3))
            if in_contact:  # publish its record and read the islands' at once
                core.refresh_soon()
        if in_contact and core.sync.quiet:
            return core.align(step)
        return step


def make_role(cfg: Config) -> IslandRole | SatelliteRole:
    """The role the config names; a satellite's contact windows count from here (the node's start)."""
    return SatelliteRole(ContactClock(cfg.net.contact)) if cfg.net.role == "satellite" else IslandRole()
