"""`islands-node`: the command line. Only this module reads argv, the environment and signals."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from .config import ConfigError, add_arguments, build_config

PROG = "islands-node"
SUBCOMMANDS = ("run", "check-config", "status", "swarm", "relay", "keygen")

DESCRIPTION = """\
Train one model across compute islands with Streaming DiLoCo.

With no --join, starts a new swarm and trains; with --join MADDR, joins one.
Options may also come from a TOML file (--config FILE, keys as the long options
with _ for -) and from ISLANDS_* environment variables (ISLANDS_WINDOW=20);
precedence: defaults < file < environment < command line.

subcommands:
  islands-node [run] [options]       run a node (the default)
  islands-node status --join MADDR   the swarm as a table (--json for machines)
  islands-node swarm --islands N     N local islands on loopback: the one-command demo
  islands-node check-config FILE     validate a TOML config without starting
  islands-node keygen PATH           write a new swarm key (owner-only) for --swarm-key
  islands-node relay --to HOST:PORT  emulate a long link in front of a node (delay, rate, contact)
"""


class _Parser(argparse.ArgumentParser):
    """Errors are one line and exit status 2, never a usage dump or a traceback."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _run_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    add_arguments(parser)
    return parser


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None, environ: dict | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ if environ is None else environ)
    command = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "run"
    if command == "check-config":
        return _check_config(argv, environ)
    if command == "keygen":
        return _keygen(argv)
    if command == "status":
        from .status import main as status_main

        _setup_logging(0)
        return status_main(argv, PROG)
    if command == "relay":
        from .relay import main as relay_main

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return relay_main(argv, PROG)
    if command == "swarm":
        from .swarm import main as swarm_main

        return swarm_main(argv, PROG)
    parser = _run_parser()
    try:
        args = vars(parser.parse_args(argv))
    except SystemExit as e:  # --help, or a bad option (already reported in one line)
        return int(e.code or 0)
    verbose = args.pop("verbose")
    try:
        cfg = build_config(args, environ)
    except ConfigError as e:
        return _fail(str(e))
    _setup_logging(verbose)
    return _run_node(cfg, argv, environ)


def _check_config(argv: list[str], environ: dict) -> int:
    parser = _Parser(prog=f"{PROG} check-config", description="Validate a TOML config file (with the ISLANDS_* environment) without starting a node.")
    parser.add_argument("file", help="the TOML file")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        cfg = build_config({"config": args.file}, environ)
    except ConfigError as e:
        return _fail(str(e))
    print(f"{args.file}: ok ({cfg.train.model} model, window {cfg.diloco.window}, {cfg.diloco.fragments} fragments, overlap {cfg.diloco.tau})")
    return 0


def _keygen(argv: list[str]) -> int:
    from islands.protocols.admission import write_swarm_key

    parser = _Parser(
        prog=f"{PROG} keygen",
        description="Write a new random swarm key (256 bits, owner-only). Copy it to every island of the run "
        "over a channel you trust, and start each with --swarm-key PATH.",
    )
    parser.add_argument("path", help="the file to create (never overwritten)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        write_swarm_key(args.path)
    except FileExistsError:
        return _fail(f"{args.path} exists; a key is never overwritten")
    except OSError as e:
        return _fail(f"cannot write {args.path}: {e.strerror}")
    print(f"wrote a new swarm key to {args.path}")
    return 0


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # hivemind reports every failed round as an ERROR with a traceback; the event log says it better.
    # It sets its own level when first imported, so import it first.
    import hivemind  # noqa: F401

    logging.getLogger("hivemind").setLevel(logging.CRITICAL if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG)


def _run_node(cfg, argv: list[str], environ: dict) -> int:
    from .daemon import Shutdown, StartupError, follow
    from .loop import Island
    from .ranks import RankEnv
    from .supervise import start_watchdog
    from .workers import launch_workers, stop_workers

    try:
        ranks = RankEnv.from_environ(environ)
    except ValueError as e:
        return _fail(str(e))
    if ranks is not None and ranks.rank > 0:  # a follower rank of a multi-rank island: no network, no files
        # rank 0 ends it (a stop message, or its death); a signal to the whole group (Ctrl-C, systemd
        # stopping the unit) must not take it out from under rank 0's graceful leave
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        end_follower(follow(cfg, ranks))
    workers = []
    watchdog = start_watchdog()  # first: the workers join the node's process group and go with it
    if ranks is None and cfg.train.nproc > 1:
        rank0, workers = launch_workers(argv, cfg.train.nproc, environ, cfg.output.run_dir)
        os.environ.update(rank0)  # torch.distributed's rendezvous reads MASTER_ADDR/PORT from here
        ranks = RankEnv.from_environ(rank0)
    elif ranks is not None:
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            if name in environ:
                os.environ[name] = environ[name]

    async def serve() -> int:
        shutdown = Shutdown()
        loop = asyncio.get_running_loop()
        signals_seen = []

        def on_signal(sig: signal.Signals) -> None:
            signals_seen.append(sig)
            if len(signals_seen) > 1:  # a second signal: stop now (the last checkpoint is intact)
                os._exit(128 + sig)
            shutdown.request(f"signal {sig.name}")

        def install_handlers() -> None:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, on_signal, sig)

        install_handlers()
        island = Island(cfg, ranks, rank_logs=[w.log for w in workers])
        return await island.run(shutdown, announce=lambda line: print(line, flush=True), ready=install_handlers)

    try:
        return _event_loop_run(serve)
    except StartupError as e:
        return _fail(str(e))
    finally:
        stop_workers(workers)
        watchdog.goodbye()


def end_follower(status: int) -> NoReturn:
    """A follower rank's last act: exit at once, without interpreter finalization. Its last collective
    has just returned, and gloo's worker thread may still hold that collective's tensor: releasing it
    frees a Python object, which takes the GIL, and a thread that takes the GIL while the interpreter
    finalizes is made to exit in the middle of a C++ destructor: the process aborts ("terminate called
    without an active exception", SIGABRT) or, later in finalization, crashes (SIGSEGV). A follower
    holds no files and no network, so nothing is lost: its log is flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _event_loop_run(coro_fn) -> int:
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it installs
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro_fn())


def entry() -> None:
    # a crash (SIGSEGV, SIGABRT, ...) leaves the Python stacks of every thread on stderr: a follower
    # rank's stderr is its log (workers.rank_log_path), rank 0 points there when a rank fails. In the
    # process entry point only: main() also runs in-process, where stderr may have no descriptor.
    faulthandler.enable(all_threads=True)
    sys.exit(main())
