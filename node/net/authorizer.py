"""The swarm key applied to hivemind's DHT calls (admission.py says how), and the log of refusals."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable

from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.timed_storage import get_dht_time
from islands.protocols.admission import MAX_CLOCK_SKEW_S, derive

logger = logging.getLogger(__name__)


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
