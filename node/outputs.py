"""Where a run reports: its event log, the progress line, metrics, and the run's counters."""

from __future__ import annotations

import dataclasses
from collections import deque
from pathlib import Path

from islands.protocols.diloco import OUTCOMES
from islands.protocols.validation import BAN_S

from .config import Config
from .daemon import StartupError
from .events import EventLog, rotate
from .metrics import Metrics
from .network import Network
from .progress import Progress


def new_totals() -> dict:
    """The run's counters, as the checkpoint keeps them."""
    return {
        "tokens": 0,
        "compute_seconds": 0.0,
        "wall_seconds": 0.0,
        "bytes_sent": 0,
        "bytes_recv": 0,
        "final_loss": None,
        **{f"syncs_{o}": 0 for o in OUTCOMES},
    }


@dataclasses.dataclass
class Finish:
    """What the end of the run found."""

    checkpoint: Path | None = None
    eval_loss: float | None = None
    global_eval_loss: float | None = None


@dataclasses.dataclass
class Outputs:
    """Where the run reports: its event log, the progress line, and metrics if asked for."""

    events: EventLog
    progress: Progress
    metrics: Metrics | None = None

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()

    @classmethod
    def open(cls, cfg: Config, run_dir: Path, network: Network) -> Outputs:
        """The event log (the last one rotated), the progress line and the metrics endpoint of a run."""
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        rotate(cfg.output.event_log_path)
        events = EventLog(cfg.output.event_log_path)
        progress = Progress(cfg.output.progress, f"{cfg.net.role} {network.peer_id[-8:]}", cfg.train.steps)
        metrics = None
        if cfg.net.metrics_port is not None:
            try:
                metrics = Metrics(cfg.net.metrics_host, cfg.net.metrics_port, {"run_id": cfg.net.run_id, "role": cfg.net.role, "peer_id": network.peer_id})
            except OSError as e:
                progress.close()
                raise StartupError(f"metrics_port {cfg.net.metrics_port}: cannot listen on {cfg.net.metrics_host}: {e.strerror}") from None
            progress.note(f"metrics at http://{cfg.net.metrics_host}:{metrics.port}/metrics")

        def on_refused(what: str) -> None:
            events.emit("refused", what=what)
            if metrics is not None:
                metrics.refused.inc()

        def on_banned(peer: str) -> None:
            events.emit("banned", peer=peer, seconds=BAN_S)
            progress.note(f"banned peer {peer} for {BAN_S:.0f}s: its rounds were rejected repeatedly")

        network.on_refused, network.on_banned = on_refused, on_banned
        return cls(events, progress, metrics)

    def summarize(self, reason: str, step: int, totals: dict, finish: Finish) -> None:
        """The `stopped` and `summary` events, the log closed, and the last progress note."""
        self.events.emit("stopped", reason=reason, step=step)
        summary = self.events.emit(
            "summary",
            steps=step,
            final_loss=totals["final_loss"],
            eval_loss=finish.eval_loss,
            global_eval_loss=finish.global_eval_loss,
            tokens=totals["tokens"],
            compute_seconds=round(totals["compute_seconds"], 3),
            wall_seconds=round(totals["wall_seconds"], 3),
            bytes_sent=totals["bytes_sent"],
            bytes_recv=totals["bytes_recv"],
            **{f"syncs_{o}": totals[f"syncs_{o}"] for o in OUTCOMES},
            checkpoint=str(finish.checkpoint),
        )
        self.events.close()
        self.progress.note(
            f"{reason} at step {step}: loss {_fmt(summary['final_loss'])}, eval_loss {_fmt(finish.eval_loss)}, "
            f"{totals['tokens']} tokens, syncs ok/solo/failed {totals['syncs_ok']}/{totals['syncs_solo']}/{totals['syncs_failed']}; "
            f"checkpoint {finish.checkpoint}"
        )


def rate(recent: deque[tuple[float, int]]) -> float:
    """Tokens a second over the recent (time, tokens) steps."""
    if len(recent) < 2:
        return 0.0
    span = recent[-1][0] - recent[0][0]
    return sum(n for _, n in list(recent)[1:]) / span if span > 0 else 0.0


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"
