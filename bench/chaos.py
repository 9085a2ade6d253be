"""A soak under injected faults: three islands and a satellite, each behind a relay, train one run
while a seeded schedule injects faults of every kind; the figures a site operator asks for.

    python -m bench.chaos --minutes 10 --seed 1 --out bench/results/chaos-1.json

Real `islands-node` processes on 127.0.0.1 (the test suite's launcher, tests/procs.py), with a
swarm key, each behind a `lan` relay for its DHT and one for its rounds. The schedule (seeded)
injects a fault every `60 / --faults-per-minute` seconds on average, at most one at a time on
any one island and at most one island impaired (down, frozen, cut off, or restarted less than
`RECOVER_S` ago) at a time; a fault due while the kind drawn must wait for that is one of the
kinds that impair no island (FILLERS: a wrong key, a poisoner, a full disk — an island short of
disk still takes part in rounds). The kinds:

- kill: SIGKILL of an island's process group (its rounds in flight), restarted from the same
  run dir 3-10 s later;
- freeze: SIGSTOP of an island's process group for 20-60 s, then SIGCONT;
- partition: the island's relays stop forwarding for 20-40 s (the others cannot reach it), then heal;
- leave: SIGTERM of an island (it must exit 0); join: a new island joins mid-run, as the fault
  after each leave (an operator replaces a site), so that three islands train throughout (four
  islands, a satellite, their relays and the faults' nodes overload 2 cores: bench/README.md);
- wrong_key: a node with another swarm key tries to join (it must be refused and exit);
- poison: a node with the key sends huge pseudo-gradients for 30 s (tests/hostile.py), then is killed;
- disk_full: the island's run dir (a tmpfs of its own, when this process may mount one) is
  filled up to its last 64 KiB for 20-30 s, across a checkpoint, then freed;
- truncated_checkpoint: an island is killed and a file of its checkpoint cut in half before
  it restarts.

The run's length: `--steps` (default `--minutes` times `--steps-per-minute`); faults stop when
`--minutes` have passed or the first island is two windows from its last step. Then every
fault still on is undone, and the islands finish the run and agree as they would.

Figures (JSON, --out; a PNG timeline next to it): faults by kind; hangs (a running island,
neither frozen nor just restarted, with no step for `HANG_S`; must be 0); unexpected exits (a
node that exits before its run's end is restarted 10 s later, as deploy/'s systemd unit does;
an exit other than a refusal to start, status 2 with its reason, is unexpected);
ghost processes after the run (0); corrupt or unloadable checkpoints at the end (0); the
islands' agreement at the end (max |difference| of `global.safetensors`); rounds lost per fault
(rounds of the islands the fault did not touch that were not `ok` until its recovery); time
from each fault's end to the next round committed by every running island (median, p95);
goodput (tokens in committed rounds over tokens trained by the islands and the satellite; a
poisoner's or a stranger's are not counted).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.procs import NodeProcess, Nodes

from .common import parse, table, write

KINDS = ("kill", "freeze", "partition", "leave", "join", "wrong_key", "poison", "disk_full", "truncated_checkpoint")
IMPAIRING = {"kill", "freeze", "partition", "leave", "truncated_checkpoint"}
"""Kinds that take an island out of the rounds for a while: at most one at a time."""
RECOVER_S = 20.0
"""An island (re)started this recently is still on its way back into the rounds (imports, DHT, state
download): no fault targets it, and it counts as impaired (a kill of another island then would
leave one alone in the rounds)."""
FILLERS = ("wrong_key", "poison", "disk_full")
"""Kinds that take no island out of the rounds (an island with a full disk still takes part): one of
them goes when a fault is due and the kind drawn must wait for an impaired island to come back."""
HANG_S = 90.0
"""A running island with no step for this long hangs: the longest wait its bounds allow is a
round's (--match-wait-s 3 + 15 s of transfer, 3 attempts) or a state download's (60 s)."""
START_GRACE_S = 120.0
"""A (re)started island has this long to reach its first step (imports, DHT, state download)."""
WINDOW, FRAGMENTS = 20, 4
TMPFS_BYTES = 256 << 20
FREE_LEFT_BYTES = 64 << 10


@dataclasses.dataclass
class Fault:
    kind: str
    target: str | None
    t: float
    """When it was injected (wall clock, seconds since the epoch: the events' `t`)."""
    end: float | None = None
    """When it was undone (its end: the node restarted, SIGCONT, healed, space back); = t for
    the instantaneous kinds."""
    detail: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Island:
    name: str
    node: NodeProcess
    args: list[str]
    role: str = "island"
    state: str = "up"
    """up, down (killed, to restart), frozen, cut, full (disk), left."""
    started: float = dataclasses.field(default_factory=time.time)
    incarnations: int = 1
    tmpfs: Path | None = None
    last_step_at: float = dataclasses.field(default_factory=time.time)
    last_step: int = -1
    hung: bool = False


def _p2pd_count() -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                n += open(f"/proc/{pid}/comm").read().strip() == "p2pd"
            except OSError:
                pass
    return n


def _group_alive(pgid: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.getpgid(int(pid)) == pgid:
                    out.append(int(pid))
            except (ProcessLookupError, PermissionError):
                pass
    return out


def _mount_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


class Soak:
    def __init__(self, root: Path, seed: int, minutes: float, steps: int, rate: float):
        self.root, self.seed, self.minutes, self.steps, self.rate = root, seed, minutes, steps, rate
        self.rng = random.Random(seed)
        self.nodes = Nodes(root)
        self.islands: dict[str, Island] = {}
        self.faults: list[Fault] = []
        self.timers: list[tuple[float, int, str, str]] = []
        """(due, seq, action, island) of the undo half of a fault, or of a restart."""
        self.seq = 0
        self.others: list[NodeProcess] = []
        """Nodes that are not islands of the run: wrong-key peers, poisoners."""
        self.hangs: list[dict] = []
        self.unexpected: list[dict] = []
        self.restarts: list[dict] = []
        """Exits of a node before its run's end, each restarted as its supervisor would."""
        self.joined = 0
        self.mounted: list[Path] = []
        self.pending: str | None = None
        """The kind of the next fault, drawn, waiting for its turn."""
        from islands.protocols.admission import write_swarm_key

        root.mkdir(parents=True, exist_ok=True)
        self.key, self.wrong_key = root / "swarm.key", root / "stranger.key"
        write_swarm_key(self.key)
        write_swarm_key(self.wrong_key)
        self.common = [
            "--window", str(WINDOW), "--fragments", str(FRAGMENTS), "--match-wait-s", "3", "--steps", str(steps),
            "--run-id", "chaos", "--swarm-key", str(self.key), "--checkpoint-every", "20", "--leave-timeout-s", "5",
            "--listen", "/ip4/127.0.0.1/tcp/0", "--progress", "off",
        ]
        self.relay = ["--profile", "lan"]

    # --- the islands -----------------------------------------------------------------------------

    def _join_addresses(self, exclude: str | None = None) -> list[str]:
        """Every island up, as an operator lists several peers to --join: one that is frozen or
        cut off then does not keep a node from starting."""
        out = []
        for isl in self.islands.values():
            if isl.name != exclude and isl.state == "up" and isl.role == "island":
                f = self.root / f"{isl.name}.maddr"
                if f.exists():
                    out.append(f.read_text().split()[0])
        if not out:
            raise RuntimeError("no island up to join")
        return out

    def start_island(self, name: str, extra: list[str], role: str = "island", join: list[str] = ()) -> Island:
        run_dir = self.root / name
        tmpfs = None
        if role == "island" and name in ("a", "b", "c") and _mount_tmpfs(run_dir):
            tmpfs = run_dir
            self.mounted.append(run_dir)
        args = [*self.common, *extra, "--maddr-file", str(self.root / f"{name}.maddr")]
        for address in join:
            args += ["--join", address]
        # the relays' files outside the run dir: a full disk there is the island's alone
        node = self.nodes.start(name, args, self.relay, relay_root=self.root / "relays")
        # the full arguments (with its relays' ports) for a restart from the same run dir
        isl = Island(name, node, node.args[4:], role=role, tmpfs=tmpfs)
        self.islands[name] = isl
        return isl

    def restart(self, isl: Island) -> None:
        try:
            joins = self._join_addresses(exclude=isl.name)
        except RuntimeError:  # no other island up just now
            self._later(5, "restart", isl.name)
            return
        isl.incarnations += 1
        args, rest = [], list(isl.args)
        while rest:
            a = rest.pop(0)
            if a == "--join":
                rest.pop(0)
            else:
                args.append(a)
        for address in joins:
            args += ["--join", address]
        isl.node = NodeProcess(args, self.root / isl.name, name=f"{isl.name}-{isl.incarnations}")
        self.nodes.started.append(isl.node)
        isl.state, isl.started, isl.last_step_at = "up", time.time(), time.time()

    # --- the faults ------------------------------------------------------------------------------

    def _later(self, delay: float, action: str, name: str) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (time.monotonic() + delay, self.seq, action, name))

    def _fault(self, kind: str, target: str | None, **detail) -> Fault:
        f = Fault(kind, target, time.time(), detail=detail)
        self.faults.append(f)
        print(f"[{time.strftime('%H:%M:%S')}] {kind} {target or ''} {detail or ''}", flush=True)
        return f

    def _open(self, kind: str, target: str) -> Fault | None:
        return next((f for f in reversed(self.faults) if f.kind == kind and f.target == target and f.end is None), None)

    def impaired(self) -> list[str]:
        """Islands out of the rounds: down, frozen, cut off, or (re)started less than RECOVER_S ago."""
        now = time.time()
        return [
            n for n, i in self.islands.items()
            if i.role == "island" and (i.state not in ("up", "left", "full") or (i.state == "up" and now - i.started < RECOVER_S))
        ]

    def up_islands(self) -> list[Island]:
        return [i for i in self.islands.values() if i.role == "island" and i.state == "up"]

    def inject(self) -> bool:
        """Inject the next fault of the schedule, if one can be now: kinds are drawn evenly; one
        that cannot be now (an island is impaired already) waits for its turn while one of the
        FILLERS that can goes instead, and one that makes no sense in this swarm (a join to three
        islands, a leave from two) is drawn again. Whether a fault was injected."""
        live = [i for i in self.islands.values() if i.role == "island" and i.state != "left"]
        while self.pending is None:
            kind = self.rng.choice(KINDS)
            if kind == "join" and (len(live) >= 3 or self.joined >= 6):
                continue
            if kind == "leave" and (len(live) < 3 or self.joined >= 6):
                continue
            if kind == "disk_full" and not any(i.tmpfs is not None for i in live):
                continue
            self.pending = kind
        up = [i for i in self.up_islands() if time.time() - i.started > RECOVER_S]
        if self._can(self.pending, up):
            kind, self.pending = self.pending, None
        else:
            now = [k for k in FILLERS if self._can(k, up)]
            if not now:
                return False
            kind = self.rng.choice(now)
        getattr(self, f"_{kind}")(up)
        return True

    def _can(self, kind: str, up: list[Island]) -> bool:
        """Whether a fault of this kind can be injected now, with these islands up."""
        if kind in IMPAIRING:
            return not self.impaired() and len(up) >= 2
        if kind == "disk_full":
            return any(i.tmpfs is not None for i in up) and not any(i.state == "full" for i in self.islands.values())
        if kind == "poison":
            return not any(n.proc.poll() is None for n in self.others if "tests.hostile" in n.command)
        return True

    def _kill(self, up: list[Island], truncate: bool = False) -> None:
        isl = self.rng.choice(up)
        f = self._fault("truncated_checkpoint" if truncate else "kill", isl.name, step=isl.last_step)
        isl.node.kill_tree()
        isl.state = "down"
        if truncate:
            ckpt = self.root / isl.name / "checkpoint"
            files = sorted(p for p in ckpt.glob("*.safetensors")) if ckpt.exists() else []
            if files:
                victim = self.rng.choice(files)
                size = victim.stat().st_size
                with open(victim, "r+b") as fh:
                    fh.truncate(size // 2)
                f.detail["file"] = victim.name
        self._later(self.rng.uniform(3, 10), "restart", isl.name)

    def _truncated_checkpoint(self, up: list[Island]) -> None:
        self._kill(up, truncate=True)

    def _freeze(self, up: list[Island]) -> None:
        isl = self.rng.choice(up)
        self._fault("freeze", isl.name, step=isl.last_step)
        os.killpg(isl.node.proc.pid, signal.SIGSTOP)
        isl.state = "frozen"
        self._later(self.rng.uniform(20, 60), "thaw", isl.name)

    def _partition(self, up: list[Island]) -> None:
        isl = self.rng.choice(up)
        self._fault("partition", isl.name, step=isl.last_step)
        for relay in self.nodes.links[isl.name]:
            relay.cut()
        isl.state = "cut"
        self._later(self.rng.uniform(20, 40), "heal", isl.name)

    def _leave(self, up: list[Island]) -> None:
        isl = self.rng.choice(up)
        f = self._fault("leave", isl.name, step=isl.last_step)
        isl.node.signal(signal.SIGTERM)
        isl.state = "left"
        f.end = f.t
        self._later(60, "left", isl.name)
        self.pending = "join"  # the next fault: a new island takes the site's place

    def _join(self, up: list[Island]) -> None:
        name = "defghi"[self.joined]
        self.joined += 1
        f = self._fault("join", name)
        f.end = f.t
        self.start_island(name, [], join=self._join_addresses())

    def _wrong_key(self, up: list[Island]) -> None:
        f = self._fault("wrong_key", None)
        f.end = f.t
        args = [a for a in self.common]
        args[args.index("--swarm-key") + 1] = str(self.wrong_key)
        name = f"stranger{sum(x.kind == 'wrong_key' for x in self.faults)}"
        node = NodeProcess([*args, *(x for j in self._join_addresses() for x in ("--join", j))], self.root / name, name=name)
        self.others.append(node)

    def _poison(self, up: list[Island]) -> None:
        f = self._fault("poison", None)
        f.end = f.t
        name = f"poisoner{sum(x.kind == 'poison' for x in self.faults)}"
        node = NodeProcess(
            [*self.common, *(x for j in self._join_addresses() for x in ("--join", j))], self.root / name, name=name,
            command=[sys.executable, "-m", "tests.hostile", "huge"],
        )
        self.others.append(node)
        self._later(30, "kill_other", name)

    def _disk_full(self, up: list[Island]) -> None:
        isl = self.rng.choice([i for i in up if i.tmpfs is not None])
        self._fault("disk_full", isl.name, step=isl.last_step)
        st = os.statvfs(isl.tmpfs)
        free = st.f_bavail * st.f_frsize
        filler = isl.tmpfs / "filler"
        with open(filler, "wb") as fh:
            left = max(0, free - FREE_LEFT_BYTES)
            block = b"\0" * (1 << 20)
            while left > 0:
                try:
                    fh.write(block[: min(left, len(block))])
                except OSError:
                    break
                left -= len(block)
        isl.state = "full"
        self._later(self.rng.uniform(20, 30), "free", isl.name)

    def undo(self, action: str, name: str) -> None:
        if action == "kill_other":
            for n in self.others:
                if n.run_dir.name == name:
                    n.kill_tree()
            return
        isl = self.islands[name]
        if action == "restart":
            self.restart(isl)
            if isl.state == "down":  # not yet: no island to join
                return
            f = self._open("truncated_checkpoint", name) or self._open("kill", name)
        elif action == "thaw":
            os.killpg(isl.node.proc.pid, signal.SIGCONT)
            isl.state, isl.last_step_at = "up", time.time()
            f = self._open("freeze", name)
        elif action == "heal":
            for relay in self.nodes.links[name]:
                relay.heal()
            isl.state = "up"
            f = self._open("partition", name)
        elif action == "free":
            (isl.tmpfs / "filler").unlink(missing_ok=True)
            isl.state = "up"
            f = self._open("disk_full", name)
        elif action == "left":
            code = isl.node.proc.poll()
            f = None
            if code != 0:
                self.unexpected.append({"island": name, "what": f"left with SIGTERM: exit {code}", "stderr": isl.node.stderr()[-1500:]})
            return
        else:
            raise ValueError(action)
        if f is not None:
            f.end = time.time()

    # --- watching --------------------------------------------------------------------------------

    def watch(self) -> None:
        now = time.time()
        for isl in self.islands.values():
            if isl.state == "left":
                continue
            steps = [e for e in isl.node.poll_events() if e["event"] == "step"]
            if steps and steps[-1]["step"] != isl.last_step:
                isl.last_step, isl.last_step_at = steps[-1]["step"], now
            code = isl.node.proc.poll()
            if code is not None and isl.state != "down":
                if code == 0 and isl.node.of("summary"):
                    isl.state = "left"
                    continue
                # as the systemd unit does (Restart=on-failure, RestartSec=10); an exit other than
                # a refusal to start (2, with its reason) is a finding
                exit_ = {"island": isl.name, "code": code, "step": isl.last_step, "t": round(now, 2),
                         "stderr": isl.node.stderr()[-1500:]}
                self.restarts.append(exit_)
                if code != 2:
                    self.unexpected.append(exit_)
                isl.state = "down"
                self._later(10, "restart", isl.name)
                continue
            if isl.state in ("frozen", "down") or isl.node.of("summary"):
                continue
            quiet = now - max(isl.last_step_at, isl.started + START_GRACE_S - HANG_S)
            if quiet > HANG_S and not isl.hung:
                isl.hung = True
                self.hangs.append({"island": isl.name, "step": isl.last_step, "quiet_s": round(quiet, 1), "state": isl.state})
                print(f"HANG: {isl.name} at step {isl.last_step}", flush=True)
            elif quiet <= HANG_S:
                isl.hung = False

    def leading_step(self) -> int:
        return max((i.last_step for i in self.islands.values() if i.role == "island"), default=0)

    # --- the run ---------------------------------------------------------------------------------

    def run(self, faults_per_minute: float) -> dict:
        p2pd_before = _p2pd_count()
        t0 = time.time()
        try:
            a = self.start_island("a", ["--wait-islands", "3"])
            join = a.node.wait_file(self.root / "a.maddr", 60)
            self.start_island("s", ["--role", "satellite", "--contact", "up 10s every 30s"], role="satellite", join=[join])
            for name in "bc":
                self.start_island(name, ["--wait-islands", "3"], join=[join])
            a.node.wait_for(lambda e: e["event"] == "step", 180, "the first step")
            begin = time.monotonic()
            deadline = begin + 60 * self.minutes
            next_fault = begin + 5 + self.rng.expovariate(faults_per_minute / 60)
            while time.monotonic() < deadline and self.leading_step() < self.steps - 2 * WINDOW:
                self.watch()
                while self.timers and self.timers[0][0] <= time.monotonic():
                    _, _, action, name = heapq.heappop(self.timers)
                    self.undo(action, name)
                if time.monotonic() >= next_fault and self.inject():
                    next_fault = time.monotonic() + self.rng.expovariate(faults_per_minute / 60)
                time.sleep(0.25)
            fault_seconds = time.time() - t0
            # every fault still on is undone now (a restart at once); an island that was asked
            # to leave is given the rest of its minute
            for due, _, action, name in sorted(self.timers):
                if action == "left":
                    try:
                        self.islands[name].node.proc.wait(timeout=max(0.0, due - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
                self.undo(action, name)
            self.timers = []
            # the run ends as it would: every island to its last step, then the end-of-run agreement
            end_deadline = time.monotonic() + 600
            while time.monotonic() < end_deadline:
                self.watch()
                while self.timers and self.timers[0][0] <= time.monotonic():
                    _, _, action, name = heapq.heappop(self.timers)
                    self.undo(action, name)
                running = [i for i in self.islands.values() if i.state == "down" or (i.state != "left" and i.node.proc.poll() is None)]
                if not running:
                    break
                time.sleep(0.5)
            self.watch()
            wall = time.time() - t0
        finally:
            self.nodes.stop()
            for n in self.others:
                n.stop()
        ghosts = sum(len(_group_alive(n.proc.pid)) for n in [*self.nodes.started, *self.others])
        p2pd_after = _p2pd_count()
        try:
            return self.figures(wall, fault_seconds, ghosts + max(0, p2pd_after - p2pd_before))
        finally:
            for path in self.mounted:
                # what the tmpfs held (logs, checkpoints) stays on disk for a look afterwards
                kept = path.with_name(path.name + ".kept")
                try:
                    shutil.copytree(path, kept, symlinks=True, ignore=shutil.ignore_patterns("filler"))
                    _umount(path)
                    path.rmdir()
                    kept.rename(path)
                except OSError as e:  # the figures count more than the tidy-up (a mount left from a run killed)
                    print(f"could not unmount {path} ({e}); its copy is in {kept}", file=sys.stderr)

    # --- the figures -----------------------------------------------------------------------------

    def _events(self, name: str) -> list[dict]:
        """Every incarnation's events, oldest first: a restarted node moved its log aside as
        events.jsonl.1, .2, ..."""
        path = self.root / name / "events.jsonl"
        paths = []
        n = 1
        while path.with_name(f"{path.name}.{n}").exists():
            paths.append(path.with_name(f"{path.name}.{n}"))
            n += 1
        out = []
        for p in [*paths, path] if path.exists() else paths:
            for line in p.read_text(errors="replace").splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def figures(self, wall: float, fault_seconds: float, ghosts: int) -> dict:
        from islands.node import checkpoint as ckpt_io
        from safetensors.torch import load_file

        events = {n: self._events(n) for n in self.islands}
        peer_of: dict[str, str] = {}
        for n, ev in events.items():
            for e in ev:
                if e["event"] == "started":
                    peer_of[e["peer_id"]] = n
        syncs = [(n, e) for n, ev in events.items() for e in ev if e["event"] == "sync"]
        syncs.sort(key=lambda x: x[1]["t"])
        # corrupt or unloadable checkpoints at the end, and the islands' agreement
        corrupt, finals = [], {}
        for n, isl in self.islands.items():
            folder = self.root / n
            if not (folder / "checkpoint").exists():
                continue
            try:
                state = json.loads((folder / "checkpoint" / "state.json").read_text())
                ckpt_io.load(folder, state["manifest"])
            except Exception as e:  # noqa: BLE001 - any failure to load is the figure
                corrupt.append({"island": n, "why": str(e)[:300]})
                continue
            if isl.role == "island" and any(e["event"] == "summary" for e in events[n]) and state["step"] >= self.steps:
                finals[n] = load_file(str(folder / "checkpoint" / "global.safetensors"))
        diff = 0.0
        names = sorted(finals)
        for x in names[1:]:
            for k in finals[names[0]]:
                diff = max(diff, float((finals[x][k].float() - finals[names[0]][k].float()).abs().max()))
        # rounds lost and time to recovery per fault
        per_fault = []
        for f in self.faults:
            end = f.end if f.end is not None else f.t
            others = {n for n, i in self.islands.items() if i.role == "island" and n != f.target}
            recovered = None
            for _, e in syncs:
                if e["t"] < end or e["outcome"] != "ok" or not e.get("members"):
                    continue
                members = {peer_of.get(p) for p in e["members"]}
                running = {m for m, i in self.islands.items() if i.role == "island" and self._running_at(m, events[m], e["t"])}
                if running <= members:
                    recovered = e["t"]
                    break
            until = recovered if recovered is not None else math.inf
            lost = sum(1 for n, e in syncs if n in others and f.t <= e["t"] <= until and e["outcome"] in ("failed", "rejected"))
            per_fault.append({
                "kind": f.kind, "target": f.target, "t": round(f.t - self._t0(events), 2), "duration_s": round(end - f.t, 2),
                "recovery_s": None if recovered is None else round(recovered - end, 2), "rounds_lost": lost, **f.detail,
            })
        recov = sorted(x["recovery_s"] for x in per_fault if x["recovery_s"] is not None)
        # goodput: tokens that reached a committed round over tokens trained (each step's tokens go
        # to every fragment's round)
        trained = sum(e.get("tokens", 0) for ev in events.values() for e in ev if e["event"] == "step")
        agreed = sum(
            e.get("tokens", 0) for n, e in syncs
            if e["outcome"] == "ok" and (self.islands[n].role == "satellite" or e.get("staleness", 0) == 0)
        )
        by_kind = {k: sum(f.kind == k for f in self.faults) for k in KINDS}
        refused = [n.run_dir.name for n in self.others if "stranger" in n.run_dir.name and n.proc.returncode not in (None, 0)]
        out = {
            "config": {"seed": self.seed, "minutes": self.minutes, "steps": self.steps, "window": WINDOW, "fragments": FRAGMENTS,
                       "faults_per_minute": self.rate, "hang_s": HANG_S, "disk_faults": bool(self.mounted)},
            "wall_seconds": round(wall, 1),
            "fault_seconds": round(fault_seconds, 1),
            "minutes": self.minutes,
            "seed": self.seed,
            "faults": by_kind,
            "faults_total": len(self.faults),
            "hangs": len(self.hangs),
            "hang_details": self.hangs,
            "unexpected_exits": self.unexpected,
            "supervisor_restarts": [{k: v for k, v in x.items() if k != "stderr"} | {"why": x["stderr"].strip().splitlines()[-1:]} for x in self.restarts],
            "ghosts": ghosts,
            "corrupt_checkpoints": len(corrupt),
            "corrupt_details": corrupt,
            "islands_at_end": names,
            "max_param_diff": diff if len(names) > 1 else None,
            "rounds_lost_per_fault": round(statistics.mean(x["rounds_lost"] for x in per_fault), 3) if per_fault else None,
            "rounds_lost_by_kind": {k: sum(x["rounds_lost"] for x in per_fault if x["kind"] == k) for k in by_kind if by_kind[k]},
            "recovery_s_median": round(statistics.median(recov), 2) if recov else None,
            "recovery_s_p95": recov[min(len(recov) - 1, int(0.95 * len(recov)))] if recov else None,
            "unrecovered_faults": sum(1 for x in per_fault if x["recovery_s"] is None),
            "goodput": round(agreed / (FRAGMENTS * trained), 4) if trained else None,
            "tokens_trained": trained,
            "checkpoints_failed": sum(e["event"] == "checkpoint_failed" for ev in events.values() for e in ev),
            "checkpoints_set_aside": sum(e["event"] == "checkpoint_set_aside" for ev in events.values() for e in ev),
            "strangers_refused": f"{len(refused)} of {by_kind['wrong_key']}",
            "sync_outcomes": {o: sum(e["outcome"] == o for _, e in syncs) for o in sorted({e["outcome"] for _, e in syncs})},
            "fault_log": per_fault,
        }
        self._timeline_data = (events, per_fault, self._t0(events))
        return out

    def _t0(self, events: dict[str, list[dict]]) -> float:
        return min((ev[0]["t"] for ev in events.values() if ev), default=0.0)

    def _running_at(self, name: str, ev: list[dict], t: float) -> bool:
        """Whether an island was running and reachable at `t`: started before, not yet at its
        summary, and not inside a fault of its own (killed, frozen, cut off, gone)."""
        started = [e["t"] for e in ev if e["event"] == "started" and e["t"] <= t]
        if not started:
            return False
        if any(e["event"] == "summary" and started[-1] <= e["t"] <= t for e in ev):
            return False
        for f in self.faults:
            if f.target == name and f.kind != "join" and f.t <= t and (f.end is None or t <= f.end or f.kind == "leave"):
                return False
        return True

    def timeline(self, path: Path) -> None:
        """A PNG: one row per island, its rounds as dots by outcome, the faults as bars."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(f"matplotlib is not installed (pip install -e '.[bench]'): no {path}")
            return
        events, per_fault, t0 = self._timeline_data
        names = sorted(n for n in events if events[n])
        colors = {"ok": "C2", "failed": "C3", "rejected": "C1", "solo": "C7", "skipped_no_contact": "C9"}
        fig, ax = plt.subplots(figsize=(11, 0.6 * len(names) + 2.5))
        for y, n in enumerate(names):
            for e in events[n]:
                if e["event"] == "sync":
                    ax.plot(e["t"] - t0, y, "|", color=colors.get(e["outcome"], "k"), markersize=9)
        kinds = sorted({f["kind"] for f in per_fault})
        for f in per_fault:
            y = names.index(f["target"]) if f["target"] in names else -1
            ax.barh(y, max(1.0, f["duration_s"]), left=f["t"], height=0.7, color=f"C{kinds.index(f['kind'])}", alpha=0.35)
            ax.text(f["t"], y + 0.38, f["kind"], fontsize=6, rotation=30)
        ax.set_yticks(range(-1, len(names)), ["swarm", *names])
        ax.set_xlabel("seconds")
        handles = [plt.Line2D([], [], marker="|", linestyle="", color=c, label=o) for o, c in colors.items()]
        ax.legend(handles=handles, loc="upper right", fontsize=7)
        ax.set_title("chaos soak: rounds (ticks, by outcome) and faults (bars)")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}")


def main() -> None:
    def extra(p):
        p.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected (default 10)")
        p.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
        p.add_argument("--faults-per-minute", type=float, default=7.0,
                       help="mean rate of faults (default 7: 30 or more in 10 minutes; each waits its turn while "
                            "another impairs an island)")
        p.add_argument("--steps-per-minute", type=float, default=180.0,
                       help="the swarm's pace on this machine under the soak, to size the run so that faults "
                            "run the whole --minutes (default 180; 120-170 measured here)")
        p.add_argument("--steps", type=int, help="the run's last step (default: minutes x steps-per-minute)")

    args, root = parse(__doc__, "bench-runs/chaos", extra)
    # stopped by SIGTERM (a `timeout`, a CI job's end): unwind, so that every node it started is stopped
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    steps = args.steps or int(args.minutes * args.steps_per_minute)
    soak = Soak(root, args.seed, args.minutes, steps, args.faults_per_minute)
    figures = soak.run(args.faults_per_minute)
    if args.out:
        soak.timeline(Path(args.out).with_suffix(".png"))
    print(table(
        [
            ["faults", f"{figures['faults_total']} ({', '.join(f'{k} {v}' for k, v in figures['faults'].items() if v)})"],
            ["hangs / unexpected exits / ghost processes", f"{figures['hangs']} / {len(figures['unexpected_exits'])} / {figures['ghosts']}"],
            ["corrupt checkpoints at the end", str(figures["corrupt_checkpoints"])],
            ["islands at the end: max |difference| of global.safetensors", f"{figures['islands_at_end']}: {figures['max_param_diff']}"],
            ["rounds lost per fault", str(figures["rounds_lost_per_fault"])],
            ["fault end to a round of every running island, s (median / p95)", f"{figures['recovery_s_median']} / {figures['recovery_s_p95']}"],
            ["goodput", str(figures["goodput"])],
            ["wall s (faults for)", f"{figures['wall_seconds']} ({figures['fault_seconds']})"],
        ],
        ["figure", "value"],
    ))
    write(args.out, figures)


if __name__ == "__main__":
    main()
