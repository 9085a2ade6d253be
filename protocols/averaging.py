"""Fragment averaging across islands: one hivemind averager per fragment, matched by round.

Each fragment p has its own `DecentralizedAverager` under the prefix
`<run>:frag<p>`. Before each round the island sets the averager's group key
to the round number, so islands meet in the same round of the same fragment
whatever their wall clocks say, and sets the target group size to the
number of live islands, so a round starts as soon as everyone is there. The
round is token-weighted (hivemind's `weight`); every network wait has a
bound, and a round that finds nobody or fails comes back as "failed" with
the island's own update.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, Uniform8BitQuantization
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from .diloco import Contribution, RoundResult

logger = logging.getLogger(__name__)

ROUND_BITS = 24  # the group key carries the round number modulo 2**24
BYTES_PER_VALUE = {"none": 4, "fp16": 2, "int8": 1}


def round_group_bits(round_: int) -> str:
    return format(round_ % (1 << ROUND_BITS), f"0{ROUND_BITS}b")


def compression_codec(name: str) -> CompressionBase:
    return {"none": NoCompression, "fp16": Float16Compression, "int8": Uniform8BitQuantization}[name]()


def allreduce_wire_bytes(num_values: int, group_size: int, compression: str) -> int:
    """Bytes one peer sends (and receives) in a butterfly all-reduce of equal shares:
    (n-1)/n of its vector out to the reducers, then (n-1)/n of the result back to the others."""
    if group_size <= 1:
        return 0
    return int(2 * num_values * BYTES_PER_VALUE[compression] * (group_size - 1) / group_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AveragingTimeouts:
    match_wait_s: float = 5.0
    """How long a round waits for the other islands before it runs with whoever came."""
    allreduce_s: float = 30.0
    """The all-reduce itself, once the group is formed."""
    next_chunk_s: float = 5.0
    """A peer that sends nothing for this long is dropped from the round."""
    request_s: float = 1.0
    """One matchmaking request."""


class IslandAverager(DecentralizedAverager):
    """hivemind's averager, with the group key and target size settable per round.

    Every island must use this class: hivemind names its RPCs after the class.
    """

    def set_round(self, group_bits: str, target_group_size: int) -> None:
        future = MPFuture()
        self._outer_pipe.send(("_set_round", [], dict(group_bits=group_bits, target_group_size=target_group_size, future=future)))
        future.result(timeout=10)

    async def _set_round(self, group_bits: str, target_group_size: int, future: MPFuture) -> None:
        mm = self._matchmaking
        mm.group_key_manager.group_bits = group_bits
        mm.target_group_size = target_group_size
        mm.potential_leaders.target_group_size = target_group_size
        future.set_result(None)


class FragmentAveraging:
    """The averaging side of Streaming DiLoCo: `average(contribution)` for any fragment."""

    def __init__(
        self,
        dht: DHT,
        run_id: str,
        shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
        compression: str,
        live_islands: Callable[[], int],
        timeouts: AveragingTimeouts = AveragingTimeouts(),
    ):
        self.timeouts = timeouts
        self.compression = compression
        self.live_islands = live_islands
        self.names = [[n for n, _ in frag] for frag in shapes]
        self.num_values = [sum(int(torch.Size(s).numel()) for _, s in frag) for frag in shapes]
        self.averagers = [
            IslandAverager(
                [torch.zeros(s, dtype=torch.float32) for _, s in frag],
                dht,
                start=True,
                prefix=f"{run_id}:frag{p}",
                min_group_size=2,
                min_matchmaking_time=min(2.0, timeouts.match_wait_s),
                request_timeout=timeouts.request_s,
                allreduce_timeout=timeouts.allreduce_s,
                next_chunk_timeout=timeouts.next_chunk_s,
                sender_timeout=timeouts.next_chunk_s / 2,
                reducer_timeout=timeouts.next_chunk_s,
                compression=compression_codec(compression),
                shutdown_timeout=2,
            )
            for p, frag in enumerate(shapes)
        ]

    async def average(self, contribution: Contribution) -> RoundResult:
        c = contribution
        expected = self.live_islands()
        if expected <= 1:
            return RoundResult(outcome="solo", delta=c.delta, group_size=1, weight=c.weight)
        averager = self.averagers[c.fragment]
        names = self.names[c.fragment]
        started = time.monotonic()
        await asyncio.to_thread(self._load, averager, names, c.delta)
        await asyncio.to_thread(averager.set_round, round_group_bits(c.round), expected)
        wait_s = self.timeouts.match_wait_s
        control = await asyncio.to_thread(
            averager.step,
            gather={"round": c.round, "step": c.step, "weight": c.weight},
            weight=max(c.weight, 1e-6),
            scheduled_time=get_dht_time() + wait_s,
            timeout=wait_s + 2 * self.timeouts.request_s,
            wait=False,
        )
        try:
            gathered = await asyncio.wait_for(asyncio.wrap_future(control), timeout=2 * wait_s + self.timeouts.allreduce_s)
        except BaseException:
            control.cancel()
            raise
        seconds = time.monotonic() - started
        if not gathered:
            return RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight, seconds=seconds)
        rounds = {m.get("round") for m in gathered.values() if isinstance(m, dict)}
        if rounds != {c.round}:
            logger.warning("fragment %d: group mixed rounds %s; keeping own update", c.fragment, rounds)
            return RoundResult(outcome="failed", delta=c.delta, group_size=1, weight=c.weight, seconds=seconds)
        delta = await asyncio.to_thread(self._read, averager, names)
        wire = allreduce_wire_bytes(self.num_values[c.fragment], len(gathered), self.compression)
        group_weight = sum(float(m.get("weight", 0.0)) for m in gathered.values())
        return RoundResult(
            outcome="ok", delta=delta, group_size=len(gathered), weight=group_weight,
            bytes_sent=wire, bytes_recv=wire, seconds=seconds,
        )

    @staticmethod
    def _load(averager: IslandAverager, names: list[str], delta: dict[str, torch.Tensor]) -> None:
        with averager.get_tensors() as tensors:
            for t, n in zip(tensors, names, strict=True):
                t.copy_(delta[n])

    @staticmethod
    def _read(averager: IslandAverager, names: list[str]) -> dict[str, torch.Tensor]:
        with averager.get_tensors() as tensors:
            return {n: t.detach().clone() for t, n in zip(tensors, names, strict=True)}

    def shutdown(self) -> None:
        for averager in self.averagers:
            try:
                averager.shutdown()
            except Exception as e:  # noqa: BLE001 - shutting down is best effort
                logger.debug("averager shutdown: %r", e)

