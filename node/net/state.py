"""A fragment's agreed state (values, outer momentum, round) from one island to another, over
libp2p streams: what a joiner, a restarted island, a stale member after its round (rebase) and a
satellite after its deposit download (`--rounds direct`; with `--rounds hivemind` the averagers'
state sharing does it).

Over libp2p, not the rounds' direct transport: a satellite or a peer behind NAT can dial an
island's libp2p address but need not be dialable itself, and the download is a request and its
answer on the requester's own stream.

Wire: the request is one `averaging_pb2.DownloadData` whose msgpack metadata names the fragment
(with a swarm key, with an admission tag bound to the requester and the fragment); the answer is a
stream of `DownloadData`, the first carrying the provider's metadata (peer id, step, round, run
id) or {"refused": why}, then the fragment's tensors (agreed values then momentum, layout order),
fp32, split for streaming. Donors are tried in the order given (the furthest island first,
records.state_donors).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming
from islands.protocols.admission import admission_tag, tag_valid

from .deposit import deserialize_parts

logger = logging.getLogger(__name__)

Provider = Callable[[int], tuple[dict, list[torch.Tensor]]]


def state_key(namespace: str, fragment: int) -> str:
    """What a state request's admission tag is bound to."""
    return f"{namespace}:state{fragment}"


class StateRefused(Exception):
    pass


class StateBox:
    """Both ends: an island `open`s it and serves the state `provider` gives; anyone `fetch`es."""

    def __init__(
        self, p2p: P2P, namespace: str, shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]], round_key: bytes | None = None,
        refuse_peer: Callable[[str], bool] = lambda peer: False, on_refused: Callable[[str], None] = lambda what: None,
    ):
        self.p2p, self.namespace, self.round_key = p2p, namespace, round_key
        self.shapes = [[tuple(s) for _, s in frag] for frag in shapes]
        self.refuse_peer = refuse_peer
        self.on_refused = on_refused
        self.handler_name = f"{namespace}::state"
        self.provider: Provider | None = None
        self._open = False

    async def open(self) -> None:
        await self.p2p.add_protobuf_handler(self.handler_name, self._rpc_state, averaging_pb2.DownloadData, stream_output=True)
        self._open = True

    async def close(self) -> None:
        if self._open:
            self._open = False
            try:
                await self.p2p.remove_protobuf_handler(self.handler_name, stream_output=True)
            except Exception as e:  # noqa: BLE001 - the daemon may be gone already
                logger.debug("removing the state handler: %r", e)

    # --- the island that gives -------------------------------------------------------------------

    def _why_refused(self, peer: str, request: averaging_pb2.DownloadData) -> tuple[str | None, int]:
        try:
            meta = MSGPackSerializer.loads(request.metadata)
            fragment = int(meta["fragment"])
        except Exception as e:  # noqa: BLE001 - whatever a stranger sent
            return f"bad request: {e!r}", -1
        if not 0 <= fragment < len(self.shapes):
            return f"no fragment {fragment}", fragment
        if self.refuse_peer(peer):
            return "banned peer", fragment
        if self.round_key is not None and not tag_valid(self.round_key, peer, state_key(self.namespace, fragment), meta.get("auth")):
            return "no valid tag for this swarm's key", fragment
        if self.provider is None:
            return "no state to give yet", fragment
        return None, fragment

    async def _rpc_state(self, request: averaging_pb2.DownloadData, context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        peer = context.remote_id.to_base58()
        why, fragment = self._why_refused(peer, request)
        if why is not None:
            if why != "no state to give yet":
                self.on_refused(f"state request from {peer}: {why}")
            yield averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps({"refused": why[:300]}))
            return
        meta, tensors = self.provider(fragment)
        chunks = await asyncio.to_thread(
            lambda: [c for t in tensors for c in split_for_streaming(serialize_torch_tensor(t.detach().to("cpu", torch.float32)))]
        )
        yield averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(meta))
        for chunk in chunks:
            yield averaging_pb2.DownloadData(tensor_part=chunk)

    # --- the peer that takes ---------------------------------------------------------------------

    async def fetch(self, donors: Sequence[str], fragment: int, timeout_s: float) -> tuple[dict, list[torch.Tensor]] | None:
        """(metadata, tensors) of `fragment` from the first of `donors` that gives it within
        `timeout_s` in all, or None."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for donor in donors:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                return await asyncio.wait_for(self._fetch_from(donor, fragment), timeout=left)
            except Exception as e:  # noqa: BLE001 - refused, gone, timed out, garbled: try the next
                logger.info("fragment %d: no state from %s: %r", fragment, donor, e)
        return None

    async def _fetch_from(self, donor: str, fragment: int) -> tuple[dict, list[torch.Tensor]]:
        me = self.p2p.peer_id.to_base58()
        request = {"fragment": fragment}
        if self.round_key is not None:
            request["auth"] = admission_tag(self.round_key, me, state_key(self.namespace, fragment))
        stream = await self.p2p.iterate_protobuf_handler(
            PeerID.from_base58(donor), self.handler_name, averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(request)),
            averaging_pb2.DownloadData,
        )
        meta, parts, nbytes = None, [], 0
        limit = 2 * 4 * sum(math.prod(s) for s in self.shapes[fragment]) * 1.25 + 65536
        async for message in stream:
            if meta is None:
                meta = MSGPackSerializer.loads(message.metadata)
                if not isinstance(meta, dict):
                    raise StateRefused("malformed metadata")
                if "refused" in meta:
                    raise StateRefused(str(meta["refused"]))
                continue
            nbytes += message.ByteSize()
            if nbytes > limit:
                raise StateRefused(f"more than {limit:.0f} bytes")
            parts.append(message.tensor_part)
        if meta is None:
            raise StateRefused("no answer")
        tensors = await asyncio.to_thread(deserialize_parts, parts, StateRefused)
        expected = self.shapes[fragment] * 2
        if [tuple(t.shape) for t in tensors] != expected:
            raise StateRefused(f"{len(tensors)} tensors of other shapes than the fragment's {len(expected)}")
        return meta, tensors
