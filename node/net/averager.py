"""hivemind's averager, one per fragment: the group key and target size set per round, join
requests checked against the swarm key, and the parts each member reduces recorded."""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Callable, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionBase
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.mpfuture import MPFuture
from islands.protocols.admission import tag_valid

ROUND_BITS = 24  # the group key carries the round number modulo 2**24
PHASES = ("delta", "global", "momentum")


def round_group_bits(round_: int, phase: str = "delta") -> str:
    """The group key of one phase of one round: islands meet only in the same round and phase."""
    key = round_ * len(PHASES) + PHASES.index(phase)
    return format(key % (1 << ROUND_BITS), f"0{ROUND_BITS}b")


def reducer_spans(tensors: Sequence[torch.Tensor], peer_fractions: Sequence[float], kwargs: dict) -> dict[int, list[list[int]]]:
    """Which elements of the flattened `tensors` each group member (by index) reduces in hivemind's
    butterfly all-reduce: hivemind's own TensorPartContainer split, read back from its part views."""
    allowed = ("compression", "part_size_bytes", "tensor_infos")
    container = TensorPartContainer(
        [t.detach() for t in tensors], peer_fractions, **{k: v for k, v in kwargs.items() if k in allowed}
    )
    # hivemind deals the parts out in order along the flattened vector, member by member
    spans: dict[int, list[list[int]]] = {}
    offset = 0
    for index, parts in enumerate(container._input_parts_by_peer):
        for part, _ in parts:
            ranges = spans.setdefault(index, [])
            if ranges and ranges[-1][1] == offset:
                ranges[-1][1] = offset + part.numel()
            else:
                ranges.append([offset, offset + part.numel()])
            offset += part.numel()
    return spans


class IslandAverager(DecentralizedAverager):
    """hivemind's averager, with the group key and target size settable per round.

    Every island must use this class: hivemind names its RPCs after the class.
    What a joiner downloads from it (`get_current_state`, run in the island's own
    process) comes from `state_provider`, set by the island.
    """

    state_provider: Callable[[], tuple[dict, list[torch.Tensor]]] | None = None
    round_key: bytes | None = None
    """With a swarm key: the key of the admission tags every join request must carry."""
    on_refused: Callable[[str], None] = staticmethod(lambda what: None)
    """Called (in the averager's process) for every join request this island refuses as leader."""
    banned: frozenset[str] = frozenset()

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:  # noqa: UP006 - hivemind's servicer
        # spots a streaming handler by typing's hint only (not collections.abc's)
        why = self._refuse_join(request, context)
        if why is not None:
            self.on_refused(why)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_KEY)
            return
        # closed with this one, at once: hivemind's own generator releases the leader's state in its finally
        async with contextlib.aclosing(super().rpc_join_group(request, context)) as stream:
            async for message in stream:
                yield message

    def _refuse_join(self, request: averaging_pb2.JoinRequest, context) -> str | None:
        """Why a join request is refused here (a banned peer, or no valid admission tag), or None."""
        peer = context.remote_id.to_base58()
        if peer in self.banned:
            return f"round join from banned peer {peer}"
        if self.round_key is None:
            return None
        try:
            _, _, user_data = MSGPackSerializer.loads(request.gather)
            tag = MSGPackSerializer.loads(user_data).get("auth")
        except Exception:  # noqa: BLE001 - whatever a stranger sent
            tag = None
        if not tag_valid(self.round_key, peer, self._matchmaking.group_key_manager.current_key, tag):
            return f"round join from {peer} without this swarm's key"
        return None

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        self._spans = reducer_spans(tensors, kwargs["peer_fractions"], kwargs)
        return await super()._run_allreduce_inplace_(tensors, group_info, group_id=group_id, **kwargs)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        """hivemind's, plus each member's `span`: the elements it reduced, as [start, end) ranges of the
        flattened tensors, so a round spoiled by a reducer can be blamed on it."""
        self._spans = {}
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        for index, peer in enumerate(group_info.peer_ids):
            if isinstance(gathered.get(peer), dict):
                gathered[peer]["span"] = self._spans.get(index, [])
        return gathered

    def get_current_state(self):
        if self.state_provider is None:
            return None, [], None
        metadata, tensors = self.state_provider()
        return metadata, [t.detach().cpu().contiguous() for t in tensors], None

    def set_round(self, group_bits: str, target_group_size: int, compression: CompressionBase, banned: frozenset[str] = frozenset()) -> None:
        future = MPFuture()
        kwargs = dict(group_bits=group_bits, target_group_size=target_group_size, compression=compression, banned=banned, future=future)
        self._outer_pipe.send(("_set_round", [], kwargs))
        future.result(timeout=10)

    async def _set_round(
        self, group_bits: str, target_group_size: int, compression: CompressionBase, banned: frozenset[str], future: MPFuture
    ) -> None:
        mm = self._matchmaking
        mm.group_key_manager.group_bits = group_bits
        mm.target_group_size = target_group_size
        mm.potential_leaders.target_group_size = target_group_size
        self.allreduce_kwargs["compression"] = compression
        self.banned = frozenset(banned)
        if not getattr(mm, "_skips_banned_leaders", False):  # never follow a banned leader either
            request_join = mm._request_join_group

            async def request_join_unless_banned(leader):
                if leader.to_base58() in self.banned:
                    return None
                return await request_join(leader)

            mm._request_join_group = request_join_unless_banned
            mm._skips_banned_leaders = True
        future.set_result(None)
