"""The step server's handshake: both sides prove they hold the shared key; the key is never sent.

    step server -> front-end   CHALLENGE {"nonce": ns}
    front-end -> step server   PROOF {"mac": HMAC-SHA256(key, "tim-step/front-end" + ns), "nonce": nc}
    step server -> front-end   WELCOME {"mac": HMAC-SHA256(key, "tim-step/server" + nc + ns)}
                               or ERROR {"error": ...} (a wrong key), and the connection closes

Nonces are 32 random bytes, sent as hex; MACs are compared with `hmac.compare_digest`. The
handshake's frames are small (`LIMIT`) and the whole of it must complete within a deadline.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import socket
import time

from . import wire

LIMIT = 4096  # the longest handshake frame accepted
NONCE_BYTES = 32
REFUSED = "the step server refused the key"
_HEX = re.compile(r"[0-9a-f]{64}")


class KeyRefused(Exception):
    """The other side does not hold the same key."""


def as_key(key: str | bytes | None) -> bytes:
    """The key as bytes (ValueError if there is none)."""
    if not key:
        raise ValueError("no shared key")
    return key if isinstance(key, bytes) else key.encode()


def _mac(key: bytes, label: bytes, *nonces: bytes) -> str:
    return hmac.new(key, label + b"".join(nonces), hashlib.sha256).hexdigest()


def _field(msg: wire.Message, name: str) -> bytes:
    value = msg.meta.get(name)
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        raise wire.ProtocolError(f"handshake: {wire.KINDS[msg.kind]} without a valid {name!r}")
    return bytes.fromhex(value)


def _expect(sock: socket.socket, kind: int, deadline: float) -> wire.Message:
    msg = wire.recv(sock, max(0.0, deadline - time.monotonic()), limit=LIMIT)
    if msg.kind == wire.ERROR and kind != wire.PROOF:
        raise KeyRefused(str(msg.meta.get("error", REFUSED)))
    if msg.kind != kind:
        raise wire.ProtocolError(f"handshake: a {wire.KINDS[msg.kind]} message where {wire.KINDS[kind]} was due")
    return msg


def challenge(sock: socket.socket, key: bytes, timeout: float) -> None:
    """The step server's side, on a blocking socket: returns once the front-end proved the key.
    KeyRefused (after telling the front-end so), TimeoutError, ConnectionError or ProtocolError."""
    deadline = time.monotonic() + timeout
    ns = secrets.token_bytes(NONCE_BYTES)
    wire.send(sock, wire.Message(wire.CHALLENGE, meta={"nonce": ns.hex()}), timeout)
    proof = _expect(sock, wire.PROOF, deadline)
    nc = _field(proof, "nonce")
    if not hmac.compare_digest(_field(proof, "mac"), bytes.fromhex(_mac(key, b"tim-step/front-end", ns))):
        try:
            wire.send(sock, wire.error(0, REFUSED), max(0.1, deadline - time.monotonic()))
        except OSError:
            pass
        raise KeyRefused("a front-end proved another key")
    wire.send(sock, wire.Message(wire.WELCOME, meta={"mac": _mac(key, b"tim-step/server", nc, ns)}),
              max(0.1, deadline - time.monotonic()))


def answer(sock: socket.socket, key: bytes, timeout: float) -> None:
    """The front-end's side, on a blocking socket: returns once the step server proved the key.
    KeyRefused (either side refused), TimeoutError, ConnectionError or ProtocolError."""
    deadline = time.monotonic() + timeout
    ns = _field(_expect(sock, wire.CHALLENGE, deadline), "nonce")
    nc = secrets.token_bytes(NONCE_BYTES)
    wire.send(sock, wire.Message(wire.PROOF, meta={"mac": _mac(key, b"tim-step/front-end", ns), "nonce": nc.hex()}),
              max(0.1, deadline - time.monotonic()))
    welcome = _expect(sock, wire.WELCOME, deadline)
    if not hmac.compare_digest(_field(welcome, "mac"), bytes.fromhex(_mac(key, b"tim-step/server", nc, ns))):
        raise KeyRefused("the step server did not prove the shared key (it holds another)")
