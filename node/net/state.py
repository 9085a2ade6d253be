"""A fragment's agreed state (values, outer momentum, round) from one island to another, over
libp2p streams (streams.py): what a joiner, a restarted island, a stale member after its round
(rebase) and a satellite after its deposit download.

Wire: the request is a message naming the fragment, the codec the values are wanted in, whether
the momentum is too (with a swarm key, an admission tag bound to the requester and the fragment);
the answer is a message with the provider's metadata (peer id, step, round, run id) or
{"refused": why}, then the fragment's agreed values as one part in that codec and, if asked, its
momentum as one part in fp32 (flat, layout order). A joiner or a rebasing member asks for both,
exact; a satellite after its deposit only for the values, compressed (parts.values_codec): it
keeps its own momentum, which it never uses for an outer step. Donors are tried in the order
given (the furthest island first, records.state_donors).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import torch
from hivemind.p2p import P2P, PeerID
from islands.protocols.admission import admission_tag, tag_valid
from islands.protocols.parts import CODECS, PartError, encode_part

from . import streams

logger = logging.getLogger(__name__)

Provider = Callable[[int], tuple[dict, list[torch.Tensor]] | None]
"""A fragment's (metadata, tensors), or None while the island has none to give."""
NOTHING_YET = "no state to give yet"


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
        await self.p2p.add_binary_stream_handler(self.handler_name, self._on_stream)
        self._open = True

    async def close(self) -> None:
        if self._open:
            self._open = False
            try:
                await self.p2p.remove_binary_stream_handler(self.handler_name)
            except Exception as e:  # noqa: BLE001 - the daemon may be gone already
                logger.debug("removing the state handler: %r", e)

    # --- the island that gives -------------------------------------------------------------------

    def _why_refused(self, peer: str, request: dict) -> tuple[str | None, int]:
        try:
            fragment = int(request["fragment"])
        except (KeyError, TypeError, ValueError) as e:
            return f"bad request: {e!r}", -1
        if not 0 <= fragment < len(self.shapes):
            return f"no fragment {fragment}", fragment
        if request.get("values", "none") not in CODECS:
            return f"no codec {request.get('values')!r}", fragment
        if self.refuse_peer(peer):
            return "banned peer", fragment
        if self.round_key is not None and not tag_valid(self.round_key, peer, state_key(self.namespace, fragment), request.get("auth")):
            return "no valid tag for this swarm's key", fragment
        if self.provider is None:
            return NOTHING_YET, fragment
        return None, fragment

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        try:
            try:
                request = await asyncio.wait_for(streams.read_message(reader), 30.0)
            except (PartError, asyncio.IncompleteReadError, TimeoutError) as e:
                request = {"malformed": repr(e)}
            why, fragment = self._why_refused(peer, request)
            got = self.provider(fragment) if why is None else None
            if why is None and got is None:
                why = NOTHING_YET  # the provider's values are not the swarm's (IslandCore.unsound)
            if why is not None:
                if why != NOTHING_YET:
                    self.on_refused(f"state request from {peer}: {why}")
                await streams.send(writer, streams.message({"refused": why[:300]}))
                return
            meta, tensors = got
            half = len(tensors) // 2
            codec, momentum = str(request.get("values", "none")), bool(request.get("momentum", True))

            def encode() -> list[memoryview]:
                parts = [encode_part(streams.flat(tensors[:half]), 1.0, codec)]
                if momentum:
                    parts.append(encode_part(streams.flat(tensors[half:]), 1.0, "none"))
                return parts

            parts = await asyncio.to_thread(encode)
            await streams.send(writer, streams.message(meta), *parts)
        except (ConnectionError, OSError) as e:
            logger.info("state for %s: the stream broke: %r", peer, e)
        finally:
            writer.close()

    # --- the peer that takes ---------------------------------------------------------------------

    async def fetch(
        self, donors: Sequence[str], fragment: int, timeout_s: float, codec: str = "none", momentum: bool = True,
        min_round: int = 0,
    ) -> tuple[dict, list[torch.Tensor]] | None:
        """(metadata, tensors) of `fragment` from the first of `donors` that gives it within
        `timeout_s` in all, or None: the agreed values in `codec`, then (`momentum`) the momentum;
        the metadata's "wire_bytes" says how many bytes of values came. A donor whose fragment is
        at a round before `min_round` is left at its metadata for the next."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for donor in donors:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                return await asyncio.wait_for(self._fetch_from(donor, fragment, codec, momentum, min_round), timeout=left)
            except Exception as e:  # noqa: BLE001 - refused, gone, timed out, garbled: try the next
                logger.info("fragment %d: no state from %s: %r", fragment, donor, e)
        return None

    async def _fetch_from(self, donor: str, fragment: int, codec: str, momentum: bool, min_round: int = 0) -> tuple[dict, list[torch.Tensor]]:
        me = self.p2p.peer_id.to_base58()
        request = {"fragment": fragment, "values": codec, "momentum": momentum}
        if self.round_key is not None:
            request["auth"] = admission_tag(self.round_key, me, state_key(self.namespace, fragment))
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(donor), self.handler_name)
        try:
            await streams.send(writer, streams.message(request))
            meta = await streams.read_message(reader)
            if "refused" in meta:
                raise StateRefused(str(meta["refused"]))
            if int(meta.get("round", 0)) < min_round:
                raise StateRefused(f"its fragment is at round {meta.get('round')}, before {min_round}")
            shapes, got = self.shapes[fragment], 0
            tensors: list[torch.Tensor] = []
            for wanted in [codec, "none"][: 1 + momentum]:
                part, head, size = await streams.read_head(reader)
                if part["codec"] != wanted or int(part["numel"]) != streams.numel(shapes):
                    raise StateRefused(f"a part of {part['numel']} values in {part['codec']}, not the fragment's in {wanted}")
                _, values = await streams.read_rest(reader, head, size)
                tensors += streams.unflat(values, shapes)
                got += size
        finally:
            writer.close()
        return {**meta, "wire_bytes": got}, tensors
