"""The swarm's DHT: start or join it, publish and read the run manifest and the island records."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from .records import RECORD_TTL_S, IslandRecord, parse_island_record

logger = logging.getLogger(__name__)

MANIFEST_TTL_S = 300.0
DHT_TIMEOUT_S = 10.0


class SwarmDHT:
    """The run's records on a hivemind DHT. Every call is bounded by DHT_TIMEOUT_S."""

    def __init__(self, dht: DHT, run_id: str):
        self.dht = dht
        self.run_id = run_id
        self.manifest_key = f"{run_id}:manifest"
        self.islands_key = f"{run_id}:islands"
        self.malformed_records = 0

    @classmethod
    def start(
        cls,
        run_id: str,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        identity_path: str | None = None,
        client_mode: bool = False,
    ) -> SwarmDHT:
        kwargs: dict[str, Any] = dict(host_maddrs=list(host_maddrs), client_mode=client_mode)
        if announce_maddrs:
            kwargs["announce_maddrs"] = list(announce_maddrs)
        if identity_path:
            kwargs["identity_path"] = identity_path
        dht = DHT(initial_peers=list(initial_peers), start=True, **kwargs)
        return cls(dht, run_id)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), timeout=DHT_TIMEOUT_S)

    async def get_manifest(self) -> dict | None:
        found = await self._call(self.dht.get, self.manifest_key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return None
        return found.value

    async def store_manifest(self, manifest: dict) -> bool:
        return bool(await self._call(self.dht.store, self.manifest_key, manifest, get_dht_time() + MANIFEST_TTL_S))

    async def store_island(self, record: IslandRecord, ttl_s: float = RECORD_TTL_S) -> bool:
        return bool(
            await self._call(self.dht.store, self.islands_key, record.to_value(), get_dht_time() + ttl_s, subkey=record.peer_id)
        )

    async def islands(self) -> dict[str, IslandRecord]:
        found = await self._call(self.dht.get, self.islands_key, latest=True)
        out: dict[str, IslandRecord] = {}
        if found is None or not isinstance(found.value, dict):
            return out
        for peer_id, item in found.value.items():
            record = parse_island_record(peer_id, getattr(item, "value", None))
            if record is None:
                self.malformed_records += 1
                continue
            out[peer_id] = record
        return out

    def shutdown(self) -> None:
        self.dht.shutdown()


def dht_now() -> float:
    return get_dht_time()
