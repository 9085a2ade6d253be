"""The follower ranks that `islands-node --nproc N` starts: launched as children that die with
the node, each writing its stderr to its own log; a rank that ended badly is reported with the
end of that log (a crash's Python stacks are there)."""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import logging
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


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


def rank_log_path(run_dir: str | Path, rank: int) -> Path:
    """Where a follower rank that `islands-node --nproc N` started writes its stderr: its warnings,
    and the Python stacks of its threads if it crashes (faulthandler)."""
    return Path(run_dir) / f"rank{rank}.log"


@dataclasses.dataclass
class Worker:
    """A follower rank started by `launch_workers`."""

    rank: int
    proc: subprocess.Popen
    log: Path


def launch_workers(argv: Sequence[str], nproc: int, environ: Mapping[str, str], run_dir: str | Path) -> tuple[dict[str, str], list[Worker]]:
    """`islands-node --nproc N`: start ranks 1..N-1 as children (same options), each writing its stderr
    to `rank_log_path(run_dir, rank)`; returns the environment rank 0 runs under and the workers. They
    die with the node (parent-death signal, process group)."""
    port = free_port()
    base = {**environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc)}
    Path(run_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
    workers = []
    for r in range(1, nproc):
        log = rank_log_path(run_dir, r)
        with open(log, "ab") as out:  # the child keeps its own descriptor
            out.write(f"--- rank {r} of {nproc}, {datetime.datetime.now().isoformat(timespec='seconds')}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", "islands.node", *argv],
                env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                preexec_fn=_die_with_parent,
            )
        workers.append(Worker(r, proc, log))
    return {**base, "RANK": "0", "LOCAL_RANK": "0"}, workers


def exit_description(status: int) -> str:
    """`status 1`, or `signal SIGSEGV` for a process a signal ended (Popen's negative status)."""
    if status >= 0:
        return f"status {status}"
    try:
        return f"signal {signal.Signals(-status).name}"
    except ValueError:
        return f"signal {-status}"


CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL}
"""The signals on which faulthandler writes the Python stacks."""
TAIL_LINES = 40
"""How much of a rank's log rank 0 repeats when the rank exited badly."""


def _tail(path: Path, num_lines: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    lines = [line for line in lines if not line.startswith("Extension modules:")]  # faulthandler's, long and of no use here
    return "\n".join("    " + line for line in lines[-num_lines:])


def stop_workers(workers: Sequence[Worker], timeout_s: float = 10.0) -> None:
    """Wait for the followers to leave (killed after `timeout_s`); a rank that exited badly is logged
    with the end of its log (a crash's Python stacks are there)."""
    for w in workers:
        if w.proc.poll() is None:
            try:
                w.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("rank %d did not leave within %gs: killed; its log is %s", w.rank, timeout_s, w.log)
                w.proc.kill()
                w.proc.wait(timeout=10)
                continue
        if w.proc.returncode:
            line = f"rank {w.rank} exited with {exit_description(w.proc.returncode)}; its log is {w.log}"
            if -w.proc.returncode in CRASH_SIGNALS:
                line += " (the Python stacks of its threads at the crash are at its end)"
            logger.warning("%s; it ends:\n%s", line, _tail(w.log, TAIL_LINES))
