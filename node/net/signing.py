"""A node's identity key, and the peer id that owns a signed record.

The identity file is libp2p's (a protobuf-wrapped RSA key, as hivemind writes
it): the same key makes the node's peer id and signs its DHT records, so a
record signed by a key can be tied to exactly one peer id.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import base58
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

_OWNER_RE = re.compile(rb"^\[owner:(.+?)\]$")
_SHA2_256 = b"\x12\x20"  # multihash prefix: sha2-256, 32 bytes


class IdentityError(ValueError):
    """The identity file cannot be created or read as an RSA key."""


def load_identity(path: Path) -> tuple[RSAPrivateKey, str]:
    """(private key, peer id) from `path`; a new key is written there, owner-only, if it is missing."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        P2P.generate_identity(str(path))  # RSA 2048, mode 0400
    try:
        data = path.read_bytes()
        der = crypto_pb2.PrivateKey.FromString(data).data
        private = serialization.load_der_private_key(der, password=None)
    except (OSError, ValueError, TypeError) as e:
        raise IdentityError(f"identity file {str(path)!r} is not a readable libp2p RSA key: {e}") from None
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise IdentityError(f"identity file {str(path)!r} is not a libp2p key: {e!r}") from None
    if not isinstance(private, rsa.RSAPrivateKey):
        raise IdentityError(f"identity file {str(path)!r} holds a {type(private).__name__}, not an RSA key")
    if os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o600)
    key = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind's wrapper has no loader of its own
    key._private_key = private
    return key, peer_id_of(private.public_key())


def peer_id_of(public_key: rsa.RSAPublicKey) -> str:
    """libp2p's peer id of an RSA key: the sha2-256 multihash of its protobuf-wrapped DER."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return base58.b58encode(_SHA2_256 + hashlib.sha256(wrapped).digest()).decode()


def owner_peer_id(subkey: object) -> str | None:
    """The peer id whose key signed a record stored under `subkey` (hivemind's `[owner:...]` marker), or
    None if the subkey is not such a marker. The signature itself is checked by hivemind's validator."""
    if not isinstance(subkey, bytes):
        return None
    m = _OWNER_RE.match(subkey)
    if m is None:
        return None
    try:
        public = serialization.load_ssh_public_key(m.group(1))
    except (ValueError, TypeError):
        return None
    if not isinstance(public, rsa.RSAPublicKey):
        return None
    return peer_id_of(public)
