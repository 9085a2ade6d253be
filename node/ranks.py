"""An island of several ranks: torch.distributed data parallelism inside one island.

Rank 0 is the island: it alone joins the DHT, averages fragments, checkpoints
and logs. Every rank trains the same model on its own batches of the island's
shard, with the gradients averaged among the ranks (DistributedDataParallel;
gloo on CPU, NCCL on GPU), so the ranks stay identical through inner steps.
What changes the model outside an inner step happens on rank 0 only (a resume,
a download when joining, mixing an averaged fragment in); rank 0 tells the
others before each step which fragments changed and broadcasts them. Every
order is a control message [op, step, fragment bitmask, micro-batches]:

    start:   header [shard, data seed] -> wrap (every parameter from rank 0) -> inner optimizer state
    STEP:    the changed fragments' parameters, then an inner step of that many micro-batches
    GATHER:  (sharded) the fragments' parameters, one tensor at a time, to rank 0
    SCATTER: the changed fragments' parameters, from rank 0
    EVAL:    (sharded) every rank runs the evaluation with rank 0
    STOP:    checksum spread (are the ranks still identical?), then leave

Two ways to split an island's work (`--parallel`):

- ddp: every rank holds the whole model (DistributedDataParallel averages the gradients).
- fsdp: FSDP2 `fully_shard` (per block, then the root): each rank holds 1/N of every
  parameter, its gradient and its inner optimizer state. Rank 0 keeps a full CPU copy of the
  parameters for Streaming DiLoCo (`ShardedParams`); a fragment is gathered into it when
  DiLoCo reads it, one tensor at a time, so the extra accelerator memory of a round is one
  tensor of one fragment, and the copy is scattered back when DiLoCo changed it.

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
import dataclasses
import datetime
import logging
import threading
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from .timeouts import Timeouts

logger = logging.getLogger(__name__)

TIMEOUT_S = Timeouts.ranks_s
"""A collective that does not complete in this long (a frozen rank) fails, at the least (Timeouts.ranks_wait_s
allows for rank 0's wait for islands and its download before the first step)."""


class ShardedParams(Mapping[str, torch.Tensor]):
    """Rank 0 of a sharded island: every parameter by name, as a full CPU tensor. Reading one
    gathers its fragment from the ranks first, unless that copy is current; a fragment written
    through it must be marked (`RankGroup.mark`, Streaming DiLoCo's `on_local_change`), and is
    scattered to the ranks before the next step."""

    def __init__(self, group: RankGroup):
        self.group = group
        self.fragment_of = {n: f for f, names in enumerate(group.layout) for n in names}

    def __getitem__(self, name: str) -> torch.Tensor:
        self.group.pull(self.fragment_of[name])
        return self.group.mirror[name]

    def __iter__(self):
        return iter(self.group.mirror)

    def __len__(self) -> int:
        return len(self.group.mirror)


def layer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one: the elements of the outermost module lists (a
    transformer's blocks or layers; the experts inside a block go with their block)."""
    lists: list[str] = []
    out: list[torch.nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and not any(name.startswith(outer + ".") for outer in lists):
            lists.append(name)
            out.extend(module)
    return out


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


STOP, STEP, GATHER, SCATTER, EVAL = range(5)
"""Control ops, rank 0 to the others."""


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

    def __init__(
        self, env: RankEnv, device: torch.device, layout: Sequence[Sequence[str]] | None, timeout_s: float = TIMEOUT_S,
        sharded: bool = False,
    ):
        """`sharded`: FSDP2 (--parallel fsdp) instead of DDP; `layout`: the fragments (a task's is set
        later, once it is built: `set_layout`)."""
        self.env = env
        self.device = device
        self.layout = [list(names) for names in layout or []]
        self.sharded = sharded
        self.changed: set[int] = set()
        self.fresh: set[int] = set()
        """Sharded, rank 0: fragments whose full copy is current (gathered, or written since the last step)."""
        self.params: dict[str, torch.Tensor] = {}
        """This rank's parameters once wrapped (sharded: DTensors holding this rank's shard)."""
        self.mirror: dict[str, torch.Tensor] = {}
        """Sharded, rank 0: the full CPU copy of every parameter (see ShardedParams)."""
        self.model: torch.nn.Module | None = None
        """Sharded: the model, FSDP2 modules from the root down."""
        self._thread: int | None = None
        """The thread that drives the protocol (the first to send or receive an order)."""
        self.gather_peak_bytes = 0
        """Sharded: the most bytes of gathered full tensors held at once on this rank's device."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.owns_group = not dist.is_initialized()
        """False where the caller made the process group (a user's loop under `attach`): it stays theirs."""
        if self.owns_group:
            dist.init_process_group(backend, rank=env.rank, world_size=env.world, timeout=datetime.timedelta(seconds=timeout_s))
        elif (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world):
            raise ValueError(f"the process group is rank {dist.get_rank()} of {dist.get_world_size()}, the environment says {env.rank} of {env.world}")
        else:
            backend = dist.get_backend()
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
        """A control message (every order of the protocol starts with one)."""
        self._check_thread()
        t = torch.tensor(list(values), dtype=torch.int64, device=self._ctl_device)
        return [int(x) for x in self._broadcast(t).tolist()]

    def _check_thread(self) -> None:
        """The protocol is driven from one thread (rank 0: the loop's torch thread): a collective
        issued from another thread meanwhile would interleave with its collectives on the group and
        corrupt both. A second thread is a bug, and raises at once."""
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        elif me != self._thread:
            raise RuntimeError(
                f"rank {self.rank}: the rank protocol was driven from thread {self._thread} and now from {me}; "
                "every read of a sharded fragment and every order to the ranks must run in one thread"
            )

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP around the model (every parameter broadcast from rank 0 as it is built). Experts that
        no token of a batch reached have no gradient: find_unused_parameters. Buffers are not
        broadcast at each forward: each rank computes its own (the same).
        Sharded: every parameter from rank 0, then FSDP2 `fully_shard` on each block and the root;
        rank 0 first keeps a full CPU copy (pinned on CUDA)."""
        if not self.sharded:
            from torch.nn.parallel import DistributedDataParallel

            with _collective():
                wrapped = DistributedDataParallel(
                    model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                    find_unused_parameters=True,
                    # no collective in a forward: rank 0 evaluates alone (through a task's wrapper too)
                    broadcast_buffers=False,
                )
            self.params = dict(model.named_parameters())
            return wrapped
        from torch.distributed.fsdp import fully_shard

        with torch.no_grad():
            if self.rank == 0:
                pin = self.device.type == "cuda"
                self.mirror = {
                    n: (c.pin_memory() if pin else c)
                    for n, p in model.named_parameters()
                    for c in [p.detach().to("cpu", torch.float32).clone()]
                }
            for p in model.parameters():
                self._broadcast(p.data)
        with _collective():
            for layer in layer_modules(model):
                fully_shard(layer)
            fully_shard(model)
        self.params = dict(model.named_parameters())
        self.fresh = set(range(len(self.layout)))
        self.model = model
        return model

    def set_layout(self, layout: Sequence[Sequence[str]]) -> None:
        """The fragments of a task's model, known once it is built (and wrapped)."""
        self.layout = [list(names) for names in layout]
        if self.sharded:
            self.fresh = set(range(len(self.layout)))

    def share_object(self, value):
        """Every rank: rank 0's `value` (a task's state on a resume), as picklable data."""
        self._check_thread()
        box = [value if self.rank == 0 else None]
        with _collective():
            dist.broadcast_object_list(box, src=0, device=self._ctl_device)
        return box[0]

    def fragment_bytes(self) -> int:
        """Bytes of the largest fragment's parameters (what a whole-fragment gather would hold)."""
        return max(sum(self.params[n].numel() * self.params[n].element_size() for n in names) for names in self.layout)

    def model_bytes(self) -> tuple[int, int]:
        """(bytes of the whole model's parameters, bytes of this rank's share of them)."""
        whole = local = 0
        for p in self.params.values():
            whole += p.numel() * p.element_size()
            local += (p.to_local() if self.sharded else p).numel() * p.element_size()
        return whole, local

    def share_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank takes rank 0's inner optimizer state (a resume)."""
        state = self.share_object(optimizer.state_dict() if self.rank == 0 else None)
        if self.rank:
            optimizer.load_state_dict(state)

    def all_mean(self, values: Sequence[float]) -> list[float]:
        """The ranks' mean of a few numbers (the step's loss)."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self._ctl_device)
        with _collective():
            dist.all_reduce(t)
        return [float(x) / self.world for x in t.tolist()]

    def attach(self, trainer) -> None:
        """Make `trainer` (node/trainer.py) one of the ranks: DDP around its model, rank 0's inner
        optimizer state, and the step's loss averaged over the ranks. Sharded: the model sharded,
        a new inner optimizer over the shards (a resumed one's state does not carry over), and
        rank 0's evaluation run by every rank (a sharded forward is a collective)."""
        trainer.forward = self.wrap(trainer.model)
        trainer.mean = self.all_mean
        if not self.sharded:
            self.share_optimizer(trainer.optimizer)
            return
        trainer.rebuild_optimizer()
        if self.rank == 0:
            evaluate = trainer.evaluate
            trainer.evaluate = lambda: self.evaluate(evaluate)

    def view(self, params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Rank 0: the parameters as Streaming DiLoCo should read and write them: the model's own
        (ddp), or the full copy that gathers a fragment when it is read (sharded)."""
        return ShardedParams(self) if self.sharded else params

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

    def before_step(self, step: int, accum: int = 1) -> None:
        """Rank 0: tell the others to take a step (of `accum` micro-batches), with the fragments that
        changed since the last one."""
        changed, self.changed = sorted(self.changed), set()
        self._ints([STEP, step, fragment_mask(set(changed)), accum])
        self._send_fragments(changed)
        self.fresh = set()  # the step changes every shard

    def push(self) -> None:
        """Rank 0: send the fragments changed since the last step now (not waiting for the next step)."""
        if self.changed:
            changed, self.changed = sorted(self.changed), set()
            self._ints([SCATTER, 0, fragment_mask(set(changed)), 0])
            self._send_fragments(changed)

    def pull(self, fragment: int) -> None:
        """Rank 0, sharded: make the full copy of `fragment` current (gathered from the ranks)."""
        if fragment in self.fresh:
            return
        self._ints([GATHER, 0, fragment_mask({fragment}), 0])
        self._gather(fragment)
        self.fresh.add(fragment)

    def evaluate(self, fn):
        """Rank 0, sharded: every rank runs `fn` (the evaluation) on the current parameters."""
        self.push()
        self._ints([EVAL, 0, 0, 0])
        return self._sharded_evaluation(fn)

    def _sharded_evaluation(self, fn):
        """Every rank: run the evaluation, then reshard. FSDP2 keeps the root module's parameters
        (embeddings, final norm, head) unsharded after a forward without backward, and its next
        forward would use those copies: a fragment scattered in between would not reach it."""
        value = self.guard(fn)
        self.model.reshard()
        return value

    def stop(self) -> float | None:
        """Rank 0: the others take the changed fragments and leave their loop; returns how far apart
        the ranks' parameters ended (max minus min of a float64 checksum: 0 when they are identical;
        None when sharded, where each holds its own shard), None if a rank is gone."""
        try:
            self.push()
            self._ints([STOP, 0, 0, 0])
            return self.spread()
        except RankFailure:
            return None

    def spread(self) -> float | None:
        """Every rank: max minus min over the ranks of the sum of all parameters (float64); None when
        sharded. Either way the last collective: no rank tears the group down while another still
        uses it (a follower aborted at exit now and then without it)."""
        total = 0.0
        if not self.sharded:
            with torch.no_grad():
                total = sum(float(p.detach().double().sum()) for p in self.params.values())
        t = torch.tensor([total, -total], dtype=torch.float64, device=self._ctl_device)
        with _collective():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return None if self.sharded else float(t[0] + t[1])

    def _send_fragments(self, fragments: Sequence[int]) -> None:
        """Rank 0's values of these fragments to every rank (sharded: each keeps its own shard)."""
        with torch.no_grad():
            for f in fragments:
                for n in self.layout[f]:
                    p = self.params[n]
                    if not self.sharded:
                        self._broadcast(p.data)
                        continue
                    if self.rank == 0:
                        full = self.mirror[n].to(self.device, non_blocking=True)
                    else:
                        full = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                    self._broadcast(full)
                    local = p.to_local()
                    chunks = torch.chunk(full, self.world, dim=0)  # FSDP2's dim-0 split
                    part = chunks[self.rank] if self.rank < len(chunks) else full[:0]
                    local.copy_(part.reshape(local.shape))

    def _gather(self, fragment: int) -> None:
        """Sharded, every rank: the fragment's full tensors, one at a time; rank 0 keeps them."""
        with torch.no_grad(), _collective():
            for n in self.layout[fragment]:
                full = self.params[n].full_tensor()
                self.gather_peak_bytes = max(self.gather_peak_bytes, full.numel() * full.element_size())
                if self.rank == 0:
                    self.mirror[n].copy_(full)
                del full

    # --- ranks 1.. -------------------------------------------------------

    def receive_header(self) -> tuple[int, int]:
        shard, data_seed = self._ints([0, 0])
        return shard, data_seed

    def next_step(self, evaluate=None) -> tuple[int, int] | None:
        """A follower: serve rank 0's orders up to the next step; (step, micro-batches) to take,
        after taking the changed fragments; None to stop. `evaluate`: what EVAL runs."""
        while True:
            op, step, mask, accum = self._ints([0, 0, 0, 0])
            fragments = mask_fragments(mask, len(self.layout))
            if op == STOP:
                self.spread()
                return None
            if op == GATHER:
                for f in fragments:
                    self._gather(f)
            elif op == EVAL:
                self._sharded_evaluation(evaluate)
            else:  # STEP, SCATTER
                self._send_fragments(fragments)
                if op == STEP:
                    return step, accum

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot always be torn down cleanly
                pass
