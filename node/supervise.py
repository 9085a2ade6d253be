"""Nothing outlives the node: a watchdog that takes the node's process group down if the node dies.

hivemind's DHT is a child process, and p2pd is its child; a
SIGKILL of the node would leave them running as a ghost peer that still
answers. The watchdog is forked first thing; it waits for the node to exit
and, unless the node said goodbye (a clean exit has already shut its
children down), SIGKILLs the node's process group. The node leads its own
group as a shell job, a systemd service or a test's `start_new_session`; started
by a script without job control it makes one; only inside a terminal's
foreground pipeline does it go without (it must not leave the terminal's group).
"""

from __future__ import annotations

import os
import select
import signal

GOODBYE = b"bye"


class Watchdog:
    def __init__(self, write_fd: int | None):
        self._fd = write_fd

    def goodbye(self) -> None:
        """A clean exit: the children are down, the watchdog leaves the group alone."""
        if self._fd is not None:
            try:
                os.write(self._fd, GOODBYE)
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def start_watchdog() -> Watchdog:
    if not hasattr(os, "pidfd_open"):
        return Watchdog(None)
    if os.getpgid(0) != os.getpid() and not os.isatty(0):
        # started by a script without job control: lead a group of our own (no terminal's
        # Ctrl-C to lose); on a terminal, stay in the shell's job and go without the watchdog
        try:
            os.setpgid(0, 0)
        except OSError:
            return Watchdog(None)
    if os.getpgid(0) != os.getpid():
        return Watchdog(None)
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        os.close(read_fd)
        return Watchdog(write_fd)
    # the watchdog: no Python cleanup, no signal handlers of the node
    try:
        os.close(write_fd)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pidfd = os.pidfd_open(parent)
        said = b""
        while True:
            ready, _, _ = select.select([pidfd, read_fd], [], [])
            if read_fd in ready:
                chunk = os.read(read_fd, 16)
                said += chunk
                if said.startswith(GOODBYE):
                    os._exit(0)
                if not chunk:  # the node is gone without a goodbye
                    break
            if pidfd in ready:
                break
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(0)
