"""The bounds the node puts on waiting for the network or its ranks, in one place. Left where they
are: the grace periods inside hivemind's DHT and the relay's."""

from __future__ import annotations

import dataclasses

from .config import Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Seconds. The first four are options (--match-wait-s, --wait-timeout-s, --leave-timeout-s,
    --end-wait-s); the rest are fixed; the properties are derived from them."""

    match_wait_s: float = 5.0
    """How long a round waits for the other islands before it runs with whoever came."""
    wait_timeout_s: float = 120.0
    """Before step 1, how long to wait for --wait-islands islands."""
    leave_timeout_s: float = 10.0
    """Leaving on a signal: the rounds in flight get this long in all."""
    end_wait_s: float = 120.0
    """At the end of the run, how long to wait for the other islands to finish their steps."""

    max_match_wait_s: float = 40.0
    """The longest a round waits for the others after rounds that found nobody."""
    allreduce_s: float = 30.0
    """The all-reduce itself, once the group is formed (and a satellite's deposit)."""
    next_chunk_s: float = 15.0
    """A peer that sends nothing for this long is dropped from the round."""
    request_s: float = 1.0
    """One matchmaking request, and the grace a member that joined a leader gives it after the
    group's scheduled start (2.5 s was tried: bench/README.md, bench.elastic)."""
    round_s: float = 150.0
    """A round from its start to its result, whatever the transport does (FragmentSync)."""
    join_s: float = 30.0
    """One fragment's state download (a joiner's catch-up, a rebase, a satellite after its deposit)."""
    end_compare_s: float = 30.0
    """At the end, each look at the other islands' fingerprints of the agreed model."""
    records_read_s: float = 0.5
    """Reading the island records just before a round: a slow read must not make the island late."""
    end_read_s: float = 2.0
    """Each read of the records while waiting for the others at the end of the run."""
    records_fresh_s: float = 2.0
    """Records read this recently are fresh enough for a round."""
    withdraw_s: float = 3.0
    """Publishing the record that says this island left."""
    dht_s: float = 10.0
    """One DHT store or get (SwarmDHT takes this default)."""
    redial_s: float = 4.0
    """Dialling again the peers the DHT lost (after a partition; SwarmDHT takes this default)."""
    start_s: float = 30.0
    """At start, learning the addresses this node is reachable at."""
    ranks_s: float = 300.0
    """The shortest a collective between the island's ranks may wait."""

    def __post_init__(self):
        least = 2 * self.max_match_wait_s + self.allreduce_s + 2 * self.request_s
        if self.round_s < least:
            raise ValueError(f"round_s {self.round_s} is below the longest match wait twice plus the all-reduce: {least}")

    @classmethod
    def from_config(cls, cfg: Config) -> Timeouts:
        net = cfg.net
        return cls(
            match_wait_s=net.match_wait_s, wait_timeout_s=net.wait_timeout_s, leave_timeout_s=net.leave_timeout_s,
            end_wait_s=net.end_wait_s,
        )

    @property
    def last_round_match_s(self) -> float:
        """The match wait of the end-of-run rounds (FragmentSync.agree). The islands waited for one
        another to finish first, so a round fills (and starts) as soon as all are in; a long wait
        costs only when one is missing, and a short one could leave a late island out for good."""
        return min(self.max_match_wait_s, 4 * self.match_wait_s)

    @property
    def download_s(self) -> float:
        """A state download inside a round's handling (rebase, after a deposit): within the round's bound."""
        return min(self.join_s, self.round_s)

    def ranks_wait_s(self, fragments: int) -> float:
        """How long a collective between the island's ranks may wait: the followers wait at the
        first one while rank 0 waits for islands and downloads the swarm's state."""
        return max(self.ranks_s, self.wait_timeout_s + fragments * self.join_s + 60.0)
