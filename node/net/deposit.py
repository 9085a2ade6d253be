"""Satellites deposit their progress with an island instead of joining the islands' rounds.

A satellite's link is slow and its contact short: a round that had it as a
member would go at the speed of its link, and every island in the group would
wait for it. So a satellite in contact streams its accumulated pseudo-gradient,
with its staleness-discounted token weight, to one island (`send`); the island
keeps it (`DepositBox`) and folds it into its own contribution at its next round
of that fragment (outer.fold_deposits), where it counts as if the satellite had
been a member. The islands' rounds never include a satellite. The satellite then
takes the swarm's agreed values as its new base (a state download).

Wire: one stream of `averaging_pb2.DownloadData`, the first message carrying
msgpack metadata (fragment, round, weight, staleness, and with a swarm key an
admission tag), then each tensor of the fragment in layout order, serialized
with the run's codec and split for streaming. The island answers one
`DownloadData` whose metadata says {"accepted": bool, "why": reason}.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence

import torch
from hivemind.compression import CompressionBase, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from islands.protocols.admission import admission_tag, tag_valid

logger = logging.getLogger(__name__)

MAX_WIRE_RATIO = 1.25
"""A deposit may be at most this many times the fragment's fp32 size on the wire (headers, codec scales)."""
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
        self, p2p: P2P, namespace: str, shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]], codec: CompressionBase,
        round_key: bytes | None = None, refuse_peer: Callable[[str], bool] = lambda peer: False,
        on_refused: Callable[[str], None] = lambda what: None,
    ):
        """`refuse_peer(peer)`: whether to refuse a deposit from this peer (banned); `on_refused(what)`
        hears of every deposit this island refuses."""
        self.p2p, self.namespace, self.codec, self.round_key = p2p, namespace, codec, round_key
        self.names = [[n for n, _ in frag] for frag in shapes]
        self.shapes = [dict(frag) for frag in shapes]
        self.refuse_peer = refuse_peer
        self.handler_name = f"{namespace}::deposit"
        self.inbox: list[list[Deposit]] = [[] for _ in shapes]
        self.on_refused = on_refused
        self._open = False

    async def open(self) -> None:
        await self.p2p.add_protobuf_handler(self.handler_name, self._rpc_deposit, averaging_pb2.DownloadData, stream_input=True)
        self._open = True

    async def close(self) -> None:
        if self._open:
            self._open = False
            try:
                await self.p2p.remove_protobuf_handler(self.handler_name, stream_input=True)
            except Exception as e:  # noqa: BLE001 - the daemon may be gone already
                logger.debug("removing the deposit handler: %r", e)

    def take(self, fragment: int) -> list[Deposit]:
        """The deposits kept for this fragment, removed from the box."""
        got, self.inbox[fragment] = self.inbox[fragment], []
        return got

    # --- island end ---------------------------------------------------------

    async def _rpc_deposit(
        self, stream: AsyncIterator[averaging_pb2.DownloadData], context: P2PContext
    ) -> averaging_pb2.DownloadData:
        peer = context.remote_id.to_base58()
        try:
            deposit = await self._receive(peer, stream)
        except DepositRefused as e:
            self.on_refused(f"deposit from {peer}: {e}")
            logger.warning("refused a deposit from %s: %s", peer, e)
            return _answer(False, str(e))
        kept = self.inbox[deposit.fragment]
        kept.append(deposit)
        del kept[:-KEEP]
        logger.info("fragment %d: kept a deposit of %s (round %d, weight %.4g)", deposit.fragment, peer, deposit.round, deposit.weight)
        return _answer(True, "")

    async def _receive(self, peer: str, stream: AsyncIterator[averaging_pb2.DownloadData]) -> Deposit:
        if self.refuse_peer(peer):
            raise DepositRefused("banned peer")
        meta, parts, nbytes, limit = None, [], 0, None
        async for message in stream:
            if meta is None:
                meta = _metadata(message.metadata)
                p = meta["fragment"]
                if not 0 <= p < len(self.names):
                    raise DepositRefused(f"no fragment {p}")
                if self.round_key is not None and not tag_valid(
                    self.round_key, peer, deposit_key(self.namespace, p, meta["round"]), meta.get("auth")
                ):
                    raise DepositRefused("no valid tag for this swarm's key")
                limit = MAX_WIRE_RATIO * 4 * sum(math.prod(s) for s in self.shapes[p].values()) + 4096
            nbytes += message.ByteSize()
            if nbytes > limit:
                raise DepositRefused(f"more than {limit:.0f} bytes")
            if message.tensor_part.ByteSize():
                parts.append(message.tensor_part)
        if meta is None:
            raise DepositRefused("empty")
        p = meta["fragment"]
        tensors = await asyncio.to_thread(deserialize_parts, parts)
        names = self.names[p]
        if len(tensors) != len(names):
            raise DepositRefused(f"{len(tensors)} tensors for a fragment of {len(names)}")
        delta = dict(zip(names, tensors, strict=True))
        for n in names:
            if tuple(delta[n].shape) != tuple(self.shapes[p][n]):
                raise DepositRefused(f"{n}: shape {tuple(delta[n].shape)}")
            delta[n] = delta[n].to(torch.float32)
        return Deposit(peer, p, meta["round"], meta["weight"], meta["staleness"], delta, nbytes)

    # --- satellite end ------------------------------------------------------

    async def send(
        self, island: str, fragment: int, round_: int, delta: dict[str, torch.Tensor], weight: float, staleness: int,
        timeout_s: float,
    ) -> int:
        """Deposit one fragment's delta with `island`; the bytes sent. Raises on refusal, failure or timeout."""
        me = self.p2p.peer_id.to_base58()
        meta = {"fragment": fragment, "round": round_, "weight": float(weight), "staleness": int(staleness)}
        if self.round_key is not None:
            meta["auth"] = admission_tag(self.round_key, me, deposit_key(self.namespace, fragment, round_))
        tensors = [delta[n] for n in self.names[fragment]]
        chunks = await asyncio.to_thread(lambda: [c for t in tensors for c in split_for_streaming(serialize_torch_tensor(t, self.codec.compression_type))])
        sent = 0

        async def messages() -> AsyncIterator[averaging_pb2.DownloadData]:
            nonlocal sent
            first = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(meta))
            sent += first.ByteSize()
            yield first
            for chunk in chunks:
                message = averaging_pb2.DownloadData(tensor_part=chunk)
                sent += message.ByteSize()
                yield message

        reply = await asyncio.wait_for(
            self.p2p.call_protobuf_handler(PeerID.from_base58(island), self.handler_name, messages(), averaging_pb2.DownloadData),
            timeout=timeout_s,
        )
        try:
            answer = MSGPackSerializer.loads(reply.metadata)
            accepted, why = bool(answer["accepted"]), str(answer.get("why", ""))
        except Exception as e:  # noqa: BLE001 - a garbled answer
            raise DepositRefused(f"no answer: {e!r}") from None
        if not accepted:
            raise DepositRefused(why)
        return sent


class DepositRefused(Exception):
    pass


def _answer(accepted: bool, why: str) -> averaging_pb2.DownloadData:
    return averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps({"accepted": accepted, "why": why[:300]}))


def _metadata(raw: bytes) -> dict:
    try:
        meta = MSGPackSerializer.loads(raw)
        out = {
            "fragment": int(meta["fragment"]), "round": int(meta["round"]),
            "weight": float(meta["weight"]), "staleness": int(meta["staleness"]), "auth": meta.get("auth"),
        }
    except Exception as e:  # noqa: BLE001 - whatever a stranger sent
        raise DepositRefused(f"bad metadata: {e!r}") from None
    if not (math.isfinite(out["weight"]) and out["weight"] >= 0 and out["staleness"] >= 0):
        raise DepositRefused("bad weight or staleness")
    return out


def deserialize_parts(parts: list, error: type[Exception] = DepositRefused) -> list[torch.Tensor]:
    """Tensors from streamed parts: a part with a dtype starts a new tensor (hivemind's split_for_streaming);
    `error` for a malformed one."""
    tensors, current = [], []
    try:
        for part in parts:
            if part.dtype and current:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(current)))
                current = []
            current.append(part)
        if current:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(current)))
    except Exception as e:  # noqa: BLE001 - a malformed tensor
        raise error(f"malformed tensor: {e!r}") from None
    return tensors
