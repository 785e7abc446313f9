"""Authenticated messages between the engine core and its worker ranks.

Messages are pickles (a ``SchedulerOutput`` carries numpy arrays and dataclasses), and unpickling
bytes from a socket runs whatever code the sender chose. So every message, in both directions,
carries an HMAC-SHA256 of its pickle under a shared secret, and ``unpack`` checks it with
``hmac.compare_digest`` *before* unpickling: bytes from anyone without the key are dropped,
never loaded. Local ranks (IPC sockets in a private directory) use the same code path with a
random per-engine key; ranks on other machines use the key in ``--cluster_key_file``.

With ranks on other machines the sockets also use ZMQ CURVE (required then): the server key
pair is derived from the shared secret, so only holders of the key can even complete the
handshake, and the traffic is encrypted with per-connection keys, so a recorded message cannot
be replayed into another connection. The HMAC stays the guard in front of ``pickle.loads``.

What this does not do: it does not stop a key holder.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import stat
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

MAC_BYTES = hashlib.sha256().digest_size
MIN_KEY_BYTES = 16  # 128 bits: below that a guessed key is within reach


class BadMessageError(ValueError):
    """A message whose MAC is missing or wrong; it was not unpickled."""


def read_cluster_key(path: str) -> bytes:
    """The shared secret in ``--cluster_key_file`` (surrounding whitespace removed, so that
    ``openssl rand -hex 32 > key`` works). Refuses a missing, short or world-accessible file."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as exc:
        raise ValueError(f"--cluster_key_file {path!r}: cannot read it ({exc.strerror})") from None
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        # Anyone on the machine who reads it can make every rank run code of their choosing.
        raise ValueError(f"--cluster_key_file {path!r}: readable or writable by every user; "
                         f"restrict it (chmod 600 {path})")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"--cluster_key_file {path!r}: the key has {len(key)} bytes, needs at "
                         f"least {MIN_KEY_BYTES} (e.g. openssl rand -hex 32 > {path})")
    return key


@dataclass(frozen=True)
class MessageCodec:
    """``pack``: MAC + pickle; ``unpack``: verify, then unpickle."""

    key: bytes

    def _mac(self, payload: bytes | memoryview) -> bytes:
        return hmac.new(self.key, payload, hashlib.sha256).digest()

    def pack(self, obj: Any) -> bytes:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return self._mac(payload) + payload

    def verify(self, data: bytes) -> bool:
        """Whether ``data`` carries a valid MAC (nothing is unpickled)."""
        view = memoryview(data)
        return len(data) > MAC_BYTES and hmac.compare_digest(
            bytes(view[:MAC_BYTES]), self._mac(view[MAC_BYTES:]))

    def unpack(self, data: bytes) -> Any:
        if not self.verify(data):
            raise BadMessageError(f"message of {len(data)} bytes without a valid MAC (another "
                                  "--cluster_key_file, or not from this engine)")
        return pickle.loads(memoryview(data)[MAC_BYTES:])


# ---- ZMQ CURVE on the TCP sockets --------------------------------------------------------------


def require_curve() -> None:
    if not zmq.has("curve"):
        raise ValueError("--nnodes > 1 needs libzmq built with CURVE (pip's pyzmq wheels are): "
                         "the node channel is encrypted and replay-proof only with it")


def _server_keys(key: bytes) -> tuple[bytes, bytes]:
    """A CURVE key pair every key holder derives alike: (public, secret), Z85-encoded."""
    secret = z85.encode(hmac.new(key, b"bladellm curve server", hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def make_curve_server(sock: zmq.Socket, key: bytes) -> None:
    """Before ``bind``: peers must know the key-derived public key to connect."""
    require_curve()
    public, secret = _server_keys(key)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def make_curve_client(sock: zmq.Socket, key: bytes) -> None:
    """Before ``connect``: a fresh client key pair, the server's key-derived public key."""
    require_curve()
    public, secret = zmq.curve_keypair()
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = _server_keys(key)[0]
