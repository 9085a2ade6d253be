"""Admission to a swarm by a shared secret (`--swarm-key`): who may talk to the run's DHT and join its rounds.

The bundled p2pd has no pre-shared-key network, so admission is built from
keys derived from the secret (HMAC-SHA256, one key per use):

- **DHT calls**: every request and response of the DHT protocol carries an
  HMAC of the message (`SwarmKeyAuthorizer`, hivemind's authorizer hook);
  a node drops requests without a valid one and ignores such responses, so a
  peer without the key can neither bootstrap from, read from nor store to the
  swarm's DHT. Replays are refused by time and nonce, as hivemind's own
  token authorizer does.
- **Names**: the run's DHT keys and the averagers' matchmaking prefixes carry
  a tag derived from the secret (`namespace`), so they cannot be guessed.
- **Rounds**: hivemind's authorizer does not cover averaging RPCs. Every
  member puts `admission_tag(peer id, group key)` into its join request; a
  leader refuses a join without a valid tag for the caller's libp2p peer id
  (authenticated by the transport), and after a round every member checks
  every other member's tag (`untagged_members`).

Pure functions, plus the authorizer (async, no I/O of its own).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

logger = logging.getLogger(__name__)

MIN_KEY_BYTES = 16
"""A swarm key shorter than this (after stripping whitespace) is refused: 128 bits at least."""
MAX_CLOCK_SKEW_S = 60.0
"""A signed DHT request older or newer than this is refused (as hivemind's token authorizer does)."""
TAG_BYTES = 16


class SwarmKeyError(ValueError):
    """The swarm key file is missing, unreadable, too short or readable by others."""


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


def admission_tag(round_key: bytes, peer_id: str, group_key: str) -> str:
    """What a member shows to be admitted to one round (group key) as one peer."""
    return hmac.new(round_key, f"{peer_id}|{group_key}".encode(), hashlib.sha256).digest()[:TAG_BYTES].hex()


def tag_valid(round_key: bytes, peer_id: str, group_key: str, tag: object) -> bool:
    return isinstance(tag, str) and hmac.compare_digest(admission_tag(round_key, peer_id, group_key), tag)


def untagged_members(round_key: bytes, group_key: str, gathered: Mapping[str, object]) -> list[str]:
    """Members (peer id -> gathered metadata) of a round that did not show a valid tag for it."""
    return [
        peer for peer, meta in gathered.items()
        if not (isinstance(meta, Mapping) and tag_valid(round_key, peer, group_key, meta.get("auth")))
    ]


class SwarmKeyAuthorizer(AuthorizerBase):
    """hivemind's authorizer hook, with an HMAC of each DHT message under a key derived from the secret.

    `on_refused(what)` is called (in the DHT's process) for every refused request or response;
    `peer_id` is put into requests so that a refusal can name the caller (unauthenticated)."""

    def __init__(self, secret: bytes, peer_id: str = "", on_refused: Callable[[str], None] | None = None):
        self._key = derive(secret, "dht")
        self.peer_id = peer_id
        self.on_refused = on_refused or (lambda what: None)
        self._nonces: dict[bytes, float] = {}

    def _mac(self, message) -> bytes:
        return hmac.new(self._key, message.SerializeToString(deterministic=True), hashlib.sha256).digest()

    async def sign_request(self, request, service_public_key) -> None:
        auth = request.auth
        auth.client_access_token.username = self.peer_id
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(12)
        auth.signature = b""
        auth.signature = self._mac(request)

    async def validate_request(self, request) -> bool:
        auth = request.auth
        signature, who = auth.signature, auth.client_access_token.username or "a peer"
        auth.signature = b""
        ok = hmac.compare_digest(signature, self._mac(request))
        auth.signature = signature
        if not ok:
            self._refuse(f"DHT request from {who} not signed with this swarm's key")
            return False
        now = get_dht_time()
        if abs(auth.time - now) > MAX_CLOCK_SKEW_S or auth.nonce in self._nonces:
            self._refuse(f"DHT request from {who} replayed or from a clock {auth.time - now:+.0f}s off")
            return False
        self._nonces[auth.nonce] = now
        if len(self._nonces) > 10_000:  # forget nonces too old to be accepted anyway
            self._nonces = {n: t for n, t in self._nonces.items() if now - t <= 2 * MAX_CLOCK_SKEW_S}
        return True

    async def sign_response(self, response, request) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._mac(response)

    async def validate_response(self, response, request) -> bool:
        if response is None:
            return False
        auth = response.auth
        signature = auth.signature
        auth.signature = b""
        ok = hmac.compare_digest(signature, self._mac(response)) and auth.nonce == request.auth.nonce
        auth.signature = signature
        if not ok:
            self._refuse("DHT response not signed with this swarm's key (wrong --swarm-key, here or there?)")
        return ok

    def _refuse(self, what: str) -> None:
        logger.warning("refused: %s", what)
        try:
            self.on_refused(what)
        except Exception:  # noqa: BLE001 - reporting must never break the DHT
            pass


class RefusalLog:
    """Refusals seen in the DHT's process, passed to the node's process (a pipe made before the fork)."""

    def __init__(self):
        import multiprocessing as mp

        self._queue = mp.get_context("fork").SimpleQueue()
        self._last: dict[str, float] = {}

    def __call__(self, what: str) -> None:  # in the DHT's process: at most one report per kind a second
        now = time.monotonic()
        if now - self._last.get(what, float("-inf")) >= 1.0:
            self._last[what] = now
            self._queue.put(what)

    def drain(self) -> list[str]:
        out = []
        while not self._queue.empty():
            out.append(self._queue.get())
        return out
