"""The swarm's DHT: start or join it, publish and read the run manifest and the island records.

Records are signed (hivemind's RSA signature validator): each island writes
its island record and its copy of the manifest under a subkey that carries
its public key, the key its libp2p peer id is derived from. A record can
then be written only by the island it names; one whose signature, owner or
content does not hold is dropped and counted (`forged_records`,
`malformed_records`), never trusted and never a crash.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr
from islands.node.timeouts import Timeouts
from islands.protocols.admission import namespace
from islands.protocols.records import RECORD_TTL_S, IslandRecord, parse_island_record

from .authorizer import SwarmKeyAuthorizer
from .signing import load_identity, owner_peer_id

logger = logging.getLogger(__name__)

MANIFEST_TTL_S = 300.0
DHT_TIMEOUT_S = Timeouts.dht_s
REDIAL_TIMEOUT_S = Timeouts.redial_s
"""How long a re-dial of lost peers may take (peers still cut off just do not answer)."""


class SwarmDHT:
    """The run's records on a hivemind DHT. Every call is bounded by DHT_TIMEOUT_S."""

    def __init__(self, dht: DHT, run_id: str, validator: RSASignatureValidator, swarm_key: bytes | None = None):
        self.dht = dht
        self.run_id = run_id
        self.namespace = namespace(run_id, swarm_key)
        """The prefix of every DHT key of this run (the run id, tagged when there is a swarm key)."""
        self.manifest_key = f"{self.namespace}:manifest"
        self.islands_key = f"{self.namespace}:islands"
        self.owner = validator.local_public_key
        """This node's subkey: its RSA public key, as hivemind's validator marks signed records."""
        self.malformed_records = 0
        self.forged_records = 0

    @classmethod
    def start(
        cls,
        run_id: str,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        identity_path: str | os.PathLike | None = None,
        client_mode: bool = False,
        swarm_key: bytes | None = None,
        on_refused: Callable[[str], None] | None = None,
    ) -> SwarmDHT:
        """`identity_path`: the node's private key (created, owner-only, if missing); it is both its
        libp2p identity and the key its records are signed with. Without one (status), a random key."""
        kwargs: dict[str, Any] = dict(host_maddrs=list(host_maddrs), client_mode=client_mode)
        if announce_maddrs:
            kwargs["announce_maddrs"] = list(announce_maddrs)
        key, peer_id = None, ""
        if identity_path:
            key, peer_id = load_identity(Path(identity_path))
            kwargs["identity_path"] = str(identity_path)
        validator = RSASignatureValidator(key)
        if swarm_key is not None:
            kwargs["authorizer"] = SwarmKeyAuthorizer(swarm_key, peer_id, on_refused)
        dht = DHT(initial_peers=list(initial_peers), start=True, record_validators=[validator], **kwargs)
        return cls(dht, run_id, validator, swarm_key)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def _call(self, fn, *args, **kwargs):
        """One DHT call (get, store, run_coroutine), bounded. It is awaited as hivemind's future, not
        run in a thread: a thread blocked on a call that the DHT's process never answers (it shut
        down meanwhile) would keep the node from exiting (asyncio waits for its executor's threads)."""
        future = fn(*args, return_future=True, **kwargs)
        try:
            return await asyncio.wait_for(future, timeout=DHT_TIMEOUT_S)
        except BaseException:
            future.cancel()
            raise

    async def _signed(self, key: str) -> dict[str, Any]:
        """The values under `key` by the peer id of the island that signed each; others are counted."""
        found = await self._call(self.dht.get, key, latest=True)
        out: dict[str, Any] = {}
        if found is None:
            return out
        if not isinstance(found.value, dict):  # a plain value where subkeys belong: nobody signed it
            self.forged_records += 1
            return out
        for subkey, item in found.value.items():
            peer_id = owner_peer_id(subkey)
            if peer_id is None:  # not under a signing key (the validator already dropped bad signatures)
                self.forged_records += 1
                continue
            out[peer_id] = getattr(item, "value", None)
        return out

    async def get_manifest(self) -> dict | None:
        """The manifest most islands signed (copies that differ from it are counted as forged)."""
        copies = list((await self._signed(self.manifest_key)).values())
        good = [v for v in copies if isinstance(v, dict)]
        self.malformed_records += len(copies) - len(good)
        if not good:
            return None
        votes = Counter(json.dumps(v, sort_keys=True, default=str) for v in good)
        winner, count = votes.most_common(1)[0]
        self.forged_records += len(good) - count
        return json.loads(winner)

    async def store_manifest(self, manifest: dict) -> bool:
        return bool(
            await self._call(self.dht.store, self.manifest_key, manifest, get_dht_time() + MANIFEST_TTL_S, subkey=self.owner)
        )

    async def store_island(self, record: IslandRecord, ttl_s: float = RECORD_TTL_S) -> bool:
        return bool(
            await self._call(self.dht.store, self.islands_key, record.to_value(), get_dht_time() + ttl_s, subkey=self.owner)
        )

    async def islands(self) -> dict[str, IslandRecord]:
        out: dict[str, IslandRecord] = {}
        for peer_id, value in (await self._signed(self.islands_key)).items():
            record = parse_island_record(peer_id, value)
            if record is None:
                self.malformed_records += 1
                continue
            out[peer_id] = record
        return out

    async def redial(self, targets: dict[str, list[str]], timeout_s: float = REDIAL_TIMEOUT_S) -> list[str]:
        """Dial and ping the `targets` (peer id -> addresses) that the DHT's routing table lacks;
        the peer ids that answered (each is back in the table, and this node in theirs)."""
        if not targets:
            return []
        return await self._call(self.dht.run_coroutine, functools.partial(_redial, targets, timeout_s))

    def shutdown(self) -> None:
        self.dht.shutdown()


async def _redial(targets: dict[str, list[str]], timeout_s: float, _dht: DHT, node: DHTNode) -> list[str]:
    """In the DHT's process. hivemind drops a peer from the routing table when a request to it
    fails and never dials it again by itself: after a partition heals, two islands that each
    lost the other would stay apart for good. A ping that answers puts both back."""

    async def one(peer_id: str, maddrs: list[str]) -> str | None:
        peer = PeerID.from_base58(peer_id)
        if peer in node.protocol.routing_table.peer_id_to_uid:
            return None
        try:  # p2pd may have forgotten the addresses; hivemind itself dials through its client like this
            await node.p2p._client.connect(peer, [Multiaddr(m) for m in maddrs])
        except Exception:  # noqa: BLE001 - the ping below says whether the peer is reachable
            pass
        if await node.protocol.call_ping(peer) is None:
            return None
        if peer in node.blacklist:  # its lookups were suspended while it did not answer
            node.blacklist.register_success(peer)
        return peer_id

    tasks = [asyncio.create_task(one(p, m)) for p, m in targets.items()]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    return [task.result() for task in done if not task.cancelled() and task.exception() is None and task.result()]


def dht_now() -> float:
    return get_dht_time()
