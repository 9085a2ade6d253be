"""`--metrics-port`: the node's figures for Prometheus (prometheus_client, on its own registry).

The training loop and the island core call `step`, `sync` and `network` as they go; the HTTP server runs
in prometheus_client's thread and reads the last values.
"""

from __future__ import annotations

from islands.protocols.diloco import OUTCOMES
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    def __init__(self, host: str, port: int, labels: dict[str, str]):
        self.registry = r = CollectorRegistry()
        info = Gauge("islands_info", "this node: run, role, peer id", list(labels), registry=r)
        info.labels(**labels).set(1)
        self.step = Gauge("islands_step", "inner steps done", registry=r)
        self.loss = Gauge("islands_loss", "training loss of the last inner step", registry=r)
        self.tokens_per_s = Gauge("islands_tokens_per_second", "tokens trained per second (recent steps, wall time)", registry=r)
        self.tokens = Counter("islands_tokens", "tokens trained", registry=r)
        self.syncs = Counter("islands_syncs", "fragment syncs applied, by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.syncs.labels(outcome=outcome)
        self.bytes_sent = Counter("islands_bytes_sent", "bytes this island sent in rounds", registry=r)
        self.bytes_recv = Counter("islands_bytes_received", "bytes this island received in rounds", registry=r)
        self.round_seconds = Histogram(
            "islands_round_seconds", "time from a round's start to its result",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160), registry=r,
        )
        self.peers = Gauge("islands_peers_seen", "live islands and satellites in the run's records, this one included", registry=r)
        self.banned = Gauge("islands_peers_banned", "peers this island bans now (their rounds were rejected repeatedly)", registry=r)
        self.refused = Counter("islands_refused", "requests refused: no swarm key, or a banned peer", registry=r)
        self.records_dropped = Gauge("islands_records_dropped", "DHT records ignored since start, by why", ["why"], registry=r)
        self.server, self._thread = start_http_server(port, addr=host, registry=r)
        self.port = self.server.server_port

    def on_step(self, step: int, loss: float, tokens: int, tokens_per_s: float) -> None:
        self.step.set(step)
        self.loss.set(loss)
        self.tokens.inc(tokens)
        self.tokens_per_s.set(tokens_per_s)

    def on_sync(self, record: dict) -> None:
        self.syncs.labels(outcome=record["outcome"]).inc()
        self.bytes_sent.inc(record["bytes_sent"])
        self.bytes_recv.inc(record["bytes_recv"])
        if record["outcome"] in ("ok", "rejected", "failed"):
            self.round_seconds.observe(record["seconds"])

    def on_network(self, peers: int, banned: int, forged: int, malformed: int) -> None:
        self.peers.set(peers)
        self.banned.set(banned)
        self.records_dropped.labels(why="forged").set(forged)
        self.records_dropped.labels(why="malformed").set(malformed)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
