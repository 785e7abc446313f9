"""The signed channel: a message with a wrong or missing MAC is refused before anything is
unpickled; the cluster key file is checked; CURVE keeps out a peer without the key."""

from __future__ import annotations

import pickle
import time

import pytest
import zmq

from bladellm.executor.channel import (MAC_BYTES, BadMessageError, MessageCodec,
                                       make_curve_client, make_curve_server, read_cluster_key)

KEY = b"k" * 32


class _TouchOnLoad:
    """Unpickling this creates a file: the code execution a forged message would get."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_round_trip():
    codec = MessageCodec(KEY)
    msg = (3, "execute_model", ({"a": [1, 2]},))
    assert codec.unpack(codec.pack(msg)) == msg


def test_the_payload_really_runs_code_when_unpickled(tmp_path):
    # The control for the tests below: with the right key the payload does create the file.
    path = tmp_path / "owned"
    MessageCodec(KEY).unpack(MessageCodec(KEY).pack(_TouchOnLoad(str(path))))
    assert path.exists()


@pytest.mark.parametrize("forge", ["wrong_key", "no_mac", "flipped_byte", "truncated"])
def test_forged_message_is_refused_before_unpickling(tmp_path, forge):
    path = tmp_path / "owned"
    payload = pickle.dumps(_TouchOnLoad(str(path)))
    good = MessageCodec(KEY).pack(_TouchOnLoad(str(path)))
    data = {
        "wrong_key": MessageCodec(b"x" * 32).pack(_TouchOnLoad(str(path))),
        "no_mac": payload,
        "flipped_byte": good[:-1] + bytes([good[-1] ^ 1]),
        "truncated": good[:MAC_BYTES],
    }[forge]
    with pytest.raises(BadMessageError):
        MessageCodec(KEY).unpack(data)
    assert not path.exists()


def _key_file(tmp_path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "key"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_read_cluster_key(tmp_path):
    assert read_cluster_key(_key_file(tmp_path, "ab" * 16 + "\n")) == b"ab" * 16


@pytest.mark.parametrize("text, mode, match", [
    (None, 0o600, "cannot read"),
    ("", 0o600, "0 bytes"),
    ("short\n", 0o600, "5 bytes"),
    ("ab" * 16, 0o644, "every user"),
])
def test_bad_cluster_key_file_is_refused(tmp_path, text, mode, match):
    path = str(tmp_path / "missing") if text is None else _key_file(tmp_path, text, mode)
    with pytest.raises(ValueError, match=f"--cluster_key_file.*{match}"):
        read_cluster_key(path)


def test_curve_keeps_out_a_peer_without_the_key():
    ctx = zmq.Context()
    try:
        pub = ctx.socket(zmq.PUB)
        make_curve_server(pub, KEY)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        subs = {}
        for name, key in (("same", KEY), ("other", b"o" * 32), ("plain", None)):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            if key is not None:
                make_curve_client(sub, key)
            sub.connect(f"tcp://127.0.0.1:{port}")
            subs[name] = sub
        deadline = time.monotonic() + 10
        while not subs["same"].poll(100):  # until the handshake is through
            pub.send(b"hello")
            assert time.monotonic() < deadline
        assert subs["same"].recv() == b"hello"
        pub.send(b"again")
        assert subs["same"].poll(2000)
        assert not subs["other"].poll(200) and not subs["plain"].poll(200)
    finally:
        ctx.destroy(linger=0)
