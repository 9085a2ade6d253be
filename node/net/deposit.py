"""Satellites deposit their progress with an island instead of joining the islands' rounds.

A satellite's link is slow and its contact short: a round that had it as a
member would go at the speed of its link, and every island in the group would
wait for it. So a satellite in contact streams its accumulated pseudo-gradient,
with its staleness-discounted token weight, to one island (`send`); the island
keeps it (`DepositBox`) and folds it into its own contribution at its next round
of that fragment (outer.fold_deposits), where it counts as if the satellite had
been a member. The islands' rounds never include a satellite. The satellite then
takes the swarm's agreed values as its new base (a state download).

Wire (streams.py): the satellite opens a libp2p stream and sends the fragment's delta as one part
in the run's codec (flat, layout order), its meta holding the fragment, round and staleness (with
a swarm key, an admission tag), its weight the staleness-discounted token weight; the island reads
the meta first and refuses before the values come (a banned peer, no such fragment, a bad tag, not
the fragment's size), then answers with a message {"accepted": bool, "why": reason}.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch
from hivemind.p2p import P2P, PeerID
from islands.protocols.admission import admission_tag, tag_valid
from islands.protocols.parts import PartError, encode_part

from . import streams

logger = logging.getLogger(__name__)

KEEP = 8
"""Deposits an island keeps per fragment until its next round; the oldest goes first."""


@dataclasses.dataclass
class Deposit:
    peer: str
    fragment: int
    round: int
    weight: float
    staleness: int
    delta: dict[str, torch.Tensor]
    nbytes: int


def deposit_key(namespace: str, fragment: int, round_: int) -> str:
    """What a deposit's admission tag is bound to (a swarm key's rounds key signs it)."""
    return f"{namespace}:deposit{fragment}.{round_}"


class DepositBox:
    """Both ends: an island `open`s it to take deposits; a satellite `send`s with it."""

    def __init__(
        self, p2p: P2P, namespace: str, shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]], compression: str,
        round_key: bytes | None = None, refuse_peer: Callable[[str], bool] = lambda peer: False,
        on_refused: Callable[[str], None] = lambda what: None, receive_s: float = 60.0,
    ):
        """`compression`: the codec a satellite sends in; `refuse_peer(peer)`: whether to refuse a
        deposit from this peer (banned); `on_refused(what)` hears of every deposit this island
        refuses; `receive_s`: how long a deposit may take to arrive."""
        self.p2p, self.namespace, self.compression, self.round_key = p2p, namespace, compression, round_key
        self.names = [[n for n, _ in frag] for frag in shapes]
        self.shapes = [dict(frag) for frag in shapes]
        self.refuse_peer = refuse_peer
        self.handler_name = f"{namespace}::deposit"
        self.inbox: list[list[Deposit]] = [[] for _ in shapes]
        self.on_refused = on_refused
        self.receive_s = receive_s
        self._open = False

    async def open(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._on_stream)
        self._open = True

    async def close(self) -> None:
        if self._open:
            self._open = False
            try:
                await self.p2p.remove_binary_stream_handler(self.handler_name)
            except Exception as e:  # noqa: BLE001 - the daemon may be gone already
                logger.debug("removing the deposit handler: %r", e)

    def take(self, fragment: int) -> list[Deposit]:
        """The deposits kept for this fragment, removed from the box."""
        got, self.inbox[fragment] = self.inbox[fragment], []
        return got

    # --- island end ---------------------------------------------------------

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        try:
            try:
                deposit = await asyncio.wait_for(self._receive(peer, reader), self.receive_s)
            except (DepositRefused, PartError, asyncio.IncompleteReadError, TimeoutError) as e:
                why = str(e) if isinstance(e, DepositRefused | PartError) else f"incomplete: {type(e).__name__}"
                self.on_refused(f"deposit from {peer}: {why}")
                logger.warning("refused a deposit from %s: %s", peer, why)
                await streams.send(writer, streams.message({"accepted": False, "why": why[:300]}))
                return
            kept = self.inbox[deposit.fragment]
            kept.append(deposit)
            del kept[:-KEEP]
            logger.info("fragment %d: kept a deposit of %s (round %d, weight %.4g)", deposit.fragment, peer, deposit.round, deposit.weight)
            await streams.send(writer, streams.message({"accepted": True, "why": ""}))
        except (ConnectionError, OSError) as e:
            logger.info("deposit from %s: the stream broke: %r", peer, e)
        finally:
            writer.close()

    async def _receive(self, peer: str, reader: asyncio.StreamReader) -> Deposit:
        if self.refuse_peer(peer):
            raise DepositRefused("banned peer")
        meta, head, size = await streams.read_head(reader)
        p, round_, staleness = _metadata(meta)
        if not 0 <= p < len(self.names):
            raise DepositRefused(f"no fragment {p}")
        if self.round_key is not None and not tag_valid(self.round_key, peer, deposit_key(self.namespace, p, round_), meta.get("auth")):
            raise DepositRefused("no valid tag for this swarm's key")
        shapes = [self.shapes[p][n] for n in self.names[p]]
        if int(meta["numel"]) != streams.numel(shapes):
            raise DepositRefused(f"{meta['numel']} values for a fragment of {streams.numel(shapes)}")
        meta, values = await streams.read_rest(reader, head, size)
        delta = dict(zip(self.names[p], streams.unflat(values, shapes), strict=True))
        return Deposit(peer, p, round_, float(meta["weight"]), staleness, delta, size)

    # --- satellite end ------------------------------------------------------

    async def send(
        self, island: str, fragment: int, round_: int, delta: dict[str, torch.Tensor], weight: float, staleness: int,
        timeout_s: float,
    ) -> int:
        """Deposit one fragment's delta with `island`; the bytes sent. Raises on refusal, failure or timeout."""
        me = self.p2p.peer_id.to_base58()
        meta = {"fragment": fragment, "round": round_, "staleness": int(staleness)}
        if self.round_key is not None:
            meta["auth"] = admission_tag(self.round_key, me, deposit_key(self.namespace, fragment, round_))
        values = streams.flat([delta[n] for n in self.names[fragment]])
        part = await asyncio.to_thread(encode_part, values, weight, self.compression, meta)

        async def exchange() -> tuple[int, dict]:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(island), self.handler_name)
            try:
                sent = await streams.send(writer, part)
                return sent, await streams.read_message(reader)
            finally:
                writer.close()

        try:
            sent, answer = await asyncio.wait_for(exchange(), timeout=timeout_s)
            accepted, why = bool(answer["accepted"]), str(answer.get("why", ""))
        except (PartError, KeyError, asyncio.IncompleteReadError) as e:
            raise DepositRefused(f"no answer: {e!r}") from None
        if not accepted:
            raise DepositRefused(why)
        return sent


class DepositRefused(Exception):
    pass


def _metadata(meta: dict) -> tuple[int, int, int]:
    """(fragment, round, staleness) of a deposit's meta; DepositRefused if they are not there."""
    try:
        out = int(meta["fragment"]), int(meta["round"]), int(meta["staleness"])
    except (KeyError, TypeError, ValueError) as e:
        raise DepositRefused(f"bad metadata: {e!r}") from None
    if out[2] < 0:
        raise DepositRefused("bad staleness")
    return out
