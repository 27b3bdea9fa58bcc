"""The authenticated rendezvous: the job secret admits a worker, anything else is turned away."""

import socket
import threading

import pytest

from hvdplus.common import rendezvous
from hvdplus.common.rendezvous import RendezvousClient, RendezvousServer, RendezvousTimeout, new_secret


@pytest.fixture
def server():
    secret = new_secret()
    srv = RendezvousServer(["127.0.0.1"], secret)
    yield srv, secret
    srv.close()


def _client(srv, secret, timeout=5.0):
    return RendezvousClient("127.0.0.1", srv.port("127.0.0.1"), secret, timeout)


def test_secret_holder_gets_the_store(server):
    srv, secret = server
    client = _client(srv, secret)
    client.set("a", b"1")
    assert client.get("a") == b"1" and client.check(["a"]) and not client.check(["a", "b"])
    assert client.add("n", 2) == 2 and client.add("n", 3) == 5
    assert client.compare_set("c", b"", b"x") == b"x" and client.compare_set("c", b"y", b"z") == b"x"
    assert client.num_keys() == 3 and client.delete("a") and not client.delete("a")
    srv.put("from.launcher", b"v")
    assert client.clone().get("from.launcher") == b"v"
    client.set("result", b"r")
    assert srv.get("result") == b"r" and srv.get("missing") is None
    client.close()


def test_get_waits_for_another_worker(server):
    srv, secret = server
    waiter, setter = _client(srv, secret), _client(srv, secret)
    threading.Timer(0.2, setter.set, args=("late", b"here")).start()
    assert waiter.get("late") == b"here"
    waiter.wait(["late"])


def test_missing_key_times_out_with_its_name(server):
    srv, secret = server
    with pytest.raises(RendezvousTimeout, match="never.set"):
        _client(srv, secret, timeout=0.3).get("never.set")


def test_wrong_secret_is_rejected(server):
    srv, _ = server
    with pytest.raises(PermissionError, match="rejected this worker's secret"):
        _client(srv, new_secret())


def test_server_that_does_not_know_the_secret_is_not_trusted(server):
    srv, secret = server
    impostor = RendezvousServer(["127.0.0.1"], new_secret())
    try:
        with pytest.raises(PermissionError):
            RendezvousClient("127.0.0.1", impostor.port("127.0.0.1"), secret, 5.0)
    finally:
        impostor.close()


def test_unauthenticated_bytes_get_no_answer(server):
    srv, secret = server
    with socket.create_connection(("127.0.0.1", srv.port("127.0.0.1")), timeout=5) as raw:
        greeting = raw.recv(len(rendezvous.MAGIC) + rendezvous.NONCE)
        assert greeting.startswith(rendezvous.MAGIC)
        raw.sendall(b"\0" * (rendezvous.NONCE + rendezvous.MAC))  # a guess at the proof
        assert raw.recv(100) == b""  # closed without a reply
    assert _client(srv, secret).num_keys() == 0  # the server is still fine


def test_tampered_frame_closes_the_connection(server):
    srv, secret = server
    client = _client(srv, secret)
    channel = client._channel
    body = rendezvous._pack(bytes([rendezvous.OPS.index("set")]), b"k", b"v")
    channel.sock.sendall(len(body).to_bytes(4, "big") + body + b"\0" * rendezvous.MAC)  # bad MAC
    with pytest.raises(ConnectionError):
        channel.recv()
    assert srv.get("k") is None


def test_server_binds_only_the_given_address(server):
    srv, _ = server
    assert srv._listeners["127.0.0.1"].server_address[0] == "127.0.0.1"


def test_a_stale_published_secret_is_read_again_until_the_server_takes_it(server, tmp_path):
    """Plain srun: a secret file that a crashed step of the same ids left (a restarted Slurm reuses job ids) is
    read before rank 0 replaces it; the worker reads it again while the server rejects it, then connects."""
    srv, secret = server
    path = str(tmp_path / "srun-5.0.secret")
    rendezvous.publish_secret(path, new_secret())  # the stale one
    tried: list[str] = []

    def connect(candidate):
        tried.append(candidate)
        return _client(srv, candidate)

    threading.Timer(0.3, rendezvous.publish_secret, (path, secret)).start()  # rank 0 publishes its own
    client = rendezvous.with_published_secret(path, connect, timeout=10.0)
    client.set("k", b"v")
    assert srv.get("k") == b"v" and tried[-1] == secret and len(set(tried)) == 2
    client.close()


def test_a_secret_the_server_keeps_rejecting_raises_after_the_timeout(server, tmp_path):
    srv, _ = server
    path = str(tmp_path / "srun-6.0.secret")
    rendezvous.publish_secret(path, new_secret())
    with pytest.raises(PermissionError):
        rendezvous.with_published_secret(path, lambda candidate: _client(srv, candidate), timeout=0.5)
