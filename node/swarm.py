"""`islands-node swarm`: N island processes on loopback, their progress together, a final table.

The one-command demo. Each island is a real `islands-node` process; the
first starts the swarm, the others join it by the address it writes. Every
run gets a fresh folder under --run-dir, so nothing of an earlier run is
touched.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .events import EventTail
from .progress import format_table

START_TIMEOUT_S = 90.0
STOP_GRACE_S = 30.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    islands: int = 3
    steps: int = 200
    window: int = 20
    fragments: int = 4
    batch_sizes: tuple[int, ...] = (8, 8, 16)
    """Cycled over the islands: mixed by default."""
    run_dir: str = "islands-swarm"
    timeout_s: float = 600.0
    node_args: tuple[str, ...] = ()

    def __post_init__(self):
        if not 1 <= self.islands <= 16:
            raise ValueError(f"islands must be in 1..16, got {self.islands}")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError("batch sizes must be positive integers")


def _parse(argv: list[str], prog: str) -> SwarmConfig:
    from .cli import _Parser

    parser = _Parser(
        prog=f"{prog} swarm",
        description="Run N islands as local processes on 127.0.0.1, show their progress, print a final table. "
        "Options after -- go to every island (e.g. -- --compression fp16).",
    )
    d = SwarmConfig()
    parser.add_argument("--islands", type=int, default=d.islands, help=f"how many islands (default {d.islands})")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"inner steps per island (default {d.steps})")
    parser.add_argument("--window", type=int, default=d.window, help=f"H (default {d.window})")
    parser.add_argument("--fragments", type=int, default=d.fragments, help=f"P (default {d.fragments})")
    parser.add_argument("--batch-sizes", default=",".join(map(str, d.batch_sizes)), help="comma-separated, cycled over the islands (default 8,8,16)")
    parser.add_argument("--run-dir", default=d.run_dir, help=f"parent folder; each run gets a new sub-folder (default {d.run_dir})")
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s, help="stop the islands after this long")
    node_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, node_args = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    try:
        sizes = tuple(int(x) for x in args.batch_sizes.split(",") if x.strip())
        return SwarmConfig(
            islands=args.islands, steps=args.steps, window=args.window, fragments=args.fragments,
            batch_sizes=sizes, run_dir=args.run_dir, timeout_s=args.timeout_s, node_args=tuple(node_args),
        )
    except ValueError as e:
        parser.error(str(e))


class Island:
    def __init__(self, index: int, folder: Path, args: list[str]):
        self.index, self.folder = index, folder
        folder.mkdir(parents=True)
        self.stderr = open(folder / "node.stderr", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "islands.node", *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=self.stderr, start_new_session=True,
        )
        self.tail = EventTail(folder / "events.jsonl")

    def stop(self, grace_s: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the node's hivemind daemons too
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.stderr.close()

    def last_error(self) -> str:
        text = (self.folder / "node.stderr").read_text(errors="replace").strip().splitlines()
        return text[-1] if text else ""


def run_swarm(cfg: SwarmConfig, out=sys.stdout) -> int:
    root = Path(cfg.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    while root.exists():
        root = root.with_name(root.name + "-1")
    common = [
        "--steps", str(cfg.steps), "--window", str(cfg.window), "--fragments", str(cfg.fragments),
        "--listen", "/ip4/127.0.0.1/tcp/0", "--wait-islands", str(cfg.islands), "--progress", "off",
        "--run-id", "swarm-demo", *cfg.node_args,
    ]

    def island_args(i: int, extra: list[str]) -> list[str]:
        folder = root / f"island-{i}"
        batch = cfg.batch_sizes[i % len(cfg.batch_sizes)]
        return [*common, "--batch-size", str(batch), "--run-dir", str(folder), *extra]

    print(f"swarm of {cfg.islands} islands in {root} (batch sizes {', '.join(str(cfg.batch_sizes[i % len(cfg.batch_sizes)]) for i in range(cfg.islands))})", file=out, flush=True)
    islands: list[Island] = []
    stopping: list[str] = []
    previous = {s: signal.signal(s, lambda sig, _f: stopping.append(signal.Signals(sig).name)) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    try:
        maddr_file = root / "island-0.maddr"
        islands.append(Island(0, root / "island-0", island_args(0, ["--maddr-file", str(maddr_file)])))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not maddr_file.exists():
            if islands[0].proc.poll() is not None or time.monotonic() > deadline or stopping:
                print(f"islands-node swarm: error: the first island did not start: {islands[0].last_error()}", file=sys.stderr)
                return 1
            time.sleep(0.1)
        join = maddr_file.read_text().split()[0]
        print(f"first island listens at {join}", file=out, flush=True)
        for i in range(1, cfg.islands):
            islands.append(Island(i, root / f"island-{i}", island_args(i, ["--join", join])))
        _watch(islands, cfg, out, started, stopping)
    finally:
        for island in islands:
            island.stop(STOP_GRACE_S)
        for s, h in previous.items():
            signal.signal(s, h)
    for island in islands:
        island.tail.poll()
    print(final_table(islands, time.monotonic() - started), file=out, flush=True)
    failed = [i for i in islands if i.proc.returncode != 0]
    for island in failed:
        print(f"island {island.index} exited with {island.proc.returncode}: {island.last_error()}", file=sys.stderr)
    return 1 if failed or stopping else 0


def _watch(islands: list[Island], cfg: SwarmConfig, out, started: float, stopping: list[str]) -> None:
    tty = out.isatty()
    last_line = 0.0
    while True:
        for island in islands:
            island.tail.poll()
        running = [i for i in islands if i.proc.poll() is None]
        now = time.monotonic()
        if not running or stopping or now - started > cfg.timeout_s:
            if stopping:
                print(f"\n{stopping[0]}: stopping the islands", file=out, flush=True)
            elif running:
                print(f"\ntimeout after {cfg.timeout_s:g}s: stopping the islands", file=out, flush=True)
            break
        if tty or now - last_line >= 10:
            parts = []
            for island in islands:
                step = island.tail.last("step")
                ok = island.tail.count("sync", outcome="ok")
                parts.append(f"#{island.index} step {step['step'] if step else 0}/{cfg.steps} loss {step['loss']:.2f} ok {ok}" if step else f"#{island.index} starting")
            line = f"[{now - started:5.0f}s] " + " | ".join(parts)
            print(("\r\x1b[2K" + line) if tty else line, end="" if tty else "\n", file=out, flush=True)
            last_line = now
        time.sleep(0.5)
    if tty:
        print(file=out)


def final_table(islands: list[Island], wall_s: float) -> str:
    head = ["island", "batch", "steps", "eval_loss", "tokens", "ok/solo/failed", "bytes sent", "sent/step", "wall s", "exit"]
    rows = []
    for island in islands:
        summary = island.tail.last("summary") or {}
        started = island.tail.last("started") or {}
        steps = summary.get("steps", 0)
        sent = summary.get("bytes_sent", 0)
        rows.append([
            str(island.index), str((started.get("config") or {}).get("batch_size", "?")), str(steps),
            f"{summary['eval_loss']:.4f}" if summary.get("eval_loss") is not None else "-",
            str(summary.get("tokens", 0)),
            f"{summary.get('syncs_ok', 0)}/{summary.get('syncs_solo', 0)}/{summary.get('syncs_failed', 0)}",
            _bytes(sent), _bytes(sent / steps) if steps else "-", f"{summary.get('wall_seconds', 0):.1f}",
            str(island.proc.returncode),
        ])
    return f"swarm finished in {wall_s:.1f}s\n" + format_table(head, rows)


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return str(n)


def main(argv: list[str], prog: str) -> int:
    try:
        cfg = _parse(argv, prog)
    except SystemExit as e:
        return int(e.code or 0)
    return run_swarm(cfg)

