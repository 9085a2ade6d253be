"""An island of several ranks: torch.distributed data parallelism inside one island.

Rank 0 is the island: it alone joins the DHT, averages fragments, checkpoints
and logs. Every rank trains the same model on its own batches of the island's
shard, with the gradients averaged among the ranks (DistributedDataParallel;
gloo on CPU, NCCL on GPU), so the ranks stay identical through inner steps.
What changes the model outside an inner step happens on rank 0 only (a resume,
a download when joining, mixing an averaged fragment in); rank 0 tells the
others before each step which fragments changed and broadcasts them:

    start:      header [shard, data seed] -> DDP wrap (broadcasts every parameter) -> inner optimizer state
    each step:  control [go, step, bitmask of changed fragments, micro-batches] -> those fragments' parameters
    end:        control [stop] -> checksum spread (are the ranks still identical?)

A rank that dies breaks the next collective on the others (gloo reports a
closed connection at once; a frozen rank times out after `timeout_s`): the
island stops and leaves the swarm, and the launcher takes the other ranks down.

Launch with `islands-node --nproc N ...` (rank 0 is the node process itself;
the workers are its children, in its process group), or under torchrun
(`torchrun --nproc-per-node N -m islands.node ...`): the ranks are read from
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import logging
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TIMEOUT_S = 300.0
"""A collective that does not complete in this long (a frozen rank) fails, at the least (the daemon
allows for rank 0's wait for islands and its download before the first step)."""


class RankFailure(RuntimeError):
    """Another rank of this island is gone (or frozen): the island cannot go on."""


@dataclasses.dataclass(frozen=True)
class RankEnv:
    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RankEnv | None:
        """The ranks torchrun (or our launcher) set, or None for a single-process island."""
        try:
            world = int(environ.get("WORLD_SIZE", "1"))
            rank = int(environ.get("RANK", "0"))
            local = int(environ.get("LOCAL_RANK", str(rank)))
        except ValueError:
            return None
        if world <= 1:
            return None
        if not 0 <= rank < world:
            raise ValueError(f"RANK {rank} is not in 0..{world - 1}")
        return cls(rank, world, local)


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """--device: auto is cuda (this rank's GPU) where there is one, else cpu."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {requested}: no CUDA device here (torch {torch.__version__})")
        index = int(requested[5:]) if requested.startswith("cuda:") else local_rank % torch.cuda.device_count()
        return torch.device("cuda", index)
    return torch.device("cpu")


def fragment_mask(fragments: set[int]) -> int:
    return sum(1 << f for f in fragments)


def mask_fragments(mask: int, count: int) -> list[int]:
    return [f for f in range(count) if mask >> f & 1]


@contextlib.contextmanager
def _collective(transport_only: bool = False):
    """A collective that fails (a rank gone or frozen) raises RankFailure. torch reports it as a
    RuntimeError (DistBackendError is one); with `transport_only`, only one that names the backend
    or the connection, so that other errors of the code around it pass unchanged."""
    try:
        yield
    except RuntimeError as e:
        text = str(e).lower()
        if transport_only and not isinstance(e, dist.DistBackendError) and not any(w in text for w in ("gloo", "nccl", "connection")):
            raise
        raise RankFailure(f"a rank of this island is gone: {e}") from None


class RankGroup:
    """This island's ranks: rank 0 drives (start, before_step, stop); the others follow (serve)."""

    def __init__(self, env: RankEnv, device: torch.device, layout: Sequence[Sequence[str]], timeout_s: float = TIMEOUT_S):
        self.env = env
        self.device = device
        self.layout = [list(names) for names in layout]
        self.changed: set[int] = set()
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=env.rank, world_size=env.world, timeout=datetime.timedelta(seconds=timeout_s))
        # control messages travel on the compute device for NCCL, on CPU for gloo
        self._ctl_device = device if backend == "nccl" else torch.device("cpu")

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world(self) -> int:
        return self.env.world

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        with _collective():
            dist.broadcast(tensor, src=0)
        return tensor

    def _ints(self, values: Sequence[int]) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64, device=self._ctl_device)
        return [int(x) for x in self._broadcast(t).tolist()]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP around the model (every parameter broadcast from rank 0 as it is built). Experts that
        no token of a batch reached have no gradient: find_unused_parameters."""
        from torch.nn.parallel import DistributedDataParallel

        with _collective():
            return DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=True,
            )

    def share_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank takes rank 0's inner optimizer state (a resume)."""
        box = [optimizer.state_dict() if self.rank == 0 else None]
        with _collective():
            dist.broadcast_object_list(box, src=0, device=self._ctl_device)
        if self.rank:
            optimizer.load_state_dict(box[0])

    def all_mean(self, values: Sequence[float]) -> list[float]:
        """The ranks' mean of a few numbers (the step's loss)."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self._ctl_device)
        with _collective():
            dist.all_reduce(t)
        return [float(x) / self.world for x in t.tolist()]

    def attach(self, trainer) -> None:
        """Make `trainer` (node/trainer.py) one of the ranks: DDP around its model, rank 0's inner
        optimizer state, and the step's loss averaged over the ranks."""
        trainer.forward = self.wrap(trainer.model)
        self.share_optimizer(trainer.optimizer)
        trainer.mean = self.all_mean

    def guard(self, fn, *args):
        """Run an inner step (DDP's gradient all-reduce is inside it): a failed collective there is a
        RankFailure; any other error is the step's own."""
        with _collective(transport_only=True):
            return fn(*args)

    # --- rank 0 ----------------------------------------------------------

    def header(self, shard: int, data_seed: int) -> None:
        self._ints([shard, data_seed])

    def mark(self, fragment: int) -> None:
        """Rank 0 changed this fragment's parameters outside an inner step."""
        self.changed.add(fragment)

    def before_step(self, step: int, params: Mapping[str, torch.Tensor], accum: int = 1) -> None:
        """Rank 0: tell the others to take a step (of `accum` micro-batches), with the fragments that
        changed since the last one."""
        changed, self.changed = sorted(self.changed), set()
        self._ints([1, step, fragment_mask(set(changed)), accum])
        self._send_fragments(changed, params)

    def stop(self, params: Mapping[str, torch.Tensor]) -> float | None:
        """Rank 0: the others leave their loop; returns how far apart the ranks' parameters ended
        (max minus min of a float64 checksum: 0 when they are identical), None if a rank is gone."""
        try:
            self._ints([0, 0, 0, 0])
            return self.spread(params)
        except RankFailure:
            return None

    def spread(self, params: Mapping[str, torch.Tensor]) -> float:
        """Every rank: max minus min over the ranks of the sum of all parameters (float64)."""
        with torch.no_grad():
            total = sum(float(p.detach().double().sum()) for p in params.values())
        t = torch.tensor([total, -total], dtype=torch.float64, device=self._ctl_device)
        with _collective():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0] + t[1])

    def _send_fragments(self, fragments: Sequence[int], params: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for f in fragments:
                for n in self.layout[f]:
                    self._broadcast(params[n].data)

    # --- ranks 1.. -------------------------------------------------------

    def receive_header(self) -> tuple[int, int]:
        shard, data_seed = self._ints([0, 0])
        return shard, data_seed

    def next_step(self, params: Mapping[str, torch.Tensor]) -> tuple[int, int] | None:
        """A follower: (step, micro-batches) to take, after taking the changed fragments; None to stop."""
        go, step, mask, accum = self._ints([0, 0, 0, 0])
        if not go:
            self.spread(params)
            return None
        self._send_fragments(mask_fragments(mask, len(self.layout)), params)
        return step, accum

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot always be torn down cleanly
                pass


def free_port() -> int:
    """A port free on 127.0.0.1 now (a rendezvous port; a node behind a relay in the tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # in the worker, before exec: SIGKILL when the node goes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch_workers(argv: Sequence[str], nproc: int, environ: Mapping[str, str]) -> tuple[dict[str, str], list[subprocess.Popen]]:
    """`islands-node --nproc N`: start ranks 1..N-1 as children (same options); returns the environment
    rank 0 runs under and the workers. They die with the node (parent-death signal, process group)."""
    port = free_port()
    base = {**environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "islands.node", *argv],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
        )
        for r in range(1, nproc)
    ]
    return {**base, "RANK": "0", "LOCAL_RANK": "0"}, workers


def stop_workers(workers: Sequence[subprocess.Popen], timeout_s: float = 10.0) -> None:
    for w in workers:
        if w.poll() is None:
            try:
                w.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait(timeout=10)
