"""Admission to a swarm by a shared secret (`--swarm-key`): who may talk to the run's DHT and join its rounds.

The bundled p2pd has no pre-shared-key network, so admission is built from
keys derived from the secret (HMAC-SHA256, one key per use):

- **DHT calls**: every request and response of the DHT protocol carries an
  HMAC of the message (`authorizer.SwarmKeyAuthorizer`, hivemind's authorizer hook);
  a node drops requests without a valid one and ignores such responses, so a
  peer without the key can neither bootstrap from, read from nor store to the
  swarm's DHT. Replays are refused by time and nonce, as hivemind's own
  token authorizer does.
- **Names**: the run's DHT keys and libp2p protocol names carry a tag derived
  from the secret (`namespace`), so they cannot be guessed.
- **Rounds**: the data plane's handshake binds both peers' identity keys to a
  key derived from the secret, and every chunk is sealed with it
  (node/net/transport.py).
- **Deposits and state downloads** (libp2p streams, whose peer ids libp2p
  authenticates): the request carries `admission_tag(peer id, what)`, which
  the island checks for the caller's peer id before it reads or sends values.

Pure functions; the authorizer that applies them to DHT calls is in authorizer.py.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

MIN_KEY_BYTES = 16
"""A swarm key shorter than this (after stripping whitespace) is refused: 128 bits at least."""
MAX_CLOCK_SKEW_S = 60.0
"""A signed DHT request older or newer than this is refused (as hivemind's token authorizer does)."""
TAG_BYTES = 16


class SwarmKeyError(ValueError):
    """The swarm key file is missing, unreadable or too short."""


def load_swarm_key(path: str | os.PathLike) -> bytes:
    """The secret in `path` (its bytes, surrounding whitespace stripped)."""
    p = Path(path)
    try:
        raw = p.read_bytes().strip()
    except FileNotFoundError:
        raise SwarmKeyError(f"swarm key file {str(p)!r} does not exist (create one with: islands-node keygen {p})") from None
    except OSError as e:
        raise SwarmKeyError(f"swarm key file {str(p)!r} cannot be read: {e.strerror}") from None
    if len(raw) < MIN_KEY_BYTES:
        raise SwarmKeyError(f"swarm key file {str(p)!r} holds {len(raw)} bytes; a key needs at least {MIN_KEY_BYTES}")
    return raw


def key_file_exposed(path: str | os.PathLike) -> bool:
    """Whether group or others may read the file (the node warns; keys should be owner-only)."""
    try:
        return bool(os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO))
    except OSError:
        return False


def write_swarm_key(path: str | os.PathLike) -> None:
    """A new random key (256 bits, hex), owner-only; refuses to overwrite."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def derive(secret: bytes, purpose: str) -> bytes:
    """A key for one purpose, so that no two uses share a key."""
    return hmac.new(secret, b"compute-islands/v1/" + purpose.encode(), hashlib.sha256).digest()


def namespace(run_id: str, secret: bytes | None) -> str:
    """The prefix of the run's DHT keys: the run id, and with a swarm key a tag derived from it."""
    if secret is None:
        return run_id
    return f"{run_id}-{derive(secret, 'namespace:' + run_id)[:8].hex()}"


def admission_tag(round_key: bytes, peer_id: str, what: str) -> str:
    """What a peer shows to be admitted to one exchange (`what`: a deposit's round, a fragment's
    state) as one peer."""
    return hmac.new(round_key, f"{peer_id}|{what}".encode(), hashlib.sha256).digest()[:TAG_BYTES].hex()


def tag_valid(round_key: bytes, peer_id: str, what: str, tag: object) -> bool:
    return isinstance(tag, str) and hmac.compare_digest(admission_tag(round_key, peer_id, what), tag)
